"""Collectives after an op (`allreduce OP ...`, `allgather OP ...`, `exchange OP with
sibling ...`): the op's output value is replaced by the reduced or gathered one, in-kernel by
remote DMA (`mkc.runtime.collectives`). A collective's trace event carries its step, which
says what it sends (`rounds`) for the step-time model to price."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mkc import ir
from mkc.lang.statements.collectives import scatter_text
from mkc.steps.base import Step, spec_line


def reduce_name(kind: str, op: str) -> str:
    """The module constant holding the all-reduce stages of `op`'s output in `kind`."""
    return f"{kind}_{op}_reduce".upper()


def gather_name(kind: str, op: str) -> str:
    """The module constant of the all-gather of `op`'s output in `kind`."""
    return f"{kind}_{op}_gather".upper()


def exchange_name(kind: str, op: str) -> str:
    """The module constant of the sibling exchange of `op`'s output in `kind`."""
    return f"{kind}_{op}_exchange".upper()


LINE_LENGTH = 110          # a generated module's longest line (ruff's, pyproject.toml)


@dataclass(frozen=True)
class Round:
    """One round of a collective as this rank runs it: `nbytes` to every peer of the rank group
    (size, stride) holding it, then `sums` additions of what arrived."""

    size: int
    stride: int
    nbytes: float
    sums: int = 0


@dataclass(frozen=True)
class _Collective(Step):
    op: str = ""                           # the op whose output it takes
    entry: ir.AllReduce | ir.AllGather | ir.Exchange | None = None

    def values(self, k: ir.KindSchedule) -> tuple[list[str], list[str]]:
        value = k.op_values[self.op][1][0]
        return [value], [value]

    def trace(self, t) -> None:
        t.tracer.collective_event(self, f"{t.label} after {self.op}")

    def rounds(self, batch: int, cores_per_chip: int) -> tuple[Round, ...]:
        """What it sends at `batch` rows, round by round."""
        raise NotImplementedError(type(self).__name__)

    def __str__(self) -> str:
        return f"{self.kind} {self.entry.after_op}"

    def _emit(self, e, indent: str, method: str, constant: str, what: str) -> None:
        value = e.k.op_values[self.op][1][0]
        _emit_line(e, indent, f"{value} = k.{method}({value}, {constant})", self.entry.span, what)

    # what `OverlapStart` calls: the method of `mkc.runtime.context.Kernel` and its constant
    def start_call(self, kind: str) -> tuple[str, str]:
        raise NotImplementedError(f"a {self.kind} cannot overlap")

    def most_stages(self) -> int:
        """Stages of its widest form (at any kernel width)."""
        return 1


def _emit_line(e, indent: str, code: str, span, what: str) -> None:
    """A collective's line with its spec line beside it (`mkc.perf.bundles` charges the
    line's instructions to it) and what it does; that on a line of its own above where the line
    would pass the module's line length."""
    call = f"{code}   # {spec_line(span)}"
    if not what:
        e.line(indent, call)
    elif len(indent) + len(call) + len(what) + 2 > LINE_LENGTH:
        e.line(indent, f"# {what}")
        e.line(indent, call)
    else:
        e.line(indent, f"{call}: {what}")


@dataclass(frozen=True)
class AllReduce(_Collective):
    kind = "allreduce"

    def rounds(self, batch: int, cores_per_chip: int) -> tuple[Round, ...]:
        """One-shot: each stage sends the whole partial to every peer and sums every slot. In
        a kernel of `batch` rows that scatters (`ir.AllReduce.scattered`): each reduce-scatter
        sends a chunk of its columns to each peer of its group in the wire dtype and sums its
        slots, the later stages one-shot on the last chunk, then the sums gathered back over
        the reduce-scattering groups in reverse, in the gather dtype."""
        a = self.entry
        wire = ir.DTYPE_BYTES[a.wire_dtype]
        if not a.scattered(batch):
            return tuple(Round(size, stride, batch * a.width * wire, (size - 1) * batch * a.width)
                         for size, stride in a.stages)
        scatters = a.scatter_stages()
        last = batch * scatters[-1][2]
        return (*(Round(size, stride, batch * chunk * wire, (size - 1) * batch * chunk)
                  for size, stride, chunk in scatters),
                *(Round(size, stride, last * wire, (size - 1) * last)
                  for size, stride in a.stages[len(scatters):]),
                *(Round(size, stride, batch * chunk * ir.DTYPE_BYTES[a.gather_dtype])
                  for size, stride, chunk in reversed(scatters)))

    def emit(self, e, indent: str) -> None:
        a = self.entry
        scatter = "" if a.scatter_from is None else ", " + scatter_text(
            a.scatter_from, a.nested, None if a.gather_dtype == "f32" else a.gather_dtype)
        self._emit(e, indent, "allreduce", reduce_name(e.kind, self.op),
                   f"{a.algorithm}, wire {a.wire_dtype}{scatter}")

    def start_call(self, kind: str) -> tuple[str, str]:
        return "start_allreduce", reduce_name(kind, self.op)

    def most_stages(self) -> int:
        return len(self.entry.stages) + (self.entry.scatter_from is not None)


