"""DMA hazards and synchronisation over the event trace.

Read before wait; a DMA into a slot still filling or still to be read (WAR/WAW); every DMA
waited exactly once with matching bytes on its own semaphore; scoped buffers used only while
their scope is open; nothing in flight at kernel exit.
"""
from __future__ import annotations

from collections import defaultdict, deque

from mkc import ir
from mkc.diagnostics import Diagnostic
from mkc.trace import Event


def _fmt(tag) -> str:
    if isinstance(tag, tuple):
        kind, *rest = tag
        if kind == "tile":
            return f"weight tile {rest[0]}"
        if kind == "vectors":
            return f"the vectors of layer {rest[0]}"
        if kind == "kv":
            return f"KV tile {rest[1]} of layer {rest[0]}"
        if kind == "state":
            return f"the state of layer {rest[0]} as loaded"
        if kind == "state-updated":
            return f"the state of layer {rest[0]} as updated"
        if kind == "pool":
            return f"{rest[1]} of layer {rest[0]}"
        if kind == "expert":
            return f"routed expert {rest[1]} of layer {rest[0]}"
        return " ".join(map(str, tag))
    return "nothing" if tag is None else str(tag)


def _fmt_hbm(region: tuple) -> str:
    kind, *rest = region
    if kind == "state":
        return f"state.{rest[0]} of layer {rest[1]}"
    return " ".join(map(str, region))


def _region(buffer: str, slot) -> str:
    if isinstance(slot, tuple):
        slot = ", ".join(map(str, slot))
    return buffer if slot is None else f"{buffer}[{slot}]"


