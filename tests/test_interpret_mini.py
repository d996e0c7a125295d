"""MINI Qwen, compiled from the shipped specs, runs in TPU interpret mode on virtual CPU
devices (8, or 16 for the 16-core layout) and matches the pure-JAX reference: logits, next
token, recurrent and conv states and the KV caches, against the plain f32 reference and (to
about f32 rounding) against its
rounding-emulating mode. The tolerances live in `mkc.numerics`; the example exits 1 when the
kernel disagrees, and the mutation test proves that a 1 % error in one op is rejected."""
import json

import pytest

from conftest import run_python
from mkc import numerics
from mkc.checkpoint import save_checkpoint
from mkc.families.qwen3_5 import reference as reference
from tests_support import (ROOT, SPEC, assert_each_mutant_rejected_on_its_row, dense_text, ring_text,
                           run_example)


def _run(*args: str) -> dict:
    return run_example("examples/run_mini.py", *args, timeout=1200)


def _assert_matches_reference(summary: dict) -> None:
    """Every step judged from the kernel's own state: exactly against the emulation (the
    runner's default check), and plainly on the rows that are not near-ties."""
    assert summary["steps"] and summary["emulation_check"] == "exact"
    assert all(s["plain_rows"] for s in summary["steps"]), summary["steps"]
    assert numerics.failures(summary) == []


@pytest.mark.extended
def test_on_wait_from_an_hf_checkpoint(tmp_path):
    """Round trip: a checkpoint written here loads and runs through the generated kernel."""
    config = json.loads((ROOT / "mkc/model/configs/qwen3_8_mini.json").read_text())
    params = reference.init_params(reference.load_config(config), seed=7)
    save_checkpoint(tmp_path, config, params)
    summary = _run("--checkpoint", str(tmp_path), "--mode", "on_wait", "--steps", "2",
                   "--batch", "3", "--kernel-state")
    _assert_matches_reference(summary)
    # each step's state written back from its reference view (kernel_state) is the kernel's
    assert all(s["kernel_state_mismatches"] == [] for s in summary["steps"])


@pytest.mark.extended
def test_eager_dma_mode_at_the_largest_batch():
    # One step: the exact check at 8 rows (measured: logits, states and caches bit-equal; past
    # step 0 the recurrent state leaves the emulation's order, mkc.numerics).
    _assert_matches_reference(_run("--mode", "eager", "--steps", "1", "--batch", "8"))


# Extended: CI's race run of Qwen is its verify step's, eager (tests/test_verify.py).
@pytest.mark.extended
def test_no_races_with_race_detection():
    # Batch 1: the one-row step, bit-equal at both steps on the AVX512-BF16 host too since the
    # emulation's dot reads the weight as the kernel's does (mkc.numerics, "One row"; before,
    # step 1 was 2.2e-3 off there, and this test ran at 2 rows).
    summary = _run("--mode", "on_wait", "--races", "--steps", "2", "--batch", "1")
    _assert_matches_reference(summary)
    assert summary["races_found"] is False


