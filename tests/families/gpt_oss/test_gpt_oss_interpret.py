"""MINI GPT-OSS, compiled from the shipped 20b spec (one chip, 2 cores) by the generic module
template, runs in TPU interpret mode on virtual CPU devices and matches the family's reference
at every step, from the kernel's own state: bit for bit against its rounding emulation, and
plainly on the rows that are not near-ties; in both DMA modes, race-free; and a 1 % error in a
sink logit or in a bias (q/k/v, o_proj, router, an expert's down projection) is rejected by
the emulation.

The spec's sliding layers keep their KV cache as the window's ring (`kv ring 256 slots`, the
core's mechanism): with the MINI's 128-token window, row 1 (position 151 and on) runs past it.
The ring tests below cut the window to 8 and the ring to 32 slots, so every row runs past the
window and past the ring's wrap, for window + 2 steps and more."""
import pytest

from tests_support import ROOT, assert_bit_equal, assert_each_mutant_rejected, run_example

SPEC = str(ROOT / "schedules" / "gpt_oss_20b.sched")
MUTANTS = ("oss.sink", "oss.qkv_bias", "oss.o_bias", "oss.router_bias", "oss.expert_bias")


def _run(*args: str) -> dict:
    # rows b at positions 20 + 131 b: row 0 inside the window, row 1 past it
    return run_example("examples/run_mini.py", "--spec", SPEC, "--model", "gpt_oss_mini",
                       "--first-position", "20", *args, timeout=1800)


def _assert_bit_equal(summary: dict) -> None:
    assert_bit_equal(summary)
    assert all(s["plain_rows"] for s in summary["steps"]), summary["steps"]


@pytest.mark.slow
def test_on_wait_three_steps_bit_equal_and_mutants_are_rejected():
    summary = _run("--mode", "on_wait", "--steps", "3", "--batch", "2",
                   "--mutants", ",".join(MUTANTS), "--mutants-from", "1", "--mutant-steps", "1")
    _assert_bit_equal(summary)
    assert_each_mutant_rejected(summary, MUTANTS)


@pytest.mark.extended
def test_eager_at_the_largest_batch_cycles_experts_through_the_slots():
    """Batch 8 with top 2 of 8 experts: each core's 4 local experts cycle through the spec's 2
    slots; eager DMAs land as soon as issued."""
    _assert_bit_equal(_run("--mode", "eager", "--steps", "2", "--batch", "8"))


@pytest.mark.extended
def test_the_120b_spec_with_an_eight_head_mini_checkpoint(tmp_path):
    """The 120b spec (8 cores, attention projections pooled with the experts, KV heads
    replicated: 2 over 8 head parts) on the MINI with 8 query heads, saved as a checkpoint
    (MXFP4 blocks and scales through mkc.checkpoint): bit-equal to the emulation."""
    import json

    from mkc.checkpoint import save_checkpoint
    from mkc.families.gpt_oss import reference
    from mkc.model.config import CONFIG_DIR
    config = json.loads((CONFIG_DIR / "gpt_oss_mini.json").read_text()) | {"num_attention_heads": 8}
    save_checkpoint(tmp_path, config, reference.init_params(reference.load_config(config), seed=0))
    summary = run_example("examples/run_mini.py", "--spec", str(ROOT / "schedules" / "gpt_oss_120b.sched"),
                          "--checkpoint", str(tmp_path), "--first-position", "20", "--steps", "2",
                          "--batch", "2", timeout=1800)
    _assert_bit_equal(summary)


# ---- the window's KV ring, past the window --------------------------------------------------
# The shipped 20b spec with the MINI's window cut to 8 (a checkpoint of `sliding_window` 8): its
# swa phase's ring of 32 slots in two 16-token KV tiles, so rows run past the window (position
# >= 8) and past the ring's wrap (>= 32), where each slot holds a position other than itself.
RING_LINES = ("    kv ring 256 slots\n    kv tiles 2 slots of 128 tokens ahead 2\n",
              "    kv ring 32 slots\n    kv tiles 2 slots of 16 tokens ahead 1\n")
WINDOW = 8


def _ring_run(tmp_path, *args: str) -> dict:
    import json

    from mkc.checkpoint import save_checkpoint
    from mkc.families.gpt_oss import reference
    from mkc.model.config import CONFIG_DIR
    text = (ROOT / "schedules" / "gpt_oss_20b.sched").read_text()
    assert text.count(RING_LINES[0]) == 1
    spec = tmp_path / "gpt_oss_20b_ring.sched"
    spec.write_text(text.replace(*RING_LINES))
    config = json.loads((CONFIG_DIR / "gpt_oss_mini.json").read_text()) | {"sliding_window": WINDOW}
    checkpoint = tmp_path / "mini_window_8"
    save_checkpoint(checkpoint, config, reference.init_params(reference.load_config(config), seed=0))
    # rows at positions 26 + 131 b: row 0 runs 26 .. past the ring's wrap at 32, row 1 from 157
    return run_example("examples/run_mini.py", "--spec", str(spec), "--checkpoint", str(checkpoint),
                       "--first-position", "26", *args, timeout=3000)


@pytest.mark.extended
def test_the_ring_past_the_window_on_wait_bit_equal_and_a_window_off_by_one_is_rejected(tmp_path):
    """window + 2 steps and more, every step bit-equal; the window one position too wide (the
    position that just left it, still in the ring, seen) fails the emulation."""
    summary = _ring_run(tmp_path, "--mode", "on_wait", "--steps", str(WINDOW + 4), "--batch", "2",
                        "--mutants", "oss.window,oss.sink", "--mutants-from", "1",
                        "--mutant-steps", "1")
    assert len(summary["steps"]) == WINDOW + 4
    _assert_bit_equal(summary)
    assert_each_mutant_rejected(summary, ("oss.window", "oss.sink"))


@pytest.mark.extended
def test_the_ring_past_the_window_eager_with_race_detection(tmp_path):
    """GPT-OSS's race-detection run: eager DMAs (which land as soon as issued, so a write
    racing a read shows) through the ring's wrap, on the shipped 20b spec with the window's
    ring lines (the rest of the kernel is the shipped one's)."""
    summary = _ring_run(tmp_path, "--mode", "eager", "--races", "--steps", str(WINDOW + 2),
                        "--batch", "2", "--kernel-state")
    assert len(summary["steps"]) == WINDOW + 2
    _assert_bit_equal(summary)
    # the ring's state, wrapped, written back from its reference view is the kernel's
    assert all(s["kernel_state_mismatches"] == [] for s in summary["steps"])
    assert summary["races_found"] is False


@pytest.mark.extended
def test_the_ring_verify_step_of_eight_rows_across_its_wrap_is_each_decode_step(tmp_path):
    """One verify step of 8 rows (positions 26 .. 33: past the window, across the 32-slot
    ring's wrap, its rows in two row tiles 16 .. 31 and 0 .. 15), judged row by row as the decode
    steps it replaces, bit-equal to the emulation from each committed state."""
    summary = _ring_run(tmp_path, "--mode", "on_wait", "--verify", "--steps", "8", "--batch", "1")
    assert summary["verify"] and len(summary["steps"]) == 8
    _assert_bit_equal(summary)
