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
