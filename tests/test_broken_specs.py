"""The broken-spec corpus: each file names the diagnostic it must produce on its first line."""
from pathlib import Path

import pytest

from conftest import run_python
from mkc.compiler import check_spec
from mkc.diagnostics import MkcError

CORPUS = sorted((Path(__file__).parent / "broken_specs").glob("*.sched"))


def _expectation(path: Path) -> tuple[str, str]:
    head = path.read_text().splitlines()[0]
    code, text = head.removeprefix("# expect: ").split(": ", 1)
    return code, text


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 25


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_broken_spec_is_rejected_with_expected_diagnostic(path):
    code, text = _expectation(path)
    with pytest.raises(MkcError) as e:
        check_spec(path)
    found = [(d.code, d.message) for d in e.value.diagnostics]
    assert any(c == code and text in m for c, m in found), found
    for d in e.value.diagnostics:
        assert d.hint, f"{d.code} has no hint"
        assert d.span.file == str(path)


def test_cli_exits_1_without_traceback(tmp_path):
    broken = Path(__file__).parent / "broken_specs" / "double_wait.sched"
    out = tmp_path / "gen"
    r = run_python(["-m", "mkc", "compile", str(broken), "-o", str(out)], timeout=120)
    assert r.returncode == 1
    assert "Traceback" not in r.stderr and "Traceback" not in r.stdout
    assert "error[E-DMA-WAIT]" in r.stderr and "hint:" in r.stderr
    assert f"{broken}:" in r.stderr
    assert not out.exists(), "a failed compile must not write output"


def test_cli_reports_missing_file_cleanly():
    r = run_python(["-m", "mkc", "check", "no/such.sched"], timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr and "cannot read spec" in r.stderr


@pytest.mark.parametrize("name, slice_", [
    ("v6e_hbm_one_chip", "`v6e topology 2x2 (mesh tp = 4)`"),
    ("k3_hbm_over_on_8_chips", "`tpu7x topology 2x2x4 (mesh tp = 32)`"),
    ("shard_not_divisible", "`tpu7x topology 1x1x1 (mesh tp = 2)`")])
def test_a_slice_too_small_or_indivisible_names_the_smallest_that_works(name, slice_):
    """HBM over capacity and shard rules that do not divide are fixed by another slice of the
    same generation: the hint names the smallest on which the spec resolves and fits."""
    with pytest.raises(MkcError) as e:
        check_spec(Path(__file__).parent / "broken_specs" / f"{name}.sched")
    assert any(f"the smallest slice that works: {slice_}" in d.hint for d in e.value.diagnostics)


def test_indivisible_rule_names_the_spellings_that_divide_on_this_mesh():
    """Besides the smallest slice, the hint offers the groups the class could split over on
    the mesh as written (tests/test_resolve.py checks that exactly those resolve)."""
    with pytest.raises(MkcError) as e:
        check_spec(Path(__file__).parent / "broken_specs" / "shard_not_divisible.sched")
    assert "write `shard heads over 8` (or over host, tp / 4, 4," in e.value.diagnostics[0].hint
