"""MINI DeepSeek-V3, compiled from the shipped spec (8 chips, 16 cores: one head a core, the
dense and shared MLPs over every core, routed experts EP2 x TP8: each core a 32-wide slice of
its group's 16 experts) by the generic module template, runs in TPU interpret mode on virtual
CPU devices and matches the family's reference at every step, from the kernel's own state: bit
for bit against its rounding emulation, and plainly on the rows that are not near-ties (an
expert or group pick, or a next token, within the plain reference's error); race-free in both
DMA modes; and a 1 % error in the router's logits, the routed experts' sum, the shared expert,
the dense MLP, o_proj, the new key's normed latent or rotated rope part, the query's rotated
rope part or the cached latents attention reads (a state-only mutant: invisible from a zeroed
state) is rejected by the emulation.

The shipped spec holds the checkpoint's FP8 experts as they are (`fp8 block 128 x 128`): its
runs take the MINI FP8 checkpoint (`deepseek_v3_mini_fp8`: the MINI draws stored as the
published checkpoint stores its weights, e4m3 codes beside an f32 scale per 128 x 128 block; a
core's 32-wide slice is a quarter of a block's columns). The bf16 experts of a bf16 checkpoint
(`deepseek_v3_mini`, the spec's format lines rewritten in place) are the extended tier's."""
import pytest

from tests_support import (ROOT, assert_bit_equal, assert_each_mutant_rejected,
                           assert_each_mutant_rejected_on_its_row, run_example)

SPEC = ROOT / "schedules" / "deepseek_v3.sched"
MUTANTS = ("qwen_moe.router", "qwen_moe.routed_experts", "qwen_moe.shared_down", "dense.down", "gqa.o_proj",
           "mla.kv_norm", "mla.k_rope", "mla.q_rope", "mla.kv_read")


def _run(*args: str, spec=SPEC, model: str = "deepseek_v3_mini_fp8") -> dict:
    return run_example("examples/run_mini.py", "--spec", str(spec), "--model", model, *args, timeout=2400)


def _bf16_spec(tmp_path):
    """The shipped spec with its routed experts in bf16 (its format lines rewritten, line
    numbers kept): the format of a bf16 checkpoint."""
    text = SPEC.read_text()
    assert text.count("fp8 block 128 x 128") == 2
    path = tmp_path / SPEC.name
    path.write_text(text.replace("fp8 block 128 x 128", "bf16"))
    return path


def _ten_rows_spec(tmp_path):
    """The shipped spec with its batch range widened to 10 rows (line numbers kept): a row for
    each of the nine mutants beside one that none touches."""
    text = SPEC.read_text()
    assert text.count("batch   1 to 8\n") == 1
    path = tmp_path / SPEC.name
    path.write_text(text.replace("batch   1 to 8\n", "batch   1 to 10\n"))
    return path


@pytest.mark.slow
def test_on_wait_two_steps_bit_equal_then_each_mutant_rejected_on_its_row(tmp_path):
    """Two steps bit-equal with race detection, the second from the kernel's own latent cache;
    then one module with all nine mutants, mutant i acting on row i alone, runs step 1 from the
    module's state after step 0: each mutant's row is rejected by the emulation, and the last
    row, which none touches, stays bit-equal."""
    summary = _run("--mode", "on_wait", "--steps", "2", "--batch", "10", "--races",
                   "--mutants", ",".join(MUTANTS), "--mutants-from", "1", "--mutants-by-row",
                   spec=_ten_rows_spec(tmp_path))
    assert_bit_equal(summary)
    assert summary["races_found"] is False and summary["requantization"] == {}   # nothing rounded
    assert any(step["plain_rows"] for step in summary["steps"])
    assert_each_mutant_rejected_on_its_row(summary, MUTANTS)


@pytest.mark.extended
def test_bf16_experts_of_a_bf16_checkpoint_bit_equal_and_mutants_are_rejected(tmp_path):
    summary = _run("--mode", "on_wait", "--steps", "2", "--batch", "2", "--races",
                   "--mutants", ",".join(MUTANTS), "--mutants-from", "1", "--mutant-steps", "1",
                   spec=_bf16_spec(tmp_path), model="deepseek_v3_mini")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    assert_each_mutant_rejected(summary, MUTANTS)


@pytest.mark.extended
def test_eager_at_the_largest_batch_race_free():
    summary = _run("--mode", "eager", "--steps", "2", "--batch", "8", "--races")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
