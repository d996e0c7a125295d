"""MINI Kimi K3, compiled from the shipped K3 spec on 2 hosts (16 cores: EP4 x TP4 experts,
two-level host all-reduces, 16-way and host all-gathers, sibling exchanges), runs in TPU
interpret mode on 16 virtual CPU devices and matches the pure-JAX reference: logits, next
tokens, KDA conv and recurrent states and the MLA latent cache, on every row whose routing is
not a near-tie; against the plain f32 reference and, after every step, against its
rounding-emulating mode with the "flips" check of `mkc.numerics` (a few one-ulp bf16 flips
allowed, a 1 % op error not: the mutation test proves it)."""
import pytest

from mkc import numerics
from tests_support import run_example

# One op per K3 layer kind scaled by 1.01 (examples/generated_module.MUTANTS): kda (the gated
# norm), mla (the latent norm, seen first in the cache, and o_proj), dense (down), moe (one
# routed expert's output, the shared experts' down).
K3_MUTANTS = ("kda.gated_norm", "mla.kv_norm", "mla.o_proj", "dense.down", "moe.expert",
              "moe.shared_down")


def _run(*args: str) -> dict:
    return run_example("examples/run_k3_mini.py", *args, timeout=2400)


def _emulation_line(steps: list[dict]) -> str:
    return "; ".join(f"step {s['step']}: logits frob {s['emulation']['logits_frob']:.2e}, states "
                     + ", ".join(f"{k} {v:.2e}" for k, v in s["emulation"]["states"].items())
                     + ("" if s["gains"] is None else
                        f", gains {s['gains'].get('logits_frob', 0):.3g}/{s['gains']['states']:.3g}")
                     for s in steps)


def _assert_matches_reference(summary: dict) -> None:
    """Rows whose expert choice is a near-tie in the reference (margin < 0.005, about the bf16
    noise of the kernel's activations and wire) may legitimately route differently; the
    harness compares the others and draws tokens so that at least half the rows qualify."""
    assert summary["steps"]
    assert len(summary["compared_rows"]) >= max(1, summary["batch"] // 2), summary
    # mkc.numerics: the plain comparison (3 % logits, tokens, states) and the rounding
    # emulation's "flips" bounds, at every step, for logits and every state family.
    assert summary["emulation_check"] == "flips"
    print(f"batch {summary['batch']} rows {summary['compared_rows']}: "
          + _emulation_line(summary["steps"]))
    assert numerics.failures(summary) == [], summary


@pytest.fixture(scope="module")
def on_wait_with_mutants() -> dict:
    """One process: the module for two steps at batch 2, then each mutant for one step, reusing
    the process's reference trajectory, packed weights and compilation (about 50 s of CPU time
    per mutant in interpret mode)."""
    return _run("--mode", "on_wait", "--steps", "2", "--batch", "2", "--mutants",
                ",".join(K3_MUTANTS), "--mutant-steps", "1")


@pytest.mark.slow
def test_on_wait_two_steps(on_wait_with_mutants):
    _assert_matches_reference(on_wait_with_mutants)


@pytest.mark.slow
def test_one_op_off_by_one_percent_is_rejected(on_wait_with_mutants):
    """Mutation check: a copy of the module with one op's output scaled by 1.01 (one op per
    layer kind) is rejected by the comparison with the rounding emulation on the first step,
    while the unmutated module passes it (test above)."""
    summary = on_wait_with_mutants
    for name in K3_MUTANTS:
        mutant = summary["mutants"][name]
        print(f"{name}: " + _emulation_line(mutant["steps"]))
        assert any("rounding emulation" in f for f in mutant["failures"]), (name, mutant["failures"])


@pytest.mark.slow
def test_eager_dma_mode_at_the_largest_batch():
    _assert_matches_reference(_run("--mode", "eager", "--steps", "1", "--batch", "8"))


@pytest.mark.slow
def test_no_races_with_race_detection():
    summary = _run("--mode", "on_wait", "--races", "--steps", "1", "--batch", "1")
    _assert_matches_reference(summary)
    assert summary["races_found"] is False


@pytest.mark.slow
def test_two_expert_slots_cycle_experts_through_reused_slots():
    """With 2 slots, 4 rows pick more local experts than there are slots, so expert k + 2 is
    copied into expert k's slot as soon as k is done: the slot protocol the checker proves."""
    _assert_matches_reference(_run("--expert-slots", "2", "--steps", "1", "--batch", "4"))
