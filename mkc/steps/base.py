"""The step base class and what every step's emitted comment says."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from mkc import ir
from mkc.diagnostics import Span

# The stages that call a step import this package, never the other way: a step's `trace`
# takes a `mkc.trace.LayerTrace`, its `emit` a `mkc.codegen.layers.LayerEmitter`.
LayerTrace = LayerEmitter = Any


@dataclass(frozen=True)
class Step:
    """One step of a layer's program at program point `point` (before op `point`; after the
    last op at `len(ops)`)."""

    point: int
    kind: ClassVar[str] = ""          # how diagnostics and tests name the step kind

    def values(self, k: ir.KindSchedule) -> tuple[list[str], list[str]]:
        """The register values it reads and those it defines."""
        return [], []

    def trace(self, t: LayerTrace) -> None:
        raise NotImplementedError(f"{type(self).__name__} adds nothing to the trace")

    def emit(self, e: LayerEmitter, indent: str) -> None:
        raise NotImplementedError(f"{type(self).__name__} emits no code")


def spec_line(span: Span | None) -> str:
    """Where in the spec a step comes from, for the comment beside its emitted line."""
    known = span is not None and (span.line, span.column, span.end_line, span.end_column) != (1, 1, 1, 1)
    return f"spec line {span.line}" if known else "spec"
