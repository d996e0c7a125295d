"""`run OP before OP`: an op of the phase's kind moved ahead of an earlier one it does not
depend on, a layout choice (the graph's order is the model's)."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
run_item:       "run" NAME "before" NAME
''')


@dataclass(frozen=True)
class RunBefore:
    op: Name
    before: Name
    span: Span


@SYNTAX.statement("run_item", "phase", "run_before")
def run_item(b: Builder, meta: Meta, items: list) -> RunBefore:
    return RunBefore(b.name(items[0]), b.name(items[1]), b.span(meta))
