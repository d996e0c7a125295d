"""Collectives after an op (`allreduce OP ...`, `allgather OP ...`, `exchange OP with
sibling ...`): the op's output value is replaced by the reduced or gathered one, in-kernel by
remote DMA (`mkc.runtime.collectives`). A collective's trace event carries its step, which
says what it sends (`rounds`) for the step-time model to price."""
from __future__ import annotations

from dataclasses import dataclass

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
        """The call, its spec line beside it (`mkc.perf.bundles` charges the call's
        instructions to it) and what it does; that on a line of its own above where the line
        would pass the module's line length."""
        value = e.k.op_values[self.op][1][0]
        call = f"{value} = k.{method}({value}, {constant})   # {spec_line(self.entry.span)}"
        if len(indent) + len(call) + len(what) + 2 > LINE_LENGTH:
            e.line(indent, f"# {what}")
            e.line(indent, call)
        else:
            e.line(indent, f"{call}: {what}")


@dataclass(frozen=True)
class AllReduce(_Collective):
    kind = "allreduce"

    def rounds(self, batch: int, cores_per_chip: int) -> tuple[Round, ...]:
        """One-shot: each stage sends the whole partial to every peer and sums every slot. In
        a kernel of `batch` rows that scatters (`ir.AllReduce.scattered`): a chunk of the
        columns to each peer of the first group in the wire dtype and its slots summed, the
        later stages likewise on the chunk, then the chunk sums gathered in f32."""
        a = self.entry
        wire = ir.DTYPE_BYTES[a.wire_dtype]
        if not a.scattered(batch):
            return tuple(Round(size, stride, batch * a.width * wire, (size - 1) * batch * a.width)
                         for size, stride in a.stages)
        chunk = batch * a.chunk
        first = a.stages[0]
        return (*(Round(size, stride, chunk * wire, (size - 1) * chunk) for size, stride in a.stages),
                Round(*first, chunk * ir.DTYPE_BYTES["f32"]))

    def emit(self, e, indent: str) -> None:
        a = self.entry
        scatter = "" if a.scatter_from is None else ", " + scatter_text(a.scatter_from)
        self._emit(e, indent, "allreduce", reduce_name(e.kind, self.op),
                   f"{a.algorithm}, wire {a.wire_dtype}{scatter}")


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
