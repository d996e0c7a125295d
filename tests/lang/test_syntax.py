"""A statement's syntax lives in its own module: adding one to `mkc.lang.statements` adds the
statement to the parser, the formatter and the keyword hints with no other change."""
from __future__ import annotations

from dataclasses import dataclass

import pytest

from mkc.diagnostics import MkcError, Span
from mkc.lang import fmt, parser, syntax
from mkc.lang.ast import Name
from tests_support import SPEC

_TOY = syntax.Syntax(r'''
// a statement only this test knows
widget_stmt: "widget" NAME "every" INT
''', module="test_syntax.toy")


@dataclass(frozen=True)
class Widget:
    name: Name
    every: int
    span: Span


@_TOY.statement("widget_stmt", "schedule", "widgets")
def _widget(b, meta, items):
    return Widget(b.name(items[0]), int(items[1]), b.span(meta))


def _clear() -> None:
    for cached in (parser.lark_parser, parser._statement_rules, fmt._padded, fmt._blocks):
        cached.cache_clear()


@pytest.fixture
def with_toy(monkeypatch):
    shipped = syntax.modules()
    monkeypatch.setattr(syntax, "modules", lambda: shipped + (_TOY,))
    _clear()
    yield
    monkeypatch.undo()
    _clear()


def test_every_statement_is_an_alternative_where_it_stands_and_once():
    text = syntax.grammar()
    for scope, rule in (("schedule", "_stmt"), ("phase", "_phase_item")):
        listed = text.split(f"\n{rule}: ")[1].split("\n\n")[0].replace("|", " ").split()
        assert sorted(listed) == sorted(s.rule for s in syntax.statements(scope))
    rules = [s.rule for s in syntax.statements()]
    assert len(rules) == len(set(rules))


def test_a_new_statement_module_extends_the_language(with_toy):
    text = SPEC.read_text().replace("{", "{\n  widget  fan every 3", 1)
    sched = parser.parse(text, "t.sched")
    assert [(w.name.text, w.every) for w in sched.widgets] == [("fan", 3)]
    assert sched.widgets[0].span.line == 2 + SPEC.read_text().split("{", 1)[0].count("\n")
    assert "widget fan every 3" in fmt.format_text(text)          # laid out like the rest
    with pytest.raises(MkcError) as e:
        parser.parse(text.replace("widget  fan", "widgt fan"), "t.sched")
    assert e.value.diagnostics[0].hint.startswith("did you mean 'widget'?")


def test_without_the_module_the_statement_is_a_syntax_error():
    text = SPEC.read_text().replace("{", "{\n  widget fan every 3", 1)
    with pytest.raises(MkcError) as e:
        parser.parse(text, "t.sched")
    assert e.value.diagnostics[0].code == "E-SYNTAX"


def test_a_module_naming_a_rule_its_grammar_lacks_is_refused():
    with pytest.raises(ValueError, match="gadget_stmt"):
        _TOY.statement("gadget_stmt", "schedule", "gadgets")


def test_mkc_grammar_prints_a_language_lark_builds_with_every_statement(capsys):
    import lark

    from mkc.cli import main
    assert main(["grammar"]) == 0
    text = capsys.readouterr().out
    lark.Lark(text, parser="lalr")
    for s in syntax.statements():
        assert f'{s.rule}:' in text and f'"{s.keyword}"' in text
    assert all(f"// {m.module}\n" in text for m in syntax.modules())
