"""MINI Kimi K3, compiled from the shipped K3 specs on 2 hosts (16 cores: EP4 x TP4 experts,
two-level host all-reduces, 16-way and host all-gathers, sibling exchanges), runs in TPU
interpret mode on 16 virtual CPU devices and matches the pure-JAX reference: logits, next
tokens, KDA conv and recurrent states and the MLA latent cache, on every row whose routing is
not a near-tie; against the plain f32 reference and, to f32 rounding, against its
rounding-emulating mode (which also sums in the kernel's f32 order: bit-equal at step 0). The
tolerances live in `mkc.numerics`; the mutation test proves that a 1 % error in one op of each
sublayer kind is rejected."""
import pytest

from mkc import numerics
from tests_support import ROOT, run_example


def _run(*args: str) -> dict:
    return run_example("examples/run_k3_mini.py", *args, timeout=2400)   # mutants: ~17 min here


def _assert_matches_reference(summary: dict) -> None:
    """Every step is judged from the kernel's own state: exactly against the emulation, on every
    row, and plainly on the rows that are not near-ties (a row whose expert pick or next token
    the emulation decides by a margin the plain reference's measured difference could cross:
    `generated_module.near_ties`: the plain and emulated selection scores differ by up to 7e-3,
    and many margins are smaller; measured: at batch 8, 4 or 5 rows of 8 are routing near-ties
    at each step, and on the 64-core layout at batch 2 both rows at step 0 and row 0 at step 1,
    the same rows the emulation's own trajectory predicts). Some row is compared plainly."""
    assert summary["steps"] and summary["emulation_check"] == "exact"
    assert any(step["plain_rows"] for step in summary["steps"]), [s["near_ties"] for s in summary["steps"]]
    # mkc.numerics: the plain comparison (3 % logits, tokens, states) and the emulation's
    # exact check (f32 rounding at every step).
    assert numerics.failures(summary) == [], summary


@pytest.mark.slow
def test_eager_dma_mode_at_the_largest_batch_for_two_steps():
    """Batch 8, two steps: the second from a nonzero recurrent, conv and latent state."""
    _assert_matches_reference(_run("--mode", "eager", "--steps", "2", "--batch", "8"))


@pytest.mark.slow
def test_no_races_with_race_detection():
    # Batch 2: at batch 1 the kernel's one-row bf16 dots leave the emulation's order on an
    # AVX512-BF16 host (mkc.numerics); measured at batch 2 with races: bit-equal, 85 s a step.
    summary = _run("--mode", "on_wait", "--races", "--steps", "1", "--batch", "2")
    _assert_matches_reference(summary)
    assert summary["races_found"] is False


# One op per sublayer kind, and a state-only op, the KDA decay (each mutant run costs two to
# three minutes of interpret mode here); mla.kv_norm and moe.shared_down, and the state-only
# kda.conv_state and mla.kv_read, are for `run_k3_mini.py --mutants ... --mutants-from 1` by
# hand (measured: each rejected at step 1, 0.0 from the emulation at step 0).
K3_MUTANTS = ("kda.gated_norm", "mla.o_proj", "dense.down", "moe.expert", "kda.decay")


@pytest.mark.slow
def test_two_on_wait_steps_then_one_op_off_by_one_percent_is_rejected():
    """One process (one compilation), batch 2, on the 64-core layout (`kimi_k3_64.sched`, moved
    to 16 cores: heads over 8 ranks, replicated twice, everything else over all 16): the module
    passes two steps (measured: both bit-equal to the emulation), then copies of it with one op
    scaled by 1.01 (one per sublayer kind: the KDA gated norm, the MLA output projection, the
    dense MLP's down projection, the routed experts; and the state-only KDA decay) each run
    step 1 from the module's own state after step 0 and are each rejected by the exact
    rounding-emulation comparison, which the 3 % plain comparison would let through."""
    summary = _run("--spec", str(ROOT / "schedules" / "kimi_k3_64.sched"), "--mode", "on_wait",
                   "--steps", "2", "--batch", "2", "--mutants", ",".join(K3_MUTANTS),
                   "--mutants-from", "1")
    assert summary["steps"][0]["emulation"]["logits"] == 0.0
    _assert_matches_reference(summary)
    assert len(summary["steps"]) == 2
    assert summary["failures"] == []
    for name in K3_MUTANTS:
        fails = summary["mutants"][name]["failures"]
        assert any("rounding emulation" in f for f in fails), (name, fails)
