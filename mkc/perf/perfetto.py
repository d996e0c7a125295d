"""Export a modelled step as a Chrome/Perfetto trace-event file (`mkc perf SPEC --trace F`).

It reads only the simulator's result (its timeline of intervals and VMEM marks) and the
schedule IR (buffer classes and sizes, the spec's file). One process stands for the modelled
rank; its threads are the engines: the layer loop, compute ops, stalls (waits that blocked
compute), collectives, and the DMA queue split by the class of the buffer each copy fills.
Counters carry the VMEM bytes live by buffer class (the resident buffers, scoped buffers as
the trace allocates and frees them, each pool split into its open view and the rest) and
their total, whose maximum is the checker's VMEM peak at that batch.

Times are modelled; the process name says how far the chip's constants are validated, and
otherData gives the whole validation note. Output is deterministic: same spec, batch and context, same bytes.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mkc import ir
from mkc.perf.sim import Result
from mkc.trace import VMEM_CHANGES, Alloc, EventHandlers, Free, ViewClose, ViewOpen

PID = 1
# thread id, name, in display order
T_LAYERS, T_COMPUTE, T_STALL, T_COLLECTIVE = 1, 2, 3, 4
T_DMA0 = 10
_TRACK_TID = {"compute": T_COMPUTE, "stall": T_STALL, "collective": T_COLLECTIVE}
VMEM_COUNTER = "VMEM live by class (bytes)"
VMEM_TOTAL = "VMEM live total (bytes)"


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def _us(seconds: float) -> float:
    """Seconds to trace microseconds on a whole nanosecond, so the text is stable and slices
    that follow each other on a track never overlap after rounding."""
    return _ns(seconds) / 1000


def _dur(start: float, end: float) -> float:
    return (_ns(end) - _ns(start)) / 1000


def buffer_class(s: ir.ScheduleIR, name: str) -> str:
    """The VMEM class of a buffer or pool view ("P.V"), as the VMEM counters name it: a view's
    is "pool P.V"; "other" for a name the schedule does not hold."""
    classes = {b.name: b.cls for b in s.buffers}
    classes |= {f"{p.name}.{v.name}": f"pool {p.name}.{v.name}" for p in s.pools for v in p.views}
    return classes.get(name, "other")


def dma_class(s: ir.ScheduleIR, name: str) -> str:
    """The buffer class a copy's destination belongs to (a store is its source's class)."""
    if name.endswith(" (store)"):
        return f"{buffer_class(s, name[: -len(' (store)')])} store"
    return buffer_class(s, name)


@dataclass
class VmemSeries:
    """VMEM bytes live per class over the step: `times[i]` -> `rows[i]` (class -> bytes),
    one row per change, in trace order (several rows may share a time)."""

    classes: list[str]
    times: list[float]
    rows: list[dict[str, int]]
    budget: int                  # what the checker lets the peak reach (usable - reserve)
    limit: int                   # usable VMEM: the spec's limit within what XLA gives

    def totals(self) -> list[int]:
        return [sum(r.values()) for r in self.rows]


def vmem_series(s: ir.ScheduleIR, res: Result, batch: int) -> VmemSeries:
    """What the checker counts (`mkc.checks.capacity.vmem_budget`): its resident set (scratch
    buffers, VMEM inputs and outputs, modelled compiler scratch) all step, and scoped buffers
    between their alloc and free marks. A pool counts as its open view(s) plus the rest of its
    region ("pool free"), so its total stays the pool's size."""
    from mkc.checks.capacity import usable_vmem_bytes, vmem_budget, vmem_budget_bytes
    bufs = {b.name: b.at_batch(batch) for b in s.buffers}
    _, _, resident = vmem_budget(s, [], batch)
    pools = {p.name: p for p in s.pools}
    view_bytes = {f"{p.name}.{v.name}": v.nbytes for p in s.pools for v in p.views}
    base: dict[str, int] = {}
    for b in resident:
        if b.name not in pools:
            base[b.cls] = base.get(b.cls, 0) + b.vmem_bytes
    pool_bytes = {b.name: b.vmem_bytes for b in resident if b.name in pools}
    classes = sorted(base)
    for name in sorted(pool_bytes):
        classes += [f"pool {name}.{v.name}" for v in pools[name].views] + [f"pool {name} free"]
    for b in bufs.values():
        if b.scope is not None and b.cls not in classes:
            classes.append(b.cls)
    live: dict[str, int] = {}            # scoped buffer -> bytes
    opened: dict[str, int] = {}          # view id -> open count

    def row() -> dict[str, int]:
        r = dict.fromkeys(classes, 0) | base
        for name, nb in live.items():
            r[bufs[name].cls] += nb
        for pname, size in pool_bytes.items():
            used = 0
            for v in pools[pname].views:
                vid = f"{pname}.{v.name}"
                if opened.get(vid, 0) > 0:
                    nb = min(view_bytes[vid], size - used)
                    r[f"pool {vid}"] += nb
                    used += nb
            r[f"pool {pname} free"] += size - used
        return r

    def allocated(e: Alloc) -> None:
        live[e.buffer] = bufs[e.buffer].vmem_bytes

    def freed(e: Free) -> None:
        live.pop(e.buffer, None)

    def view_opens(e: ViewOpen) -> None:
        opened[e.view] = opened.get(e.view, 0) + 1

    def view_closes(e: ViewClose) -> None:
        opened[e.view] = max(0, opened.get(e.view, 0) - 1)

    changes = EventHandlers("the Perfetto VMEM counters", {
        Alloc: allocated, Free: freed, ViewOpen: view_opens, ViewClose: view_closes},
        covers=VMEM_CHANGES)
    times, rows = [0.0], [row()]
    for m in res.marks:
        changes.handler(m.event)(m.event)
        r = row()
        if r != rows[-1]:
            times.append(m.t)
            rows.append(r)
    times.append(res.step_s)
    rows.append(rows[-1])
    return VmemSeries(classes, times, rows, vmem_budget_bytes(s), usable_vmem_bytes(s))


