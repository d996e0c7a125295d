"""Held-back ring refills (`refill RING after OP [from N rows | up to N rows]`): the refills of
the ring tiles a layer consumes up to OP start right after OP, before its collectives."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.steps.base import Step, spec_line


@dataclass(frozen=True)
class Refill(Step):
    kind = "refill"

    def trace(self, t) -> None:
        for tile in t.held_refills:
            t.tracer.start_tile(tile, t.where(self.point))
        t.held_refills.clear()

    def emit(self, e, indent: str) -> None:
        r = e.k.refill
        rows = (f" up to {r.to_rows} rows" if r.to_rows else
                "" if r.from_rows == 1 else f" from {r.from_rows} rows")
        e.line(indent, f"c.refill_ring()   # {spec_line(r.span)}: refill after {r.after_op}{rows}")
