"""MINI DeepSeek-V3, compiled from the shipped spec (8 chips, 16 cores: one head a core, the
dense and shared MLPs over every core, routed experts EP2 x TP8: each core a 32-wide slice of
its group's 16 experts) by the generic module template, runs in TPU interpret mode on virtual
CPU devices and matches the family's reference at every step, from the kernel's own state: bit
for bit against its rounding emulation, and plainly on the rows that are not near-ties (an
expert or group pick, or a next token, within the plain reference's error); race-free in both
DMA modes; and a 1 % error in the router's logits, the routed experts' sum, the shared expert,
the dense MLP, o_proj, the new key's normed latent or rotated rope part, the query's rotated
rope part or the cached latents attention reads (a state-only mutant: invisible from a zeroed
state) is rejected by the emulation."""
import pytest

from tests_support import ROOT, assert_bit_equal, assert_each_mutant_rejected, run_example

SPEC = str(ROOT / "schedules" / "deepseek_v3.sched")
MUTANTS = ("qwen_moe.router", "qwen_moe.routed_experts", "qwen_moe.shared_down", "dense.down", "gqa.o_proj",
           "mla.kv_norm", "mla.k_rope", "mla.q_rope", "mla.kv_read")


def _run(*args: str) -> dict:
    return run_example("examples/run_mini.py", "--spec", SPEC, "--model", "deepseek_v3_mini", *args,
                       timeout=2400)


@pytest.mark.slow
def test_on_wait_two_steps_bit_equal_and_mutants_are_rejected():
    summary = _run("--mode", "on_wait", "--steps", "2", "--batch", "2", "--races",
                   "--mutants", ",".join(MUTANTS), "--mutants-from", "1", "--mutant-steps", "1")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    assert any(step["plain_rows"] for step in summary["steps"])
    assert_each_mutant_rejected(summary, MUTANTS)


@pytest.mark.extended
def test_eager_at_the_largest_batch_race_free():
    summary = _run("--mode", "eager", "--steps", "2", "--batch", "8", "--races")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
