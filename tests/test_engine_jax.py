"""Generated modules and mkc.runtime on the serving engine's JAX: vLLM TPU pins jax 0.11.2 and
libtpu 0.0.48 (tpu-inference 0.32.0), mkc's compiler runs on its own. In a second environment
built from those pins (`./dev engine-setup`, .venv-engine), a MINI module runs a decode step in
interpret mode within the exact bound of its rounding emulation, and libtpu 0.0.48 compiles a
full-size kernel, a decode and a verify step."""
import json
import os
import subprocess

import pytest

from conftest import run_python
from mkc.numerics import host_facts
from tests_support import ROOT, assert_within_exact_bound, run_example

ENGINE = {"jax": "0.11.2", "jaxlib": "0.11.2", "libtpu": "0.0.48"}


@pytest.fixture(scope="module")
def engine_python() -> str:
    """.venv-engine's interpreter, built (or found current) by `./dev engine-setup`."""
    r = subprocess.run([str(ROOT / "dev"), "engine-setup"], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    python = str(ROOT / ".venv-engine" / "bin" / "python")
    r = run_python(["-c", "import importlib.metadata as m, json; print(json.dumps("
                    f"{{p: m.version(p) for p in {sorted(ENGINE)}}}))"], timeout=60, python=python)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout) == ENGINE
    return python


# Within the exact bound, not to the bit, and with jaxlib 0.11.2's YNNPACK fusions off: they pick
# their dot kernels by the CPU they find, whatever the ISA cap (mkc.numerics.pin_cpu_isa). On an
# AMX Xeon (December 2026) the MINI Qwen step then left the emulation by 2.1e-4 in the logits
# and 1.3e-4 in the value cache (17-27x the exact bound); with them off, 1.7e-7 in the logits
# and the states to the bit. The engine serves TPUs: its CPU
# fusions are not what runs there. On jax 0.12 the module is bit-equal
# (tests/test_interpret_mini.py).
YNN_FUSIONS_OFF = "--xla_cpu_experimental_ynn_fusion_type="


@pytest.mark.slow
def test_a_mini_module_runs_within_the_exact_bound_on_the_engine_s_jax(engine_python, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {YNN_FUSIONS_OFF}".strip())
    assert_within_exact_bound(run_example("examples/run_mini.py", "--steps", "1", "--batch", "2",
                                          timeout=900, python=engine_python))


@pytest.mark.slow
def test_the_engine_s_libtpu_compiles_a_full_size_kernel(engine_python):
    # Llama 3.1 8B is one chip (tpu7x 1x1x1), a slice smaller than a host: libtpu 0.0.48 lays
    # it out only with the slice's own host bounds (mkc.target.topology_devices).
    code = ("from mkc import confirm; import json; print(json.dumps(["
            "confirm.compile_module('generated/llama_3_1_8b.py', 1), "
            "confirm.compile_module('generated/llama_3_1_8b.py', 2, 8)]))")
    r = run_python(["-c", code], timeout=900, python=engine_python)
    assert r.returncode == 0, r.stderr[-3000:]
    decode, verify = json.loads(r.stdout.splitlines()[-1])
    assert decode["topology"] == verify["topology"] == "tpu7x=1x1x1"
    assert decode["devices"] == verify["devices"] == 2


# jaxlib 0.11.2 hands some of a kernel's dots to YNNPACK and not the emulation's, and YNNPACK's
# kernels follow the CPU found. On an AMX Xeon (December 2026) MINI Qwen3.5 MoE's step 0 then
# picks another expert in row 1 (logits 2.4e-3 from the emulation); with YNNPACK's fusions off
# (`--xla_cpu_experimental_ynn_fusion_type=`) it is bit-equal, but K3 MINI parts as far, so
# neither setting holds both there. On jax 0.12 both are bit-equal on that host.
_YNN_ON_AMX = pytest.mark.xfail("amx_bf16" in host_facts()["isa"], strict=False,
                                reason="jaxlib 0.11.2's YNNPACK dots on an AMX host")


@pytest.mark.extended
@pytest.mark.parametrize("script, args", [
    pytest.param("examples/run_mini.py", ("--spec", "schedules/qwen3_5_35b_a3b.sched",
                                          "--model", "qwen3_5_moe_mini"), marks=_YNN_ON_AMX),
    ("examples/run_mini.py", ("--spec", "schedules/gpt_oss_20b.sched", "--model", "gpt_oss_mini")),
    ("examples/run_mini.py", ("--spec", "schedules/llama_3_1_70b.sched", "--model", "llama_mini")),
    ("examples/run_mini.py", ("--spec", "schedules/qwen3_30b_a3b.sched", "--model", "qwen3_moe_mini")),
    ("examples/run_k3_mini.py", ()),
], ids=["qwen3_5_moe", "gpt_oss", "llama", "qwen3_moe", "kimi_k3"])
def test_every_family_runs_within_the_exact_bound_on_the_engine_s_jax(engine_python, script, args):
    assert_within_exact_bound(run_example(script, *args, "--steps", "2", "--batch", "2",
                                          timeout=1800, python=engine_python))


@pytest.mark.extended
def test_mkc_serve_on_the_engine_s_jax_equals_greedy_decoding(engine_python):
    import sys
    sys.path.insert(0, str(ROOT / "tests" / "serve"))
    import openai
    from serve_process import MODEL, SPEC, cpu_env, reference_greedy, token_ids

    from mkc.serve import launch
    greedy = reference_greedy()
    with launch.running_server(SPEC, MODEL, ["--batch", "2"], env=cpu_env(),
                               python=engine_python) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        for prompt, n in [([5, 17, 99], 3), ([1000], 2)]:
            choice = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n,
                                               temperature=0).choices[0]
            assert token_ids(choice) == greedy(prompt, n)[0]
