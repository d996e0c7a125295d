"""MINI Qwen with its all-reduces scattered (`two_level chip wire bf16 scatter from 2 rows`:
a chip's 2 cores reduce-scatter chunks of 128 columns, the 4 chips reduce the chunk, the cores
all-gather the f32 chunk sums), compiled and run in TPU interpret mode on virtual CPU devices:
every step bit-equal to the rounding emulation, which knows only the one-shot stages (the
scattered form adds the same values in the same order), and a reduce-scatter that sends each
peer the wrong chunk rejected. The kernel of 2 rows runs the scattered form; the one of 1 row
the one-shot stages the same constants hold (`FromRows`)."""
import pytest

from tests_support import assert_bit_equal, assert_each_mutant_rejected, qwen_scatter_text, run_example

MUTANTS = ("collectives.scatter_chunk",)


def _run(tmp_path, *args: str, clause: str = "scatter from 2 rows") -> dict:
    spec = tmp_path / "qwen3_8_27b.sched"
    spec.write_text(qwen_scatter_text(clause))
    return run_example("examples/run_mini.py", "--spec", str(spec), *args, timeout=1200)


@pytest.mark.slow
def test_scattered_bit_equal_in_eager_mode_with_race_detection_and_a_wrong_chunk_rejected(tmp_path):
    """Eager DMAs land when issued, so a write racing a read before its wait shows (measured:
    about 30 s with the mutant's step)."""
    summary = _run(tmp_path, "--mode", "eager", "--races", "--steps", "2", "--batch", "2",
                   "--mutants", ",".join(MUTANTS), "--mutant-steps", "1")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    assert_each_mutant_rejected(summary, MUTANTS)


@pytest.mark.extended
def test_scattered_bit_equal_in_on_wait_mode_with_race_detection(tmp_path):
    summary = _run(tmp_path, "--mode", "on_wait", "--races", "--steps", "2", "--batch", "2")
    assert_bit_equal(summary)
    assert summary["races_found"] is False


@pytest.mark.extended
def test_one_row_runs_the_one_shot_stages_bit_equal(tmp_path):
    summary = _run(tmp_path, "--mode", "eager", "--races", "--steps", "2", "--batch", "1")
    assert_bit_equal(summary)
    assert summary["races_found"] is False


@pytest.mark.slow
def test_nested_with_bf16_sums_bit_equal_to_its_rounding_and_a_wrong_chunk_rejected(tmp_path):
    """`scatter nested gather bf16 from 2 rows`, the reference kernel's hierarchical form: the
    chip's 2 cores reduce-scatter 128-column chunks, the 4 chips reduce-scatter each chunk
    again (padded to a lane tile a member), and the sums come back over the chips, then the
    chip, in bf16: bit-equal to the emulation, which rounds the one-shot sum once to bf16 from
    2 rows; the batch-1 kernel keeps the one-shot stages."""
    summary = _run(tmp_path, "--mode", "eager", "--races", "--steps", "2", "--batch", "2",
                   "--mutants", ",".join(MUTANTS), "--mutant-steps", "1",
                   clause="scatter nested gather bf16 from 2 rows")
    assert_bit_equal(summary)
    assert summary["races_found"] is False
    assert_each_mutant_rejected(summary, MUTANTS)
