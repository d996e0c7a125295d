"""The broken-spec corpus: each file names the diagnostic it must produce on its first line
(`# expect: CODE: text in the message`), may name text its hint must hold on the next
(`# expect hint: text`), and names where its caret must be, the cause, on a header line
`# expect at: LINE:COL` (or at the end of the first: `# expect: CODE: text at LINE:COL`)."""
import re
from pathlib import Path

import pytest

from conftest import run_python
from mkc.compiler import check_spec
from mkc.diagnostics import MkcError

CORPUS = sorted((Path(__file__).parent / "broken_specs").glob("*.sched"))


_AT = re.compile(r"(?:^# expect at: | at )(\d+):(\d+)$")


def _expectation(path: Path) -> tuple[str, str, str, tuple[int, int] | None]:
    """(code, message text, hint text, (line, column) or None) from the file's header."""
    head, *rest = path.read_text().splitlines()[:3]
    code, text = head.removeprefix("# expect: ").split(": ", 1)
    hint, at = "", None
    if m := _AT.search(text):
        text, at = text[:m.start()], (int(m[1]), int(m[2]))
    for line in rest:
        if line.startswith("# expect hint: "):
            hint = line.removeprefix("# expect hint: ")
        elif line.startswith("# expect at: "):
            m = _AT.search(line)
            at = (int(m[1]), int(m[2]))
    return code, text, hint, at


def test_corpus_is_large_enough():
    assert len(CORPUS) >= 25


def test_every_corpus_file_says_where_its_caret_is():
    assert [p.stem for p in CORPUS if _expectation(p)[3] is None] == []


@pytest.mark.parametrize("path", CORPUS, ids=lambda p: p.stem)
def test_broken_spec_is_rejected_with_expected_diagnostic(path):
    code, text, hint, at = _expectation(path)
    with pytest.raises(MkcError) as e:
        check_spec(path)
    found = [(d.code, d.message, d.hint, (d.span.line, d.span.column)) for d in e.value.diagnostics]
    assert any(c == code and text in m and hint in h and (at is None or where == at)
               for c, m, h, where in found), found
    for d in e.value.diagnostics:
        assert d.hint, f"{d.code} has no hint"
        assert d.span.file == str(path)


# Mistakes with one cause each (issue 21 and its kin): one diagnostic, at the cause, with what
# follows from it (a read finding what an overwrite left, the other buffer of one `scoped`
# line, the value tiles after the key tiles) as its notes.
ONE_CAUSE = ["store_wait_before_start", "store_rec_wait_before_start", "load_wait_before_start",
             "state_reload_while_storing", "load_after_reader",
             "load_after_reader_waited_before_start", "read_before_wait",
             "load_waited_only_before_next", "store_before_its_writer", "load_without_wait",
             "store_without_wait", "wait_without_keyword", "wait_after_end",
             "syntax_missing_semicolon", "syntax_phase_missing_brace", "keyword_misspelt",
             "v6e_vmem_limit_below_chip",
             "v6e_ring_over_vmem_limit", "scope_escape", "ring_slot_reuse_in_flight",
             "kv_slot_reuse_in_flight", "parity_reuse_while_read", "kv_slots_beyond_vmem"]


@pytest.mark.parametrize("name", ONE_CAUSE)
def test_one_cause_is_one_diagnostic(name):
    with pytest.raises(MkcError) as e:
        check_spec(Path(__file__).parent / "broken_specs" / f"{name}.sched")
    assert len(e.value.diagnostics) == 1, [d.message for d in e.value.diagnostics]


def test_follow_on_errors_are_notes_of_the_first():
    """A ring slot overwritten before it is read: the read that then finds the wrong tile is a
    note of the overwrite, not a second error."""
    with pytest.raises(MkcError) as e:
        check_spec(Path(__file__).parent / "broken_specs" / "ring_slot_reuse_in_flight.sched")
    [d] = e.value.diagnostics
    assert d.code == "E-DMA-INFLIGHT"
    assert any(n.startswith("then E-READ-BEFORE-WAIT at line 19: ") for n in d.notes), d.notes


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
