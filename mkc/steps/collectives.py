"""Collectives after an op (`allreduce OP ...`, `allgather OP ...`, `exchange OP with
sibling ...`): the op's output value is replaced by the reduced or gathered one, in-kernel by
remote DMA (`mkc.runtime.collectives`)."""
from __future__ import annotations

from dataclasses import dataclass

from mkc import ir
from mkc.steps.base import Step, spec_line


def reduce_name(kind: str, op: str) -> str:
    """The module constant holding the all-reduce stages of `op`'s output in `kind`."""
    return f"{kind}_{op}_reduce".upper()


def gather_name(kind: str, op: str) -> str:
    """The module constant of the all-gather (or sibling exchange) of `op`'s output in `kind`."""
    return f"{kind}_{op}_gather".upper()


@dataclass(frozen=True)
class _Collective(Step):
    op: str = ""                           # the op whose output it takes
    entry: ir.AllReduce | ir.AllGather | ir.Exchange | None = None

    def values(self, k: ir.KindSchedule) -> tuple[list[str], list[str]]:
        value = k.op_values[self.op][1][0]
        return [value], [value]

    def trace(self, t) -> None:
        t.tracer.collective_event(self.kind, self.entry, f"{t.label} after {self.op}")

    def _emit(self, e, indent: str, method: str, constant: str, what: str) -> None:
        value = e.k.op_values[self.op][1][0]
        e.line(indent, f"{value} = k.{method}({value}, {constant})   # {spec_line(self.entry.span)}: {what}")


@dataclass(frozen=True)
class AllReduce(_Collective):
    kind = "allreduce"

    def emit(self, e, indent: str) -> None:
        a = self.entry
        self._emit(e, indent, "allreduce", reduce_name(e.kind, self.op),
                   f"{a.algorithm}, wire {a.wire_dtype}")


@dataclass(frozen=True)
class AllGather(_Collective):
    kind = "allgather"

    def emit(self, e, indent: str) -> None:
        self._emit(e, indent, "allgather", gather_name(e.kind, self.op),
                   f"all-gather over {self.entry.size} ranks")


@dataclass(frozen=True)
class Exchange(_Collective):
    """A sibling exchange: the two cores of a chip swap their halves (an all-gather of 2)."""

    kind = "exchange"

    def emit(self, e, indent: str) -> None:
        self._emit(e, indent, "allgather", gather_name(e.kind, self.op),
                   f"swap with the sibling core, wire {self.entry.wire_dtype}")
