"""MINI Llama, compiled from the shipped 8B spec (one chip, 2 cores) by the generic module
template, runs in TPU interpret mode on virtual CPU devices and matches the family's reference
at every step, from the kernel's own state: bit for bit against its rounding emulation, and
plainly on the rows that are not near-ties; race-free in both DMA modes; and a 1 % error in
the new key's rotary embedding, o_proj, the MLP's down projection or the cached values it reads (a state-only
mutant: invisible from a zeroed state) is rejected by the emulation."""
import pytest

from mkc import numerics
from tests_support import ROOT, assert_bit_equal, assert_each_mutant_rejected_on_its_row, run_example

SPEC = str(ROOT / "schedules" / "llama_3_1_8b.sched")
MUTANTS = ("gqa.k_rope", "gqa.o_proj", "dense.down", "gqa.kv_read")


def _run(spec: str, *args: str, model: str = "llama_mini") -> dict:
    return run_example("examples/run_mini.py", "--spec", spec, "--model", model, *args,
                       timeout=1800)


@pytest.mark.slow
def test_on_wait_three_steps_bit_equal_then_each_mutant_rejected_on_its_row():
    """One module with every mutant, mutant i acting on row i alone (the last row clean), runs
    step 1 from the kernel's state after step 0."""
    summary = _run(SPEC, "--mode", "on_wait", "--steps", "3", "--batch", "5", "--races",
                   "--mutants", ",".join(MUTANTS), "--mutants-from", "1", "--mutant-steps", "1",
                   "--mutants-by-row")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    assert_each_mutant_rejected_on_its_row(summary, MUTANTS)


@pytest.mark.slow
def test_the_mistral_mini_through_the_llama_spec_bit_equal_and_race_free():
    """The alias's MINI (its default rope at theta 1e6, MistralConfig's reading) compiled from
    the same 8B spec: the kernel is the family's, the config is Mistral's."""
    summary = _run(SPEC, "--mode", "on_wait", "--steps", "2", "--batch", "2", "--races", model="mistral_mini")
    assert_bit_equal(summary)
    assert summary["races_found"] is False


@pytest.mark.extended
def test_eager_at_the_largest_batch_and_a_verify_step_race_free():
    summary = _run(SPEC, "--mode", "eager", "--steps", "2", "--batch", "8", "--races")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    verify = _run(SPEC, "--mode", "eager", "--verify", "--steps", "3", "--batch", "2", "--races")
    assert verify["verify"] and verify["emulation_check"] == "exact" and numerics.failures(verify) == []


@pytest.mark.extended
def test_the_70b_spec_with_replicated_kv_heads():
    """The 70B spec's 8 cores: the MINI's 2 KV heads replicated over 8 head parts."""
    summary = _run(str(ROOT / "schedules" / "llama_3_1_70b.sched"), "--mode", "on_wait",
                   "--steps", "2", "--batch", "2", "--kernel-state")
    assert_bit_equal(summary)
    # every replica of a KV head, written back from the reference view, is the kernel's
    assert all(s["kernel_state_mismatches"] == [] for s in summary["steps"])
