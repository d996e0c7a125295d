"""Verify steps (`verify R` in a spec): one kernel launch over R consecutive rows of each
sequence equals R decode steps of the family's reference, in logits and next tokens, and in
the state committed after any accepted prefix (0 rows: the state before, exactly); in both DMA
modes and race-free, for every family; the speculative generation loop reproduces greedy
decoding token for token; and the full-size verify kernels compile with libtpu.

The interpret runs go through the example runners (`--verify`), whose rows are judged by
`mkc.numerics` like the decode steps they replace, each from the state the verify step commits
before it: to f32 rounding against the rounding emulation (exact) and by the plain reference."""
import sys

import pytest

from conftest import run_python
from mkc import numerics
from tests_support import ROOT, run_example


def _judged(summary: dict, rows: int) -> None:
    assert summary["verify"] and len(summary["steps"]) == rows
    assert numerics.failures(summary) == [], summary
    assert summary["steps"][0]["emulation"]["logits"] == 0.0      # row 0: bit-equal


@pytest.mark.slow
def test_qwen_verify_of_two_sequences_in_eager_mode_is_race_free():
    """Two sequences of 3 rows (wave-major rows 0..5) in one launch, eager DMAs, with race
    detection: the rows of sequence 0 (142, 143, 144) straddle two 16-row blocks. (The other
    families' verify tests run on_wait.) Judged exactly at every row (from 141 too, since the
    emulation runs the gated norm head by head: `mkc.numerics`)."""
    summary = run_example("examples/run_mini.py", "--verify", "--steps", "3", "--batch", "2",
                          "--first-position", "142", "--mode", "eager", "--races", timeout=1200)
    _judged(summary, 3)
    assert summary["races_found"] is False


@pytest.mark.extended
def test_qwen_moe_verify_rows_equal_decode_steps():
    """Every row judged exactly from the state committed before it."""
    summary = run_example("examples/run_mini.py", "--spec", str(ROOT / "schedules/qwen3_5_35b_a3b.sched"),
                          "--model", "qwen3_5_moe_mini", "--verify", "--steps", "3", "--batch", "1",
                          timeout=1200)
    assert summary["verify"] and len(summary["steps"]) == 3
    assert summary["emulation_check"] == "exact" and numerics.failures(summary) == [], summary


@pytest.mark.extended
def test_k3_verify_rows_equal_decode_steps_bit_for_bit():
    summary = run_example("examples/run_k3_mini.py", "--verify", "--steps", "2", "--batch", "1",
                          timeout=1500)
    _judged(summary, 2)
    for row in summary["steps"]:
        assert row["emulation"]["logits"] == 0.0                   # measured: every row


@pytest.mark.extended
def test_speculative_generation_equals_greedy_decoding():
    """The loop with a drafter that is right except for one draft per launch: acceptance
    lengths vary (a rejected first draft, partial and full acceptance) and the text equals
    greedy decoding by the rounding-emulating reference. (The default prompt: its greedy text
    has no top-2 near-tie the kernel's ~1e-3 rounding difference from the emulation at rows past
    the first could flip; `--prompt 5,17,99,5,17 --tokens 6` has one at its 6th token.)"""
    summary = run_example("examples/speculative.py", "--tokens", "8", "--rows", "4",
                          "--drafter", "oracle", timeout=1500)
    assert summary["tokens"] == summary["greedy"]
    assert 1 in summary["per_launch"] and max(summary["per_launch"]) >= 3


@pytest.mark.extended
def test_speculative_generation_with_the_default_draft_model_speculates():
    """The example as a user first runs it: the draft model's drafts are accepted (more than
    one token a launch on average), and the text is still greedy decoding's."""
    summary = run_example("examples/speculative.py", "--tokens", "8", "--rows", "4", timeout=1500)
    assert summary["tokens"] == summary["greedy"]
    assert summary["mean_acceptance"] > 2, summary["per_launch"]


def test_prompt_lookup_drafts_the_continuation_of_the_last_ngram():
    sys.path.insert(0, str(ROOT / "examples"))
    from speculative import prompt_lookup
    assert prompt_lookup([5, 17, 99, 5, 17, 42, 5, 17], 3) == [42, 5, 17]    # the latest match
    assert prompt_lookup([1, 2, 3, 9, 3], 2) == [9, 3]                      # a 1-gram fallback
    assert prompt_lookup([1, 2, 3], 4) == []


@pytest.mark.slow
@pytest.mark.parametrize("module, sequences", [
    pytest.param("qwen3_8_27b", 2, marks=pytest.mark.extended),   # at mkc's VMEM boundary in CI
    ("kimi_k3", 1), pytest.param("gpt_oss_120b", 1, marks=pytest.mark.extended)])
def test_full_size_verify_kernel_compiles(module, sequences):
    """8 rows per sequence (Qwen: 2 sequences, the widest kernel its spec allows, 16 rows).
    K3 and Qwen carry a bf16/f32 conv state whose rows are a tiled dim: handed spread.
    GPT-OSS (one sequence of 8 rows: its specs' verify width) writes the rows into its
    sliding layers' KV ring, in 16-row tiles that may wrap."""
    r = run_python(["benchmarks/tpu_compile.py", f"generated/{module}.py", str(sequences),
                    "--verify", "8"], timeout=900)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert f"verify 8 rows x {sequences} sequences" in r.stdout and "compiled for tpu7x" in r.stdout
