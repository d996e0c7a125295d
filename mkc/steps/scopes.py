"""Scoped buffers (`scoped BUFFER from OP to OP`): allocated for a range of ops. The emitter
turns each open/close pair into one `pl.run_scoped` function (`mkc.codegen.layers`)."""
from __future__ import annotations

from dataclasses import dataclass

from mkc import ir
from mkc.steps.base import Step


@dataclass(frozen=True)
class _Scope(Step):
    buffers: tuple[ir.Buffer, ...] = ()
    scope: int = 0                         # the scope's index among the kind's scopes


@dataclass(frozen=True)
class ScopeOpen(_Scope):
    kind = "scope_open"

    def trace(self, t) -> None:
        for b in self.buffers:
            t.tb.alloc(b.name, t.where(self.point), b.span)


@dataclass(frozen=True)
class ScopeClose(_Scope):
    kind = "scope_close"

    def trace(self, t) -> None:
        for b in self.buffers:
            t.tb.free(b.name, t.where(self.point), b.span)
