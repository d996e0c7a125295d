import pytest

from mkc.diagnostics import MkcError
from mkc.lang.parser import parse, parse_file
from tests_support import SPEC  # noqa: E402


def test_parses_the_shipped_spec_with_spans():
    sched, _ = parse_file(SPEC)
    assert sched.name.text == "qwen3_8_27b"
    assert sched.settings["batch"].value == (1, 8)
    limit, reserve = sched.settings["vmem"].value
    assert (limit.value, reserve.value) == (64 << 20, 6 << 20)
    gdn = next(p for p in sched.phases if p.kind.text == "gdn")
    load = next(t for t in gdn.transfers if t.direction == "load")
    assert [b.src.text for b in load.bindings] == ["state.conv", "state.recurrent"]
    assert load.start.anchor.text == "start" and load.waits[0].anchor.text == "conv"
    assert load.span.line == SPEC.read_text().splitlines().index(
        next(line for line in SPEC.read_text().splitlines() if "load  state.conv" in line)) + 1


@pytest.mark.parametrize("clause, rows", [("", "none"), (" scatter", None),
                                           (" scatter from 8 rows", 8)])
def test_an_allreduce_takes_a_scatter_clause_after_its_wire(clause, rows):
    src = f"schedule x {{\n  phase gqa {{\n    allreduce o_proj two_level host wire bf16{clause}\n  }}\n}}"
    (ar,) = parse(src).phases[0].allreduces
    assert ar.wire_dtype.text == "bf16" and ar.level.text == "host"
    if rows == "none":
        assert ar.scatter is None
        return
    assert ar.scatter.word.text == "scatter" and ar.scatter.rows == rows
    assert (ar.scatter.word.span.line, ar.scatter.word.span.column) == (3, 47)
    assert ar.scatter.span.end_column == ar.span.end_column


@pytest.mark.parametrize("src, line, col", [
    ("schedule x {\n  batch\n}", 3, 1),
    ("schedule x { model \"a\" @ }", 1, 24),
    ("schedule x {\n  ring w: 3 slots of bf16 tiles up to 1 y 2\n}", 2, 41),
])
def test_syntax_errors_point_at_the_token(src, line, col):
    with pytest.raises(MkcError) as e:
        parse(src, "t.sched")
    d = e.value.diagnostics[0]
    assert d.code == "E-SYNTAX"
    assert (d.span.line, d.span.column) == (line, col)
    text = e.value.render(src)
    assert f"t.sched:{line}:{col}" in text and "^" in text and "hint:" in text


def test_unterminated_schedule_reports_end_of_file():
    with pytest.raises(MkcError) as e:
        parse("schedule x { context 4", "t.sched")
    assert "ends in the middle" in e.value.diagnostics[0].message


@pytest.mark.parametrize("char", ["\r", "\x0c", "\x1c", "\x85", "\u2028"])
def test_a_diagnostic_shows_the_line_the_lexer_counted(char):
    """Only '\n' ends a line for the lexer: a comment holding a character str.splitlines()
    breaks at neither shifts the excerpt under the caret nor the end-of-file position."""
    src = f"# one{char}more\nschedule x {{\n  contxt 4\n}}\n"
    with pytest.raises(MkcError) as e:
        parse(src, "t.sched")
    assert e.value.diagnostics[0].span.line == 3
    assert "    3 |   contxt 4\n" in e.value.render(src)
    src = f"# one{char}more\nschedule x {{ context 4"
    with pytest.raises(MkcError) as e:
        parse(src, "t.sched")
    assert (e.value.diagnostics[0].span.line, e.value.diagnostics[0].span.column) == (2, 23)


@pytest.mark.parametrize("typo, keyword", [("alreduce", "allreduce"), ("laod", "load"),
                                           ("scopd", "scoped")])
def test_a_misspelt_keyword_gets_the_closest_keyword_that_may_stand_there(typo, keyword):
    text = SPEC.read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith(keyword + " "))
    with pytest.raises(MkcError) as e:
        parse(text.replace(line, line.replace(keyword, typo, 1), 1))
    d = e.value.diagnostics[0]
    assert d.code == "E-SYNTAX" and d.hint.startswith(f"did you mean '{keyword}'? "), d.hint


def test_a_word_near_no_keyword_gets_no_guess():
    text = SPEC.read_text()
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("allreduce "))
    with pytest.raises(MkcError) as e:
        parse(text.replace(line, line.replace("allreduce", "xyzzy", 1), 1))
    assert "did you mean" not in e.value.diagnostics[0].hint


@pytest.mark.parametrize("statement, followed_by", [
    ("load  state.conv -> conv_buf at start", "\n    store"),
    ("store rec_buf -> state.recurrent after delta_rule", "\n    # a comment\n  }"),
    ("store rec_buf -> state.recurrent\n        after delta_rule", "\n  }")])
def test_a_copy_without_wait_is_reported_at_the_statement(statement, followed_by):
    """Not as `unexpected 'store'` on the next line: the copy's own span, and the fix."""
    src = f"schedule x {{\n  phase gdn {{\n    {statement}{followed_by}\n  }}\n}}\n"
    with pytest.raises(MkcError) as e:
        parse(src, "t.sched")
    [d] = e.value.diagnostics
    direction = statement.split()[0]
    assert d.code == "E-SYNTAX" and f"the {direction} is never waited" in d.message
    lines = src.splitlines()[d.span.line - 1:d.span.end_line]
    lines[-1] = lines[-1][:d.span.end_column - 1]
    lines[0] = lines[0][d.span.column - 1:]
    assert "\n".join(lines) == statement
    assert d.hint.startswith(f"write `{' '.join(statement.split())}; wait before ")
    if direction == "store":
        assert "; wait before next gdn`" in d.hint


def test_a_wait_without_its_semicolon_shows_the_statement_with_it():
    src = "schedule x {\n  phase gdn {\n    load state.conv -> c at start wait before conv  # x\n  }\n}\n"
    with pytest.raises(MkcError) as e:
        parse(src, "t.sched")
    d = e.value.diagnostics[0]
    assert d.message.startswith("unexpected 'wait': a ';' must separate")
    assert d.hint == "write `load state.conv -> c at start; wait before conv`"


def test_a_wait_point_without_wait_names_the_keyword():
    src = ("schedule x {\n  phase gdn {\n    store c -> state.conv after conv; wait after conv, before end\n"
           "  }\n}\n")
    with pytest.raises(MkcError) as e:
        parse(src, "t.sched")
    assert e.value.diagnostics[0].hint.startswith("write `wait before end`: each wait point")


def test_an_oversized_text_is_refused_before_it_is_parsed():
    """An editor's buffer or stdin gets the size limit a spec file gets (its parse would take
    seconds a KiB and gigabytes)."""
    from mkc.lang.parser import MAX_SPEC_BYTES
    text = SPEC.read_text() + "# padding\n" * (MAX_SPEC_BYTES // 10)
    with pytest.raises(MkcError) as e:
        parse(text, "t.sched")
    [d] = e.value.diagnostics
    assert d.code == "E-IO" and "larger than 256 KiB" in d.message and d.span.file == "t.sched"