def _phase_lines(s: ir.ScheduleIR) -> dict[str, int]:
    """The spec line of each `phase KIND` (compute ops of a kind point there)."""
    try:
        from mkc.lang.parser import parse_file
        sched, _ = parse_file(s.source)
    except Exception:                   # a spec that moved since the check: no lines
        return {}
    return {ph.kind.text: ph.span.line for ph in sched.phases}


def _tracks(s: ir.ScheduleIR, res: Result, batch: int, tokens: int
            ) -> tuple[list[dict], dict[tuple[int, str], int]]:
    """The trace's metadata events (the process, named with the caveat, and its tracks) and
    the track of each DMA queue and class."""
    from mkc.perf.run import validation_caveat
    ev: list[dict] = []

    def meta(tid: int, name: str, sort: int) -> None:
        ev.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_name",
                   "args": {"name": name}})
        ev.append({"ph": "M", "pid": PID, "tid": tid, "name": "thread_sort_index",
                   "args": {"sort_index": sort}})

    # the process is the trace's first and outermost track: its name carries the caveat
    ev.append({"ph": "M", "pid": PID, "tid": 0, "name": "process_name",
               "args": {"name": f"{s.name} rank 0, batch {batch}, {tokens} cached tokens "
                                f"(modelled, not measured; {validation_caveat(s.chip)})"}})
    meta(T_LAYERS, "layers", 0)
    meta(T_COMPUTE, "compute (ops)", 1)
    meta(T_STALL, "stalls (waits that blocked compute)", 2)
    meta(T_COLLECTIVE, "collectives (ICI)", 3)
    # One track per DMA queue and class: a queue moves its copies in order, so the slices of a
    # track never overlap (copies on different queues do, sharing the bandwidth).
    dma_keys = sorted({(iv.queue, dma_class(s, iv.name)) for iv in res.timeline
                       if iv.track == "dma"})
    queues = len({q for q, _ in dma_keys})
    dma_tid = {key: T_DMA0 + i for i, key in enumerate(dma_keys)}
    for (q, c), tid in dma_tid.items():
        meta(tid, f"DMA queue {q}: {c}" if queues > 1 else f"DMA queue: {c}", 10 + tid)
    return ev, dma_tid


