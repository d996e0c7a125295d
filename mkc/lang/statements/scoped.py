"""`scoped BUFFERS from OP to OP`: buffers live over a span of a layer's ops."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// live from the first named op (or start) through the last (or end), inclusive
scoped_item:    "scoped" name_list "from" NAME "to" NAME
''')


@dataclass(frozen=True)
class Scoped:
    buffers: list[Name]
    first: Name         # an op name or "start"
    last: Name          # an op name or "end"
    span: Span


@SYNTAX.statement("scoped_item", "phase", "scoped")
def scoped_item(b: Builder, meta: Meta, items: list) -> Scoped:
    return Scoped(items[0], b.name(items[1]), b.name(items[2]), b.span(meta))
