"""`refill RING after OP [from N rows | up to N rows]`: the ring's refills held back to a later
point."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name, Point
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// The refills of the ring tiles a layer consumes up to OP start after OP (before its
// collectives), not as each tile is consumed; `from N rows` / `up to N rows`: in kernels of
// at least / at most N rows.
refill_item:    "refill" NAME point refill_rows?
refill_rows:    "from" INT "rows"           -> refill_from
           |    "up" "to" INT "rows"        -> refill_up_to
''')


@dataclass(frozen=True)
class Refill:
    ring: Name
    start: Point
    rows: int | None            # N: only kernels of at least N rows, or of at most N (`up_to`)
    up_to: bool
    span: Span


@SYNTAX.rule("refill_from")
def refill_from(b: Builder, meta: Meta, items: list) -> tuple[int, bool]:
    return int(items[0]), False


@SYNTAX.rule("refill_up_to")
def refill_up_to(b: Builder, meta: Meta, items: list) -> tuple[int, bool]:
    return int(items[0]), True


@SYNTAX.statement("refill_item", "phase", "refills")
def refill_item(b: Builder, meta: Meta, items: list) -> Refill:
    rows, up_to = items[2] if len(items) > 2 and items[2] is not None else (None, False)
    return Refill(b.name(items[0]), items[1], rows, up_to, b.span(meta))