def trace_events(s: ir.ScheduleIR, res: Result, batch: int, tokens: int) -> dict:
    """The trace-event document of one modelled step (see the module docstring). An expectation
    over routing (`step_model`'s blend of two whole expert counts) is drawn as the simulated
    step it holds for pictures (`Result.concrete()`); otherData gives both."""
    expected = res
    res = res.concrete()
    spec = s.source
    phase = _phase_lines(s)
    from mkc.perf.run import stall_seconds, validation_note
    ev, dma_tid = _tracks(s, res, batch, tokens)

    def where(line: int) -> str:
        return f"{spec}:{line}" if line else ""

    layers: dict[int, list] = {}
    for iv in res.timeline:
        if iv.track == "dma":
            args = {"bytes": iv.nbytes, "issued_us": _us(iv.issued), "at": iv.kind,
                    "spec": where(iv.line), "queue": iv.queue}
            ev.append({"ph": "X", "pid": PID, "tid": dma_tid[(iv.queue, dma_class(s, iv.name))],
                       "name": iv.name, "cat": "dma", "ts": _us(iv.start),
                       "dur": _dur(iv.start, iv.end), "args": args})
            continue
        line = iv.line or phase.get(iv.kind, 0)
        args = {"layer": iv.layer, "kind": iv.kind, "spec": where(line)}
        ev.append({"ph": "X", "pid": PID, "tid": _TRACK_TID[iv.track], "name": iv.name,
                   "cat": iv.track, "ts": _us(iv.start), "dur": _dur(iv.start, iv.end),
                   "args": args})
        if iv.layer >= 0:
            span = layers.setdefault(iv.layer, [iv.start, iv.end, iv.kind])
            span[0], span[1] = min(span[0], iv.start), max(span[1], iv.end)
    for layer in sorted(layers):
        a, b, kind = layers[layer]
        ev.append({"ph": "X", "pid": PID, "tid": T_LAYERS, "name": f"{layer} {kind}",
                   "cat": "layer", "ts": _us(a), "dur": _dur(a, b),
                   "args": {"layer": layer, "kind": kind, "spec": where(phase.get(kind, 0))}})

    vs = vmem_series(s, res, batch)
    for t, row, total in zip(vs.times, vs.rows, vs.totals()):
        ev.append({"ph": "C", "pid": PID, "tid": 0, "name": VMEM_COUNTER, "ts": _us(t),
                   "args": dict(row)})
        ev.append({"ph": "C", "pid": PID, "tid": 0, "name": VMEM_TOTAL, "ts": _us(t),
                   "args": {"live": total, "budget": vs.budget}})
    return {
        "traceEvents": ev,
        "displayTimeUnit": "ns",
        "otherData": {"modelled": "times are modelled by mkc perf, not measured",
                      "validation": validation_note(s.chip),
                      "schedule": s.name, "spec": spec, "model": s.model,
                      "topology": s.topology, "batch": batch, "tokens_in_cache": tokens,
                      "step_us": _us(res.step_s), "vmem_budget_bytes": vs.budget,
                      # `mkc perf`'s stall total (`stall_seconds`): the stall track's slices
                      # add up to the first; the text gives the second
                      "stall_us": _us(stall_seconds(res)),
                      "expected_stall_us": _us(stall_seconds(expected)),
                      "routed_experts_per_layer": res.experts,
                      "expected_step_us": _us(expected.step_s),
                      "expected_routed_experts_per_layer": expected.experts,
                      "vmem_usable_bytes": vs.limit},
    }


def write_trace(path: str | Path, s: ir.ScheduleIR, res: Result, batch: int, tokens: int
                ) -> dict:
    doc = trace_events(s, res, batch, tokens)
    text = json.dumps(doc, separators=(",", ":"), sort_keys=True)
    from mkc.files import write_atomically
    write_atomically(Path(path), text + "\n")
    return doc
