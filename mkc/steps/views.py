"""Pool views: a weight view's next layer of matrices prefetched (`prefetch ... at OP`), routed
experts fetched into a view's slots as routing picks them (`fetch experts ... at OP`), a
pooled matrix waited before its first reader, and a view freed after its last."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.steps.base import Step, spec_line


@dataclass(frozen=True)
class _View(Step):
    view: str = ""                         # "pool.view"


@dataclass(frozen=True)
class Prefetch(_View):
    kind = "prefetch"

    def trace(self, t) -> None:
        if t.layer + 1 < len(t.s.layer_kinds):
            t.tracer.start_weights(self.view, t.layer + 1, t.where(self.point), t.k.prefetch.span)

    def emit(self, e, indent: str) -> None:
        f = e.k.prefetch
        e.line(indent, f"c.prefetch_view()   # {spec_line(f.span)}: prefetch next {f.pool}.{f.view}")


@dataclass(frozen=True)
class Fetch(_View):
    kind = "fetch"

    def trace(self, t) -> None:
        where, span = t.where(self.point), t.k.fetch.span
        t.tracer.open_view(self.view, t.layer, where, span)
        for e in range(min(t.tracer.views[self.view].slots, t.tracer.expert_count)):
            t.tracer.start_expert(self.view, t.layer, e, where, span)

    def emit(self, e, indent: str) -> None:
        f = e.k.fetch
        e.line(indent, f"# {spec_line(f.span)}: fetch experts -> {f.pool}.{f.view}, the first slots now")
        e.line(indent, "c.start_experts()")


@dataclass(frozen=True)
class PoolWait(_View):
    """A pooled matrix (`family`) waited before the first op that reads it."""

    kind = "pool_wait"
    family: str = ""

    def trace(self, t) -> None:
        view = t.tracer.views[self.view]
        m = next(m for m in view.matrices[t.kname] if m.name == self.family)
        t.tb.wait(sem=(self.view, m.name), nbytes=m.nbytes, where=t.where(self.point), span=view.span)

    def emit(self, e, indent: str) -> None:
        e.line(indent, f'c.wait_pooled("{self.family}")   # {self.view}: before its first reader')


@dataclass(frozen=True)
class ViewClose(_View):
    kind = "view_close"

    def trace(self, t) -> None:
        t.tb.close_view(self.view, t.layer, t.label, f"{t.label} after {t.k.ops[self.point]}",
                        t.tracer.views[self.view].span)

    def emit(self, e, indent: str) -> None:
        e.line(indent, f"# the pool view {self.view} is free from here")
