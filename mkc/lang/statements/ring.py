"""`ring NAME: N slots of DTYPE tiles up to R x C`: VMEM slots holding uniform weight tiles."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// A ring of VMEM slots holding uniform weight tiles; "up to" lets mkc derive the tile
// shape from the model's per-rank matrices.
ring_stmt:  "ring" NAME ":" INT "slots" "of" NAME "tiles" "up" "to" INT "x" INT
''')


@dataclass(frozen=True)
class Ring:
    name: Name
    slots: int
    dtype: Name
    max_rows: int
    max_cols: int
    span: Span


@SYNTAX.statement("ring_stmt", "schedule", "rings")
def ring_stmt(b: Builder, meta: Meta, items: list) -> Ring:
    name, slots, dtype, rows, cols = items
    return Ring(b.name(name), int(slots), b.name(dtype), int(rows), int(cols), b.span(meta))