def test_race_detector_flags_a_known_race():
    """Guards the race test above against a detector that silently stopped working."""
    r = run_python(["tests/race_detector_canary.py"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RACES=True" in r.stdout


@pytest.mark.extended
def test_f32_wire_all_reduce(tmp_path):
    """The other wire dtype: gqa layers reduce in f32 over the wire, and the emulation, which
    reads the wire from the spec, rounds the gqa partial sums to f32 (not at all) to match."""
    spec = tmp_path / "qwen_f32_wire.sched"
    text = (ROOT / "schedules" / "qwen3_8_27b.sched").read_text()
    assert "o_proj, down direct wire bf16" in text
    spec.write_text(text.replace("o_proj, down direct wire bf16", "o_proj, down direct wire f32"))
    summary = _run("--spec", str(spec), "--steps", "1", "--batch", "2")
    _assert_matches_reference(summary)
    assert summary["steps"][0]["emulation"]["logits"] == 0.0      # measured: bit-equal


@pytest.mark.extended
def test_heads_replicated_across_groups_of_8_of_16_ranks():
    """The shipped 16-core layout (`schedules/qwen3_8_27b_16.sched`): heads over 8 ranks,
    replicated twice, the MLP and vocabulary over all 16, on 16 virtual devices. Attention
    partial sums reduce within each group of 8 and the MLP's over all 16; ranks 8-15 hold
    their own vocab parts, so a second replica that went astray shows in the logits. Bit-equal
    to the emulation at step 0 (measured: step 1 within 2e-7 on the recurrent state)."""
    summary = _run("--spec", str(ROOT / "schedules" / "qwen3_8_27b_16.sched"), "--steps", "2",
                   "--batch", "2")
    _assert_matches_reference(summary)
    first = summary["steps"][0]["emulation"]
    assert first["logits"] == 0.0 and set(first["states"].values()) == {0.0}, first


@pytest.mark.extended
def test_query_heads_sharing_a_kv_head_attend_together(tmp_path):
    """Heads over 4 ranks: each rank holds 2 query heads reading one KV head, which go through
    every KV tile together (one [2, D] dot per tile), as the rounding emulation groups them.
    Rows start past the first tile, so the online softmax folds two tiles. Bit-equal to the
    emulation (measured: logits and every state 0.0)."""
    spec = tmp_path / "qwen_heads_over_4.sched"
    text = (ROOT / "schedules" / "qwen3_8_27b.sched").read_text()
    assert "shard heads over tp" in text
    spec.write_text(text.replace("shard heads over tp", "shard heads over 4"))
    summary = _run("--spec", str(spec), "--mode", "eager", "--steps", "1", "--batch", "4",
                   "--first-position", "130")
    _assert_matches_reference(summary)
    first = summary["steps"][0]["emulation"]
    assert first["logits"] == 0.0 and set(first["states"].values()) == {0.0}, first


# One op per layer kind, an op that only shows in the KV cache, and the state-only ops: the
# decay and the conv taps of the gated delta net, a read of an earlier KV entry (invisible at
# step 0, whose state is zero).
QWEN_MUTANTS = ("gdn.gated_norm", "gqa.o_proj", "gqa.k_norm", "gdn.decay", "gdn.conv_state",
                "gqa.kv_read")


@pytest.mark.slow
def test_one_op_off_by_one_percent_is_rejected():
    """Mutation check, one process, batch 7: the module passes two steps, then one module with
    all six mutants (one op scaled by 1.01 each), mutant i acting on row i alone, runs step 1
    from the module's own state after step 0 (so the state-only ops act on a nonzero state).
    Each mutant's row is rejected by the rounding-emulation comparison, while the plain
    comparison's 3 % would let them all through; row 6, which no mutant touches, stays
    bit-equal (measured: 51 s, against 119 s for six mutant modules one after another)."""
    summary = _run("--steps", "2", "--batch", str(len(QWEN_MUTANTS) + 1),
                   "--mutants", ",".join(QWEN_MUTANTS), "--mutants-from", "1", "--mutants-by-row")
    assert summary["failures"] == []
    assert_each_mutant_rejected_on_its_row(summary, QWEN_MUTANTS)


@pytest.mark.slow
def test_ring_tiles_of_128_rows_summed_tile_by_tile_and_refills_held_back_in_part(tmp_path):
    """Qwen's spec with 128 x 256 ring tiles, 2 ahead: in_proj, out_proj, qkv_gate and gate_up
    contract over 2 row tiles each, which the kernel sums tile by tile in f32 and the emulation
    likewise (`chunked_linear`; one dot over each contraction is 1.6e-3 off the logits at step
    0); and `refill weights after in_proj` / `after qkv_gate` hold back only the refills for
    tiles read after them (in_proj's last 2 of 8 tiles, qkv_gate's of 4), the others starting
    as their tiles are read. Two steps at batch 2 bit-equal."""
    import re

    from mkc import compiler, ir
    text = ring_text(SPEC.read_text(), 4, (128, 256), 2)
    for anchor, op in (("allreduce out_proj, down", "in_proj"), ("allreduce o_proj, down", "qkv_gate")):
        text, n = re.subn(rf"({anchor} .*\n)", rf"\1    refill weights after {op} from 2 rows\n", text)
        assert n == 1, anchor
    spec = tmp_path / SPEC.name
    spec.write_text(text)
    s = compiler.check_spec(spec, "qwen3_8_mini").ir
    row_tiles = {(k, f.name): f.row_tiles for k, fs in s.stream.families.items() for f in fs}
    assert all(row_tiles[k] == 2 for k in (("gdn", "in_proj"), ("gdn", "out_proj"),
                                           ("gqa", "qkv_gate"), ("gqa", "gate_up"))), row_tiles
    assert {k: list(ir.held_refills(s.kinds[k].refill.tiles, s.stream.ahead))
            for k in ("gdn", "gqa")} == {"gdn": [6, 7], "gqa": [2, 3]}
    summary = _run("--spec", str(spec), "--steps", "2", "--batch", "2")
    _assert_matches_reference(summary)
    assert [s["emulation"]["logits"] for s in summary["steps"]] == [0.0, 0.0]


# The dense classes as codes (`format attention|mlp|lm_head fp8|int8 channel rounded`): FP8's
# run is CI's (the slow tier), int8's the extended tier's.
@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["fp8", pytest.param("int8", marks=pytest.mark.extended)])
def test_dense_classes_as_codes_bit_equal_and_a_mutant_rejected(fmt, tmp_path):
    """Qwen's attention, MLP and lm_head as 8-bit codes with a scale per output column (the
    spec's `format` lines added: `tests_support.dense_text`), batch 2: two steps bit-equal to
    the emulation, which multiplies the requantized weights' codes as the kernel does (measured:
    logits, states and caches 0.0 at both steps), the error reported per class (int8 0.70 %,
    FP8 2.7 % relative RMS on MINI's draws), and an o_proj 1 % off on row 0 at step 1 rejected
    (row 1, untouched, bit-equal)."""
    spec = tmp_path / SPEC.name
    spec.write_text(dense_text(SPEC, fmt))
    summary = _run("--spec", str(spec), "--steps", "2", "--batch", "2", "--mutants", "gqa.o_proj",
                   "--mutants-from", "1", "--mutants-by-row")
    assert summary["failures"] == [] and numerics.failures(summary) == []
    assert [s["emulation"]["logits"] for s in summary["steps"]] == [0.0, 0.0]
    errors = {cls: r["relative_rms_error"] for cls, r in summary["requantization"].items()}
    assert set(errors) == {"attention", "mlp", "lm_head"}, errors
    assert all(0 < e < {"fp8": 0.04, "int8": 0.01}[fmt] for e in errors.values()), errors
    assert_each_mutant_rejected_on_its_row(summary, ("gqa.o_proj",))


@pytest.mark.extended
def test_dense_classes_as_codes_eager_with_race_detection(tmp_path):
    """The codes tiles' copies (a column block's last tile, with its scale rows, a class of its
    own) race nothing: Qwen's dense classes as int8 codes, eager DMAs, race detection, one step."""
    spec = tmp_path / SPEC.name
    spec.write_text(dense_text(SPEC, "int8"))
    summary = _run("--spec", str(spec), "--mode", "eager", "--races", "--steps", "1", "--batch", "1")
    assert numerics.failures(summary) == [] and summary["races_found"] is False
    assert summary["steps"][0]["emulation"]["logits"] == 0.0


def test_example_exits_non_zero_when_the_kernel_disagrees(capsys):
    """The runners' exit status (`generated_module.finish`): 1 on any numerics failure, or when
    a mutant run is not rejected; the mutant runs themselves are the mutation tests above."""
    import sys
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import finish
    step = {"step": 0, "logits_max_abs_err": 0.5, "logits_max_abs": 4.0, "next_token": [1],
            "ref_next_token": [1], "state_rel_err": {},
            "emulation": {"logits": 0.0, "logits_frob": 0.0, "states": {"conv_state": 0.0}}}
    ok = dict(step, logits_max_abs_err=0.0)
    summary = {"family": "qwen3_5_text", "emulation_check": "exact"}
    assert finish({**summary, "steps": [ok]}, races=False, as_json=False) == 0
    assert finish({**summary, "steps": [step]}, races=False, as_json=False) == 1
    assert "FAIL step 0: logits differ from the plain reference" in capsys.readouterr().err
    survivor = {**summary, "steps": [ok], "mutants": {"gqa.o_proj": {"steps": [ok]}}}
    assert finish(survivor, races=False, as_json=False) == 1
    assert "mutant gqa.o_proj was not rejected" in capsys.readouterr().err


def test_a_fitted_context_keeps_every_row_s_positions_at_one_the_spec_checks_at():
    """`--context fit` (what `run_example` passes): the shipped spec at the least multiple of
    512 tokens that holds every row's positions and still checks; 512 would hold two rows'
    three steps, but the spec's KV tiles in flight reach 640 positions, so it is 1024; the
    rows' positions are those at the spec's own context. A batch whose rows need the whole
    context runs the spec itself; a context that is not a number is a usage error."""
    import argparse
    import sys

    from mkc import compiler
    from mkc.diagnostics import MkcError
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import at_context, row_positions
    ap = argparse.ArgumentParser()
    fitted = at_context(ap, SPEC, "qwen3_8_mini", "fit", 136, 2, 3)
    assert compiler.check_spec(fitted, "qwen3_8_mini").ir.context == 1024
    assert fitted.read_text().replace("context 1024", "context 4096") == SPEC.read_text()
    assert row_positions(136, 2, 1024, 3).tolist() == row_positions(136, 2, 4096, 3).tolist()
    with pytest.raises(MkcError, match="kv tiles ahead"):
        compiler.check_spec(at_context(ap, SPEC, "qwen3_8_mini", "512", 136, 2, 3), "qwen3_8_mini")
    assert at_context(ap, SPEC, "qwen3_8_mini", "fit", 136, 31, 3) == SPEC
    with pytest.raises(SystemExit):
        at_context(ap, SPEC, "qwen3_8_mini", "most", 136, 2, 3)