def check_dma(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    diags: list[Diagnostic] = []
    seen: set[tuple] = set()

    def report(code: str, msg: str, e: Event, hint: str, span=None) -> None:
        key = (code, (span or e.span))
        if key not in seen and len(diags) < 8:
            seen.add(key)
            diags.append(Diagnostic(code, msg, span or e.span, hint=hint,
                                    notes=[f"at {e.where} (trace event {e.seq})"]))

    # The last read expecting each (region, tag): a slot's content is needed until then.
    last_read: dict[tuple, int] = {}
    for e in events:
        if e.op == "read":
            last_read[(e.buffer, e.slot, e.tag)] = e.seq
        if e.op == "start" and e.src is not None:
            last_read[(e.src[0], e.src[1], e.src[2])] = e.seq

    scoped = {b.name for b in s.buffers if b.scope is not None}
    open_scopes: set[str] = set()
    content: dict[tuple, object] = {}           # region -> tag it holds
    filling: dict[tuple, Event] = {}            # region -> DMA writing it
    # Keyed by event seq (insertion-ordered): adding and retiring a copy is O(1), so the check
    # stays linear in the trace however many copies a spec puts in flight.
    dma_readers: dict[tuple, dict[int, Event]] = defaultdict(dict)   # region -> DMAs reading it
    in_flight: dict[tuple, deque[Event]] = defaultdict(deque)   # semaphore -> started DMAs
    hbm_flight: dict[tuple, dict[str, dict[int, Event]]] = defaultdict(
        lambda: {"read": {}, "write": {}})                       # HBM region -> DMAs on it

    def usable(buffer: str, e: Event) -> bool:
        if buffer and buffer in scoped and buffer not in open_scopes:
            report("E-SCOPE", f"{buffer} is used outside its scope", e,
                   hint="move the copy or its wait inside the `scoped` range, or widen the "
                        "range to cover it")
            return False
        return True

    for e in events:
        if e.op == "alloc":
            open_scopes.add(e.buffer)
        elif e.op == "free":
            for region, dma in list(filling.items()):
                if region[0] == e.buffer:
                    report("E-SCOPE", f"a copy into {e.buffer} is still in flight when its scope "
                           "ends", e, span=dma.span,
                           hint="wait for it before the end of the `scoped` range")
            for region, readers in dma_readers.items():
                if region[0] == e.buffer and readers:
                    report("E-SCOPE", f"a copy out of {e.buffer} is still in flight when its "
                           "scope ends", e, span=next(iter(readers.values())).span,
                           hint="wait for it before the end of the `scoped` range")
            open_scopes.discard(e.buffer)
        elif e.op == "start":
            if e.src is not None:
                src = (e.src[0], e.src[1])
                if usable(e.src[0], e):
                    if src in filling:
                        report("E-READ-BEFORE-WAIT", f"a copy reads {_region(*src)} while "
                               f"{_fmt(filling[src].tag)} is still arriving", e,
                               hint="wait for the load before starting the store")
                    elif content.get(src) != e.src[2]:
                        report("E-READ-BEFORE-WAIT", f"a copy reads {_region(*src)} expecting "
                               f"{_fmt(e.src[2])} but it holds {_fmt(content.get(src))}", e,
                               hint="start the store after the op that produces the data")
                    dma_readers[src][e.seq] = e
            if e.buffer and usable(e.buffer, e):
                dst = (e.buffer, e.slot)
                if dst in filling:
                    report("E-DMA-INFLIGHT", f"copy of {_fmt(e.tag)} into {_region(*dst)} "
                           f"starts while {_fmt(filling[dst].tag)} is still filling it", e,
                           hint="wait for the earlier copy first, or add slots so the stream "
                                "distance ('ahead') is at most the slot count")
                elif dma_readers.get(dst):
                    report("E-DMA-INFLIGHT", f"copy into {_region(*dst)} starts while a copy "
                           "out of it is still in flight", e,
                           hint="wait for the store before reloading the buffer")
                else:
                    old = content.get(dst)
                    if old is not None and last_read.get((dst[0], dst[1], old), -1) > e.seq:
                        report("E-DMA-INFLIGHT", f"copy of {_fmt(e.tag)} into {_region(*dst)} "
                               f"overwrites {_fmt(old)} before it is read", e,
                               hint="the slot is still being read: use 'ahead' no larger than "
                                    "the number of slots, or more slots")
                filling[dst] = e
            if e.hbm is not None:
                region, access = e.hbm
                flight = hbm_flight[region]
                clash = next(iter(flight["write"].values()),
                             next(iter(flight["read"].values()), None) if access == "write" else None)
                if clash is not None:
                    report("E-DMA-HBM", f"a copy {'into' if access == 'write' else 'out of'} "
                           f"HBM {_fmt_hbm(region)} starts while the copy started at "
                           f"{clash.where} (line {clash.span.line}) still "
                           f"{'writes' if clash.hbm[1] == 'write' else 'reads'} it", e,
                           hint="wait for the earlier copy first; two copies of one HBM region "
                                "in flight at once race")
                flight[access][e.seq] = e
            in_flight[e.sem].append(e)
        elif e.op == "wait":
            q = in_flight.get(e.sem)
            if not q:
                report("E-DMA-WAIT", f"wait on {e.sem[0]} with no copy in flight on its "
                       "semaphore (a double wait or a wait before the start): it would hang", e,
                       hint="wait for each copy exactly once, after it starts")
                continue
            dma = q.popleft()
            if dma.nbytes != e.nbytes:
                report("E-DMA-BYTES", f"wait for {e.nbytes} bytes on a semaphore signalled by a "
                       f"{dma.nbytes}-byte copy", e,
                       hint="the wait must describe a copy of the same size")
            if dma.buffer:
                region = (dma.buffer, dma.slot)
                if filling.get(region) is dma:
                    del filling[region]
                content[region] = dma.tag
            if dma.hbm is not None:
                del hbm_flight[dma.hbm[0]][dma.hbm[1]][dma.seq]
            if dma.src is not None:
                dma_readers[(dma.src[0], dma.src[1])].pop(dma.seq, None)
        elif e.op == "read":
            if not usable(e.buffer, e):
                continue
            region = (e.buffer, e.slot)
            if region in filling:
                report("E-READ-BEFORE-WAIT", f"{e.where} reads {_region(*region)} while the copy "
                       f"of {_fmt(filling[region].tag)} into it has not been waited", e,
                       span=filling[region].span,
                       hint="move the wait before this read")
            elif content.get(region) != e.tag:
                report("E-READ-BEFORE-WAIT", f"{e.where} reads {_region(*region)} expecting "
                       f"{_fmt(e.tag)} but it holds {_fmt(content.get(region))}", e,
                       hint="the copy that fills it is never started or waited in time")
        elif e.op == "write":
            if not usable(e.buffer, e):
                continue
            region = (e.buffer, e.slot)
            if region in filling:
                report("E-DMA-INFLIGHT", f"{e.where} writes {_region(*region)} while a copy "
                       "into it is in flight", e, span=filling[region].span,
                       hint="wait for the load before the op that updates the buffer")
            elif dma_readers.get(region):
                report("E-DMA-INFLIGHT", f"{e.where} overwrites {_region(*region)} while a copy "
                       "out of it is still in flight", e,
                       span=next(iter(dma_readers[region].values())).span,
                       hint="wait for the store before the buffer is written again")
            content[region] = e.tag
        elif e.op == "exit":
            for q in in_flight.values():
                for dma in q:
                    report("E-DMA-EXIT", f"a copy ({_fmt(dma.tag) if dma.buffer else 'store'}, "
                           f"started at {dma.where}) is still in flight at kernel exit", e,
                           span=dma.span, hint="add a wait for every copy before the step ends")
    return diags
