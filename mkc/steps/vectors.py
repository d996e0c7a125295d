"""The per-layer vectors, double-buffered by layer parity: at a layer's start its vectors are
waited and the next ones issued (`ahead` layers on)."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.steps.base import Step


@dataclass(frozen=True)
class Vectors(Step):
    kind = "vectors"

    def trace(self, t) -> None:
        par, where = t.s.parity, t.where(self.point)
        if par.ahead == 0:
            t.tracer.start_vectors(t.layer, where)
        t.tb.wait(sem=("vectors", t.layer % 2), nbytes=t.tracer.vec_bytes, where=where, span=par.span)
        if par.ahead > 0 and t.layer + par.ahead < len(t.s.layer_kinds):
            t.tracer.start_vectors(t.layer + par.ahead, where)

    def emit(self, e, indent: str) -> None:
        e.line(indent, "c.vectors_arrive()   # this layer's vectors; issue the next ones")
