"""MINI Qwen, compiled from the shipped spec, runs in TPU interpret mode on 8 virtual CPU
devices and matches the pure-JAX reference: logits, next token, recurrent and conv states and
the KV caches."""
import json

import pytest

from conftest import run_python
from mkc.checkpoint import save_checkpoint
from mkc.reference import qwen3_5 as reference
from tests_support import ROOT, run_example


def _run(*args: str) -> dict:
    return run_example("examples/run_mini.py", *args, timeout=1200)


def _assert_matches_reference(summary: dict) -> None:
    assert summary["steps"]
    for s in summary["steps"]:
        # bf16 weights and bf16-staged activations vs an f32 reference
        assert s["logits_max_abs_err"] < 0.03 * s["logits_max_abs"], s
        assert s["next_token"] == s["ref_next_token"], s
        # ~2^-8: activations enter the MXU as bf16, the reference keeps them f32
        assert s["state_rel_err"] < 1.5e-2, s
        assert s["state_max_abs_err"] < 0.02 * max(1.0, s["state_max_abs"]), s
        # conv state and KV caches: bf16 entries, so one rounding step apart at most
        for kind, err in s["cache_rel_err"].items():
            assert err < 1.5e-2, (kind, s)


@pytest.mark.slow
def test_on_wait_from_an_hf_checkpoint(tmp_path):
    """Round trip: a checkpoint written here loads and runs through the generated kernel."""
    config = json.loads((ROOT / "mkc/model/configs/qwen3_8_mini.json").read_text())
    params = reference.init_params(reference.load_config(config), seed=7)
    save_checkpoint(tmp_path, config, params)
    summary = _run("--checkpoint", str(tmp_path), "--mode", "on_wait", "--steps", "3",
                   "--batch", "3")
    _assert_matches_reference(summary)


@pytest.mark.slow
def test_eager_dma_mode_at_the_largest_batch():
    _assert_matches_reference(_run("--mode", "eager", "--steps", "2", "--batch", "8"))


@pytest.mark.slow
def test_no_races_with_race_detection():
    summary = _run("--mode", "on_wait", "--races", "--steps", "2", "--batch", "1")
    _assert_matches_reference(summary)
    assert summary["races_found"] is False


def test_race_detector_flags_a_known_race():
    """Guards the race test above against a detector that silently stopped working."""
    r = run_python(["tests/race_detector_canary.py"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RACES=True" in r.stdout


@pytest.mark.slow
def test_f32_wire_all_reduce(tmp_path):
    """The other wire dtype: gqa layers reduce in f32 over the wire."""
    spec = tmp_path / "qwen_f32_wire.sched"
    text = (ROOT / "schedules" / "qwen3_8_27b.sched").read_text()
    assert "o_proj, down direct wire bf16" in text
    spec.write_text(text.replace("o_proj, down direct wire bf16", "o_proj, down direct wire f32"))
    _assert_matches_reference(_run("--spec", str(spec), "--steps", "1", "--batch", "2"))
