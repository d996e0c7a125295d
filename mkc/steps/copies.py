"""State copies (`load state.X -> BUF ...; wait ...`, `store BUF -> state.X ...`): started and
waited at program points, and a store's drain into the next layer of the kind."""
from __future__ import annotations

from dataclasses import dataclass

from mkc import ir
from mkc.steps.base import Step, spec_line
from mkc.tags import LayerState, StateRegion


def copy_name(direction: str, buffer: str) -> str:
    """How layer bodies name a state copy (unique within a kind: one a direction and buffer);
    its semaphore is `sem__<name>` (`mkc.runtime.context.StateCopy`)."""
    return f"{direction}_{buffer}"


@dataclass(frozen=True)
class _Copy(Step):
    transfer: ir.Transfer | None = None

    @property
    def sem(self) -> tuple[str, str]:
        return (self.transfer.direction, self.transfer.buffer)

    def _comment(self) -> str:
        t = self.transfer
        arrow = (f"state.{t.state} -> {t.buffer}" if t.direction == "load"
                 else f"{t.buffer} -> state.{t.state}")
        return f"{spec_line(t.span)}: {t.direction} {arrow}"

    def _wait(self, t) -> None:
        tr = self.transfer
        t.tb.wait(sem=self.sem, nbytes=t.sized(tr.buffer), where=t.where(self.point), span=tr.span)


@dataclass(frozen=True)
class Start(_Copy):
    kind = "start"

    def trace(self, t) -> None:
        tr = self.transfer
        region = StateRegion(tr.state, t.layer)
        if tr.direction == "load":
            t.tb.start(dst=tr.buffer, slot=None, sem=self.sem, nbytes=t.sized(tr.buffer),
                       tag=LayerState(t.layer), hbm=(region, "read"), where=t.where(self.point),
                       span=tr.span)
        else:
            t.tb.start(dst="", slot=None, sem=self.sem, nbytes=t.sized(tr.buffer), tag=None,
                       src=(tr.buffer, None, LayerState(t.layer, updated=True)), hbm=(region, "write"),
                       where=t.where(self.point), span=tr.span)

    def emit(self, e, indent: str) -> None:
        name = copy_name(self.transfer.direction, self.transfer.buffer)
        e.line(indent, f'c.copy("{name}").start()   # {self._comment()}')


@dataclass(frozen=True)
class Wait(_Copy):
    kind = "wait"

    def trace(self, t) -> None:
        self._wait(t)

    def emit(self, e, indent: str) -> None:
        name = copy_name(self.transfer.direction, self.transfer.buffer)
        e.line(indent, f'c.copy("{name}").wait()   # {self._comment()}')


@dataclass(frozen=True)
class Drain(_Copy):
    """The previous layer of this kind's copy, waited at this layer's start (the first layer
    of a kind has none: the epilogue drains the last)."""

    kind = "drain"

    def trace(self, t) -> None:
        if t.seen > 0:
            self._wait(t)

    def emit(self, e, indent: str) -> None:
        tr = self.transfer
        e.line("", "")
        e.line(indent, "@pl.when(c.si > 0)")
        e.line(indent, f"def _():   # {spec_line(tr.span)}: the previous {e.kind} layer's "
                       f"{tr.direction} of state.{tr.state} drains here")
        e.line(indent, f'    c.copy("{copy_name(tr.direction, tr.buffer)}", previous=True).wait()')
