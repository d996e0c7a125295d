"""MINI Qwen3-MoE, compiled from the shipped 30B-A3B spec (4 chips, 8 cores: one query head, a
replica of one KV head and 2 of the 16 experts a core) by the generic module template, runs in
TPU interpret mode on virtual CPU devices and matches the family's reference at every step,
from the kernel's own state: bit for bit against its rounding emulation, and plainly on the
rows that are not near-ties (an expert pick or a next token within the plain reference's
error); race-free in both DMA modes; and a 1 % error in the router's logits, the routed
experts' sum, the routing weight of every other expert, the new key's q/k norm or the cached
values attention reads (a state-only mutant: invisible from a zeroed state) is rejected by the
emulation; the runner offers only the mutants that apply to the spec."""
from pathlib import Path

import pytest

from conftest import run_python
from mkc import numerics
from tests_support import ROOT, assert_bit_equal, assert_each_mutant_rejected_on_its_row, run_example

SPEC = str(ROOT / "schedules" / "qwen3_30b_a3b.sched")
MUTANTS = ("qwen_moe.router", "qwen_moe.routed_experts", "moe.expert", "gqa.k_norm", "gqa.kv_read")


def _run(spec: str, *args: str) -> dict:
    return run_example("examples/run_mini.py", "--spec", spec, "--model", "qwen3_moe_mini", *args,
                       timeout=1800)


@pytest.mark.slow
def test_on_wait_two_steps_bit_equal_then_each_mutant_rejected_on_its_row():
    """One module with every mutant, mutant i acting on row i alone (the last row clean), runs
    step 1 from the kernel's state after step 0."""
    summary = _run(SPEC, "--mode", "on_wait", "--steps", "2", "--batch", "6", "--races",
                   "--mutants", ",".join(MUTANTS), "--mutants-from", "1", "--mutants-by-row")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    assert_each_mutant_rejected_on_its_row(summary, MUTANTS)


def test_the_runner_offers_the_mutants_of_the_spec():
    """A mutant of another family's text is a usage error naming the spec's own, among them
    `moe.expert` (K3's, with an edit of the library MoE's text too); not a traceback."""
    r = run_python(["examples/run_mini.py", "--spec", SPEC, "--model", "qwen3_moe_mini",
                    "--mutants", "moe.expert,oss.sink,kda.decay"], timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"oss.sink, kda.decay: no such mutant of {SPEC} for qwen3_moe_mini; its mutants are " \
        "gqa.k_norm, gqa.kv_read, gqa.o_proj, moe.expert, qwen_moe.routed_experts, qwen_moe.router" \
        in r.stderr, r.stderr[-2000:]


@pytest.mark.extended
def test_eager_at_the_largest_batch_and_a_verify_step_race_free():
    summary = _run(SPEC, "--mode", "eager", "--steps", "2", "--batch", "8", "--races")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    verify = _run(SPEC, "--mode", "eager", "--verify", "--steps", "3", "--batch", "1", "--races")
    assert verify["verify"] and verify["emulation_check"] == "exact" and numerics.failures(verify) == []


@pytest.mark.extended
def test_fp8_experts_bit_equal_to_the_emulation_of_their_requantized_values(tmp_path):
    """The 30B spec with its experts stored as rounded FP8 blocks: the kernel equals the
    emulation run on the requantized checkpoint."""
    spec = tmp_path / "qwen3_30b_a3b.sched"
    spec.write_text(Path(SPEC).read_text().replace("format expert.gate_up bf16", "format expert.gate_up fp8 "
                                                   "block 512 rounded").replace(
        "format expert.down bf16", "format expert.down fp8 block 128 rounded"))
    summary = _run(str(spec), "--mode", "on_wait", "--steps", "2", "--batch", "2")
    assert_bit_equal(summary)
    assert summary["requantization"]
