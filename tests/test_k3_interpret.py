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
from tests_support import ROOT, assert_each_mutant_rejected_on_its_row, k3_format_text, run_example


def _run(*args: str) -> dict:
    return run_example("examples/run_k3_mini.py", *args, timeout=2400)   # batch-8 mutant run: ~2 min


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


@pytest.mark.extended
def test_eager_dma_mode_with_race_detection_and_rounded_fp4_experts(tmp_path):
    """Eager DMAs land as soon as issued, so a write racing a read before its wait shows (on-wait
    mode would run the copy at the wait and hide it; the batch-8 test below runs on-wait).
    The shipped spec with its experts as `fp4 block N rounded scale bf16` (it ships the checkpoint's
    exact MXFP4: the test below and tests/test_verify.py run that): the MINI checkpoint's
    Gaussian MXFP4 draws (32-row scales that differ within a block) do not requantize exactly,
    so packing rounds them (the error reported per class), and the kernel, packed from the
    checkpoint itself, is bit-equal to the rounding emulation of the requantized weights
    (`requantized_weights`) and within the plain tolerance of the plain reference on them.
    Batch 2, token draws with routing margins of at least 0.02 (measured: seed 24, both rows
    compared plainly; at the default 0.005 both rows were routing near-ties)."""
    spec = tmp_path / "kimi_k3.sched"
    spec.write_text(k3_format_text("fp4 block"))
    summary = _run("--spec", str(spec), "--mode", "eager", "--races", "--steps", "1",
                   "--batch", "2", "--min-routing-margin", "0.02", "--kernel-state")
    _assert_matches_reference(summary)
    # the KDA states and the latent cache (on every rank, its row padded) written back from
    # their reference view (kernel_state) are the kernel's
    assert summary["steps"][0]["kernel_state_mismatches"] == []
    assert summary["races_found"] is False
    step = summary["steps"][0]
    assert step["emulation"]["logits"] == 0.0 and set(step["emulation"]["states"].values()) == {0.0}
    rq = summary["requantization"]
    assert set(rq) == {"expert.gate_up", "expert.down"}
    assert all(r["format"].endswith(" rounded scale bf16") and not r["exact"] and r["changed"] > 0
               for r in rq.values()), rq


# One op per sublayer kind and the state-only ops (the KDA decay, the conv state's taps, a read
# of an earlier latent cache entry); mla.kv_norm and moe.shared_down are for
# `run_k3_mini.py --mutants ... --mutants-by-row` by hand (measured: rejected at step 1).
K3_MUTANTS = ("kda.gated_norm", "mla.o_proj", "dense.down", "moe.expert", "kda.decay",
              "kda.conv_state", "mla.kv_read")


def _k3_64_latent_down_first(tmp_path) -> str:
    """`kimi_k3_64.sched` with the shipped K3 spec's `run latent_down before router` (its stream
    lists them in the new order): the moved op order, which only the shipped spec has, runs
    here too."""
    text = (ROOT / "schedules" / "kimi_k3_64.sched").read_text()
    assert text.count("moe: router, latent_down,") == 1 and text.count("  phase moe {\n") == 1
    path = tmp_path / "kimi_k3_64.sched"
    path.write_text(text.replace("moe: router, latent_down,", "moe: latent_down, router,").replace(
        "  phase moe {\n", "  phase moe {\n    run latent_down before router\n"))
    return str(path)


@pytest.mark.slow
def test_two_steps_at_the_largest_batch_then_each_mutant_rejected_on_its_row(tmp_path):
    """One process, batch 8, on the 64-core layout (`kimi_k3_64.sched`, moved to 16 cores: heads
    over 8 ranks, replicated twice, everything else over all 16) with the MoE's latent_down
    moved before its router, as the shipped K3 spec runs it: the module passes two steps,
    the second from a nonzero recurrent, conv and latent state (measured: both bit-equal to the
    emulation); then one module with all seven mutants (one op scaled by 1.01 each: one per
    sublayer kind and the three state-only ops), mutant i acting on row i alone, runs step 1
    from the module's own state after step 0 (`--mutants-by-row`). Each mutant's row is
    rejected by the exact emulation comparison (which the 3 % plain comparison would let
    through), and row 7, which no mutant touches, stays bit-equal: the rows are independent."""
    summary = _run("--spec", _k3_64_latent_down_first(tmp_path), "--mode", "on_wait",
                   "--steps", "2", "--batch", "8", "--mutants", ",".join(K3_MUTANTS),
                   "--mutants-from", "1", "--mutants-by-row")
    assert summary["steps"][0]["emulation"]["logits"] == 0.0
    _assert_matches_reference(summary)
    assert len(summary["steps"]) == 2 and summary["failures"] == []
    assert_each_mutant_rejected_on_its_row(summary, K3_MUTANTS)