@dataclass(frozen=True)
class AllGather(_Collective):
    kind = "allgather"

    def rounds(self, batch: int, cores_per_chip: int) -> tuple[Round, ...]:
        g = self.entry
        # each rank sends its [batch, width] share, cast to the receive buffer's dtype
        return (Round(g.size, g.stride, batch * g.width * ir.DTYPE_BYTES[g.wire_dtype]),)

    def emit(self, e, indent: str) -> None:
        self._emit(e, indent, "allgather", gather_name(e.kind, self.op),
                   f"all-gather over {self.entry.size} ranks")

    def start_call(self, kind: str) -> tuple[str, str]:
        return "start_allgather", gather_name(kind, self.op)


@dataclass(frozen=True)
class Exchange(_Collective):
    """A sibling exchange: the two cores of a chip swap their halves (an all-gather of 2,
    `mkc.runtime.context.Kernel.exchange`)."""

    kind = "exchange"

    def rounds(self, batch: int, cores_per_chip: int) -> tuple[Round, ...]:
        x = self.entry
        # `width` is one core's share of the columns (the receive buffer's last dim), and each
        # core sends all of it to its sibling
        return (Round(cores_per_chip, 1, batch * x.width * ir.DTYPE_BYTES[x.wire_dtype]),)

    def emit(self, e, indent: str) -> None:
        self._emit(e, indent, "exchange", exchange_name(e.kind, self.op),
                   f"exchange with sibling, wire {self.entry.wire_dtype}")


def in_flight_name(value: str) -> str:
    """The local holding an overlapped collective of `value` while it runs."""
    return f"{value}_in_flight"


@dataclass(frozen=True)
class OverlapPart(Step):
    """A part of an overlapped collective (`overlap`, `mkc.runtime.collectives.InFlight`): its
    start after its op, an advance after each op it runs under, its finish before the first op
    reading its result. Each part's trace event carries it; the step-time model runs the
    collective's rounds while compute goes on."""

    collective: AllReduce | AllGather | None = None
    part: ClassVar[str] = ""

    @property
    def entry(self) -> ir.AllReduce | ir.AllGather:
        return self.collective.entry

    def _names(self, k: ir.KindSchedule) -> tuple[str, str]:
        value = k.op_values[self.collective.op][1][0]
        return value, in_flight_name(value)

    def trace(self, t) -> None:
        t.tracer.collective_event(self, f"{t.label} {self.part} {self.collective}")

    def __str__(self) -> str:
        return f"{self.collective} ({self.part})"


@dataclass(frozen=True)
class OverlapStart(OverlapPart):
    part: ClassVar[str] = "start"

    def values(self, k: ir.KindSchedule) -> tuple[list[str], list[str]]:
        value, handle = self._names(k)
        return [value], [handle]

    def emit(self, e, indent: str) -> None:
        value, handle = self._names(e.k)
        method, constant = self.collective.start_call(e.kind)
        _emit_line(e, indent, f"{handle} = k.{method}({value}, {constant})", self.entry.span,
                   "overlapped: it runs until its first reader")


@dataclass(frozen=True)
class OverlapAdvance(OverlapPart):
    part: ClassVar[str] = "advance"

    def values(self, k: ir.KindSchedule) -> tuple[list[str], list[str]]:
        return [self._names(k)[1]], []

    def emit(self, e, indent: str) -> None:
        _emit_line(e, indent, f"{self._names(e.k)[1]}.advance()", self.entry.span, "")


@dataclass(frozen=True)
class OverlapFinish(OverlapPart):
    part: ClassVar[str] = "finish"

    def values(self, k: ir.KindSchedule) -> tuple[list[str], list[str]]:
        value, handle = self._names(k)
        return [handle], [value]

    def emit(self, e, indent: str) -> None:
        value, handle = self._names(e.k)
        _emit_line(e, indent, f"{value} = {handle}.finish()", self.entry.span, "")
