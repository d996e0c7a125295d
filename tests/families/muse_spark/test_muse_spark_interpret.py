"""MINI Muse Spark as its NVFP4 release is (`muse_spark_mini_nvfp4`: the experts NVFP4 but
layer 0's, kept bf16, which the shipped spec holds so: kind `moe_bf16`, its own slot view and
HBM input), compiled from the shipped spec (4 chips, 8 cores: every expert's width over the
8) by the generic module template, runs in TPU interpret mode on virtual CPU devices and
matches the family's reference at every step from the kernel's own state: bit for bit
against its rounding emulation, and plainly where rows are not near-ties. Rows start at
positions 200 and 331, so row 1 runs past the MINI's 256-token window (the swa phase's KV
ring). A 1 % error in any op the family brought into the library (`MUTANTS`) is rejected by
the emulation."""
from pathlib import Path

import pytest

from mkc import compiler, ir
from tests_support import (ROOT, assert_bit_equal, assert_each_mutant_rejected,
                           assert_each_mutant_rejected_on_its_row, ring_text, run_example)

SPEC = str(ROOT / "schedules" / "muse_spark.sched")
MINI = "muse_spark_mini_nvfp4"
# The ops Muse Spark brought: the gated residuals (each place's update, the FFN pre-norm, the
# embedding's norm), the soft-capped logits, the latent normed at the MoE's input and each
# pick's output normed, the scaled router logits, the NoPE layers' weightless q/k norm, the
# normed and gated attention output, the scores' scale and the window.
MUTANTS = ("gres.attn_update", "gres.mlp_update", "gres.pre_ffn_norm", "gres.embed_norm", "logits.softcap",
           "moe.latent_norm_input", "moe.expert_norm", "qwen_moe.router", "gqa.q_norm_nope", "gqa.k_norm",
           "gqa.out_gate", "gqa.softmax_scale", "oss.window")
# CI's share: one op of each mechanism (the quick tier's body tests judge each op alone)
CI_MUTANTS = ("gres.attn_update", "gres.embed_norm", "logits.softcap", "moe.expert_norm", "gqa.out_gate",
              "qwen_moe.router")


def _run(*args: str, spec: str = SPEC) -> dict:
    return run_example("examples/run_mini.py", "--spec", spec, "--model", MINI,
                       "--first-position", "200", *args, timeout=2400)


@pytest.mark.slow
def test_on_wait_two_steps_bit_equal_then_each_mutant_rejected_on_its_row():
    """Two steps at batch 7 bit-equal; then one module with `CI_MUTANTS`, mutant i acting on
    row i alone, runs step 1 from the module's state after step 0: each mutant's row is
    rejected by the emulation, and the last row, which none touches, stays bit-equal."""
    summary = _run("--mode", "on_wait", "--steps", "2", "--batch", str(len(CI_MUTANTS) + 1),
                   "--mutants", ",".join(CI_MUTANTS), "--mutants-from", "1", "--mutants-by-row")
    assert_bit_equal(summary)
    assert_each_mutant_rejected_on_its_row(summary, CI_MUTANTS)


# ring tiles summed tile by tile with refills held back in part: CI runs Qwen's
# (tests/test_interpret_mini.py); Muse Spark's gated family is the extended tier's
@pytest.mark.extended
def test_ring_tiles_smaller_than_the_matrices_with_refills_held_back_in_part(tmp_path):
    """The shipped spec with 256 x 256 ring tiles, 4 ahead: qkv_gate's contraction in 4 row
    tiles summed tile by tile (as the emulation sums it), and `refill weights after qkv_gate
    from 2 rows` holding back only the refills of its last 4 of 8 tiles (the first 4 refill
    its own); two steps bit-equal at batch 2 (a single dot over the contraction in the
    emulation is off by step 1)."""
    spec = tmp_path / "muse_spark.sched"
    spec.write_text(ring_text(Path(SPEC).read_text(), 4, (256, 256), 4))
    s = compiler.check_spec(spec, MINI).ir
    assert [(f.name, f.tiles) for f in s.stream.families["swa"]] == [("qkv_gate", 8)]
    assert list(ir.held_refills(s.kinds["swa"].refill.tiles, s.stream.ahead)) == [4, 5, 6, 7]
    assert_bit_equal(_run("--mode", "on_wait", "--steps", "2", "--batch", "2", spec=str(spec)))


@pytest.mark.extended
def test_every_new_op_s_mutant_is_rejected():
    summary = _run("--mode", "on_wait", "--steps", "1", "--batch", "2", "--mutants", ",".join(MUTANTS))
    assert_bit_equal(summary)
    assert_each_mutant_rejected(summary, MUTANTS)


@pytest.mark.extended
def test_eager_races_checked_at_batch_four():
    assert_bit_equal(_run("--mode", "eager", "--races", "--steps", "2", "--batch", "4"))


@pytest.mark.extended
def test_a_verify_step_of_eight_rows():
    """The spec's verify step: one sequence's 8 rows (`verify 8`), each judged like the decode
    step it replaces."""
    assert_bit_equal(_run("--verify", "--steps", "8", "--batch", "1"))
