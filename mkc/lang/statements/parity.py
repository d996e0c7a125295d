"""`parity NAME ahead N`: per-layer small vectors double-buffered by layer parity."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// Per-layer small vectors double-buffered by layer parity, issued `ahead` layers early.
parity_stmt: "parity" NAME "ahead" INT
''')


@dataclass(frozen=True)
class Parity:
    name: Name
    ahead: int
    span: Span


@SYNTAX.statement("parity_stmt", "schedule", "parities")
def parity_stmt(b: Builder, meta: Meta, items: list) -> Parity:
    return Parity(b.name(items[0]), int(items[1]), b.span(meta))
