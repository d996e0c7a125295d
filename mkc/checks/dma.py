"""DMA hazards and synchronisation over the event trace.

Read before wait; a DMA into a slot still filling or still to be read (WAR/WAW); every DMA
waited exactly once with matching bytes on its own semaphore; scoped buffers used only while
their scope is open; nothing in flight at kernel exit.
"""
from __future__ import annotations

from collections import defaultdict, deque

from mkc import ir
from mkc.diagnostics import Diagnostic
from mkc.trace import (Alloc, Collective, CopyStart, CopyWait, EpilogueBegin, Event, EventHandlers,
                       Exit, Free, LayerBegin, OpBegin, Read, ViewClose, ViewOpen, Write)


def _held(tag) -> str:
    """What a slot holds, or a copy delivers, as diagnostics say it (`mkc.tags`)."""
    return "nothing" if tag is None else str(tag)


def _region(label: str, slot) -> str:
    """A VMEM region as diagnostics say it: the buffer as the spec names it, and the slot."""
    if isinstance(slot, tuple):
        slot = ", ".join(map(str, slot))
    return label if slot is None else f"{label}[{slot}]"


def check_dma(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    checker = _DmaChecker(s, events)
    EventHandlers("the DMA check", {
        Alloc: checker.alloc, Free: checker.free, CopyStart: checker.start, CopyWait: checker.wait,
        Read: checker.read, Write: checker.write, Exit: checker.exit,
        # pool views are the pool check's; the rest only the step-time model's
        ViewOpen: None, ViewClose: None, OpBegin: None, Collective: None, LayerBegin: None,
        EpilogueBegin: None}).replay(events)
    return checker.diags


class _DmaChecker:
    """The state of the copies as the trace unfolds: what each VMEM region holds, the copies
    filling or reading it, those on each semaphore and on each HBM region; and the diagnostics
    so far (at most 8, one per code and statement)."""

    def __init__(self, s: ir.ScheduleIR, events: list[Event]) -> None:
        self.diags: list[Diagnostic] = []
        self.label = s.label
        self._reported: set[tuple] = set()
        # buffer, semaphore or scoped range -> the first diagnostic about it
        self.first_about: dict[object, Diagnostic] = {}
        # The last read expecting each (region, tag): a slot's content is needed until then.
        self.last_read: dict[tuple, int] = {}
        for e in events:
            if type(e) is Read:
                self.last_read[(e.buffer, e.slot, e.tag)] = e.seq
            elif type(e) is CopyStart and e.src is not None:
                self.last_read[(e.src[0], e.src[1], e.src[2])] = e.seq
        # Scoped buffer -> its range: the buffers of one `scoped` line outside it are one cause.
        self.scoped = {b.name: b.scope for b in s.buffers if b.scope is not None}
        self.open_scopes: set[str] = set()
        self.content: dict[tuple, object] = {}          # region -> tag it holds
        self.filling: dict[tuple, CopyStart] = {}       # region -> DMA writing it
        # Keyed by event seq (insertion-ordered): adding and retiring a copy is O(1), so the
        # check stays linear in the trace however many copies a spec puts in flight.
        self.dma_readers: dict[tuple, dict[int, CopyStart]] = defaultdict(dict)  # region -> DMAs reading it
        self.in_flight: dict[tuple, deque[CopyStart]] = defaultdict(deque)      # semaphore -> started DMAs
        self.hbm_flight: dict[tuple, dict[str, dict[int, CopyStart]]] = defaultdict(
            lambda: {"read": {}, "write": {}})                               # HBM region -> DMAs on it

    def report(self, code: str, msg: str, e: Event, hint: str, span=None, about=None) -> None:
        """Report once per code and statement. A problem `about` a buffer (a semaphore, a
        scoped range) already reported is a consequence of the first (a read finding what an
        overwrite left, say): it becomes a note of that diagnostic, not one of its own."""
        span = span or e.span
        key = (code, span)
        if key in self._reported:
            return
        self._reported.add(key)
        first = self.first_about.get(about) if about is not None else None
        if first is not None:
            first.notes.append(f"then {code} at line {span.line}: {msg}")
        elif len(self.diags) < 8:
            d = Diagnostic(code, msg, span, hint=hint, notes=[f"at {e.where} (trace event {e.seq})"])
            self.diags.append(d)
            if about is not None:
                self.first_about[about] = d

    def region(self, buffer: str, slot) -> str:
        return _region(self.label(buffer), slot)

    def usable(self, buffer: str, e: Event) -> bool:
        if buffer and buffer in self.scoped and buffer not in self.open_scopes:
            self.report("E-SCOPE", f"{self.label(buffer)} is used outside its scope", e,
                        about=self.scoped[buffer],
                        hint="move the copy or its wait inside the `scoped` range, or widen the "
                             "range to cover it")
            return False
        return True

    # ---- scopes ----------------------------------------------------------------------------
    def alloc(self, e: Alloc) -> None:
        self.open_scopes.add(e.buffer)

    def free(self, e: Free) -> None:
        for region, dma in list(self.filling.items()):
            if region[0] == e.buffer:
                self.report("E-SCOPE", f"a copy into {self.label(e.buffer)} is still in flight "
                            "when its scope ends", e, span=dma.span, about=self.scoped.get(e.buffer),
                            hint="wait for it before the end of the `scoped` range")
        for region, readers in self.dma_readers.items():
            if region[0] == e.buffer and readers:
                self.report("E-SCOPE", f"a copy out of {self.label(e.buffer)} is still in "
                            "flight when its scope ends", e, span=next(iter(readers.values())).span,
                            about=self.scoped.get(e.buffer),
                            hint="wait for it before the end of the `scoped` range")
        self.open_scopes.discard(e.buffer)

    # ---- copies ----------------------------------------------------------------------------
    def start(self, e: CopyStart) -> None:
        if e.src is not None:
            self._start_reading(e)
        if e.buffer and self.usable(e.buffer, e):
            self._start_filling(e)
        if e.hbm is not None:
            self._start_on_hbm(e)
        self.in_flight[e.sem].append(e)

    def _start_reading(self, e: CopyStart) -> None:
        """A copy out of VMEM (a store) must find its source waited and holding what it expects."""
        src = (e.src[0], e.src[1])
        if not self.usable(e.src[0], e):
            return
        if src in self.filling:
            self.report("E-READ-BEFORE-WAIT", f"a copy reads {self.region(*src)} while "
                        f"{_held(self.filling[src].tag)} is still arriving", e, about=src[0],
                        hint="wait for the load before starting the store")
        elif self.content.get(src) != e.src[2]:
            self.report("E-READ-BEFORE-WAIT", f"a copy reads {self.region(*src)} expecting "
                        f"{_held(e.src[2])} but it holds {_held(self.content.get(src))}", e,
                        about=src[0],
                        hint="start the store after the op that produces the data")
        self.dma_readers[src][e.seq] = e

    def _start_filling(self, e: CopyStart) -> None:
        """A copy into VMEM must not land on a slot still filling, being copied out or unread."""
        dst = (e.buffer, e.slot)
        if dst in self.filling:
            self.report("E-DMA-INFLIGHT", f"copy of {_held(e.tag)} into {self.region(*dst)} "
                        f"starts while {_held(self.filling[dst].tag)} is still filling it", e,
                        about=dst[0],
                        hint="wait for the earlier copy first, or add slots so the stream "
                             "distance ('ahead') is at most the slot count")
        elif self.dma_readers.get(dst):
            self.report("E-DMA-INFLIGHT", f"copy into {self.region(*dst)} starts while a copy "
                        "out of it is still in flight", e, about=dst[0],
                        hint="wait for the store before reloading the buffer")
        else:
            old = self.content.get(dst)
            if old is not None and self.last_read.get((dst[0], dst[1], old), -1) > e.seq:
                self.report("E-DMA-INFLIGHT", f"copy of {_held(e.tag)} into {self.region(*dst)} "
                            f"overwrites {_held(old)} before it is read", e, about=dst[0],
                            hint="the slot is still being read: use 'ahead' no larger than "
                                 "the number of slots, or more slots")
        self.filling[dst] = e

    def _start_on_hbm(self, e: CopyStart) -> None:
        """Two copies of one HBM region in flight race unless both only read it."""
        region, access = e.hbm
        flight = self.hbm_flight[region]
        clash = next(iter(flight["write"].values()),
                     next(iter(flight["read"].values()), None) if access == "write" else None)
        if clash is not None:
            self.report("E-DMA-HBM", f"a copy {'into' if access == 'write' else 'out of'} "
                        f"HBM {region} starts while the copy started at "
                        f"{clash.where} (line {clash.span.line}) still "
                        f"{'writes' if clash.hbm[1] == 'write' else 'reads'} it", e,
                        hint="wait for the earlier copy first; two copies of one HBM region "
                             "in flight at once race")
        flight[access][e.seq] = e

    def wait(self, e: CopyWait) -> None:
        q = self.in_flight.get(e.sem)
        if not q:
            self.report("E-DMA-WAIT", f"wait on {e.sem[0]} with no copy in flight on its "
                        "semaphore (a double wait or a wait before the start): it would hang", e,
                        about=e.sem,
                        hint="wait for each copy exactly once, after it starts")
            return
        dma = q.popleft()
        if dma.nbytes != e.nbytes:
            self.report("E-DMA-BYTES", f"wait for {e.nbytes} bytes on a semaphore signalled by a "
                        f"{dma.nbytes}-byte copy", e, about=e.sem,
                        hint="the wait must describe a copy of the same size")
        if dma.buffer:
            region = (dma.buffer, dma.slot)
            if self.filling.get(region) is dma:
                del self.filling[region]
            self.content[region] = dma.tag
        if dma.hbm is not None:
            del self.hbm_flight[dma.hbm[0]][dma.hbm[1]][dma.seq]
        if dma.src is not None:
            self.dma_readers[(dma.src[0], dma.src[1])].pop(dma.seq, None)

    def exit(self, e: Exit) -> None:
        for q in self.in_flight.values():
            for dma in q:
                self.report("E-DMA-EXIT", f"a copy ({_held(dma.tag) if dma.buffer else 'store'}, "
                            f"started at {dma.where}) is still in flight at kernel exit", e,
                            span=dma.span, about=dma.buffer or (dma.src or (None,))[0],
                            hint="add a wait for every copy before the step ends")

    # ---- compute ---------------------------------------------------------------------------
    def read(self, e: Read) -> None:
        if not self.usable(e.buffer, e):
            return
        region = (e.buffer, e.slot)
        if region in self.filling:
            self.report("E-READ-BEFORE-WAIT", f"{e.where} reads {self.region(*region)} while the "
                        f"copy of {_held(self.filling[region].tag)} into it has not been waited", e,
                        span=self.filling[region].span, about=e.buffer,
                        hint="move the wait before this read")
        elif self.content.get(region) != e.tag:
            self.report("E-READ-BEFORE-WAIT", f"{e.where} reads {self.region(*region)} expecting "
                        f"{_held(e.tag)} but it holds {_held(self.content.get(region))}", e,
                        about=e.buffer, hint="the copy that fills it is never started or waited in time")

    def write(self, e: Write) -> None:
        if not self.usable(e.buffer, e):
            return
        region = (e.buffer, e.slot)
        if region in self.filling:
            self.report("E-DMA-INFLIGHT", f"{e.where} writes {self.region(*region)} while a copy "
                        "into it is in flight", e, span=self.filling[region].span,
                        about=e.buffer,
                        hint="wait for the load before the op that updates the buffer")
        elif self.dma_readers.get(region):
            self.report("E-DMA-INFLIGHT", f"{e.where} overwrites {self.region(*region)} while a copy "
                        "out of it is still in flight", e,
                        span=next(iter(self.dma_readers[region].values())).span, about=e.buffer,
                        hint="wait for the store before the buffer is written again")
        self.content[region] = e.tag
