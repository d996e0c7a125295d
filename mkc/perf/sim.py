"""The step-time simulator: one TensorCore's decode step, replayed over the event trace.

Compute runs in program order on one timeline. Copies HBM<->VMEM go to the least-loaded of
the core's DMA queues (`dma_queues`, a chip constant; 0: the engine round-robins among every
copy in flight); each queue drains its copies in order, and the queues with a copy flowing
share the core's HBM bandwidth equally. Each copy first waits its issue cost (overlapping the
copies ahead of it), then moves its bytes plus a fixed per-copy overhead (so small copies are
less efficient). A wait stalls compute until its copy lands.

Ops cost a fixed overhead plus the work counted from the kernel mkc emits for them
(`mkc.perf.work`): vector and transcendental operations, and matmuls as the values they load
into the MXU or their FLOPs, whichever takes longer (at decode batch loading weights bounds
them). Work an op does per weight value it reads (the matmul of a ring tile, pooled matrix or
expert slot, with any in-kernel decode) is charged where the trace reads those weights, work
per KV tile where it reads a KV tile, the rest where the op begins.
Collectives are remote DMAs over ICI (or the on-chip sibling link) and block compute: a
round's copies, issued one after another, each its measured fixed cost and its bytes over the
links it shares (`Model.stage_seconds`). An overlapped one (`overlap`)
runs its rounds while compute goes on: a round's copies fly from its start, and compute waits
only where it lands a round before they have arrived; the collectives in flight at once do not
slow each other (their rounds are latency-bound at decode sizes; not modelled). Ranks are
symmetric, so one core (rank 0) stands for the step.

The result keeps a timeline of intervals per track (compute ops, stalls, collectives, DMA
copies) for exporters, and the time by layer kind and by cause.
"""
from __future__ import annotations

import bisect
import dataclasses
import math
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field

from mkc import ir, target
from mkc.perf.constants import Rates
from mkc.perf.work import KernelWork, OpWork, Work, kernel_work
from mkc.steps.collectives import OverlapPart, Round
from mkc.tags import ReadCost
from mkc.trace import (Alloc, Collective, CopyStart, CopyWait, EpilogueBegin, Event, EventHandlers,
                       Exit, Free, LayerBegin, OpBegin, Read, ViewClose, ViewOpen, Write)

CAUSES = ("weight streaming", "exposed compute", "stalls", "collectives", "prologue/epilogue")


@dataclass(frozen=True)
class Interval:
    track: str                   # "compute" | "dma" | "collective" | "stall"
    name: str
    start: float
    end: float
    layer: int = -1              # -1: prologue or epilogue
    kind: str = ""
    line: int = 0                # the spec line of the statement behind it (0: none)
    nbytes: int = 0              # dma: bytes moved
    issued: float = 0.0          # dma: when compute issued it (its bytes flow from `start`)
    queue: int = 0               # dma: the DMA queue that moved it


@dataclass(frozen=True)
class Mark:
    """A VMEM change at time t: the trace event of a scoped buffer allocated or freed, or of a
    pool view opened or closed (one of `mkc.trace.VMEM_CHANGES`)."""

    t: float
    event: Alloc | Free | ViewOpen | ViewClose
    layer: int = -1


@dataclass
class Stall:
    """Time compute waited on one copy semaphore family, summed over the step."""

    buffer: str
    line: int
    file: str
    kind: str
    seconds: float = 0.0
    count: int = 0
    where: str = ""              # the first place it stalled


@dataclass
class OpCost:
    """One op's modelled compute over the step, summed over its calls (layers)."""

    kind: str
    op: str
    calls: float = 0.0
    seconds: float = 0.0
    vector: float = 0.0              # counted VPU element operations charged
    transcendental: float = 0.0
    matrix_values: float = 0.0       # values loaded into the MXU
    weight_values: float = 0.0       # weight values read (priced per value)
    kv_tiles: float = 0.0            # KV tiles read (priced per tile)

    def charge(self, w: Work, times: float, seconds: float) -> None:
        self.vector += times * w.vector
        self.transcendental += times * w.transcendental
        self.matrix_values += times * w.matrix_values
        self.seconds += seconds


@dataclass
class Result:
    step_s: float
    by_cause: dict[str, float]
    by_kind: dict[str, dict[str, float]]          # layer kind -> cause -> seconds
    stalls: list[Stall]
    hbm_bytes: int
    hbm_busy_s: float
    copies: int
    timeline: list[Interval] = field(default_factory=list, repr=False)
    marks: list[Mark] = field(default_factory=list, repr=False)
    # Routed experts per MoE layer: the count this step ran (a simulated step), or, for an
    # expectation over routing (`mkc.perf.run.step_model`), the expected count and the
    # simulated steps it weighs (count, weight); `pictured` is the one whose timeline a picture
    # shows (the nearer count).
    experts: float | None = None
    parts: tuple[tuple[int, float], ...] = ()
    pictured: "Result | None" = field(default=None, repr=False)
    op_costs: dict[tuple[str, str], OpCost] = field(default_factory=dict)
    work: KernelWork | None = field(default=None, repr=False)

    def concrete(self) -> "Result":
        """The simulated step behind this result: itself, or the one a picture shows."""
        return self.pictured or self


def blend(parts: list[tuple[int, float, Result]], experts: float) -> Result:
    """The expectation of steps that differ only in the routed experts per layer: each figure
    weighted (times, bytes, stalls); the pictured step (timeline, its own figures) is the
    heaviest part."""
    first = parts[0][2]
    by_kind: dict[str, dict[str, float]] = {}
    for _, w, r in parts:
        for k, causes in r.by_kind.items():
            row = by_kind.setdefault(k, dict.fromkeys(CAUSES, 0.0))
            for c, v in causes.items():
                row[c] += w * v
    stalls: dict[tuple, Stall] = {}
    for _, w, r in parts:
        for st in r.stalls:
            key = (st.buffer, st.line, st.file, st.kind)
            acc = stalls.get(key)
            if acc is None:
                acc = stalls[key] = Stall(st.buffer, st.line, st.file, st.kind, where=st.where)
            acc.seconds += w * st.seconds
            acc.count += w * st.count
    for st in stalls.values():
        st.count = round(st.count)
    heaviest = max(parts, key=lambda p: (p[1], -p[0]))[2]
    op_costs: dict[tuple[str, str], OpCost] = {}
    for _, w, r in parts:
        for key, c in r.op_costs.items():
            acc = op_costs.setdefault(key, OpCost(*key))
            for f in dataclasses.fields(OpCost)[2:]:          # every figure after kind, op
                setattr(acc, f.name, getattr(acc, f.name) + w * getattr(c, f.name))
    return Result(
        step_s=sum(w * r.step_s for _, w, r in parts),
        by_cause={c: sum(w * r.by_cause[c] for _, w, r in parts) for c in first.by_cause},
        by_kind=by_kind,
        stalls=sorted(stalls.values(), key=lambda x: -x.seconds),
        hbm_bytes=round(sum(w * r.hbm_bytes for _, w, r in parts)),
        hbm_busy_s=sum(w * r.hbm_busy_s for _, w, r in parts),
        copies=round(sum(w * r.copies for _, w, r in parts)),
        experts=experts, parts=tuple((n, w) for n, w, _ in parts),
        pictured=heaviest, op_costs=op_costs, work=first.work)


class DmaEngine:
    """HBM<->VMEM copies of one core: `queues` DMA queues, each draining its copies in order,
    sharing the core's HBM bandwidth.

    A copy goes, when issued, to the least-loaded queue: the one with the fewest bytes still
    to move (ties: the lowest-numbered), as an idle DMA engine would take the next descriptor.
    Its bytes start to flow after its issue cost, and not before the copies ahead of it in its
    queue have landed. The queues whose head copy is flowing share the bandwidth equally (a
    fluid model: n copies flowing move at bandwidth / n each), so the engine moves bytes at
    the full bandwidth whenever any copy flows. With one queue this is a single in-order queue:
    many copies in flight take their total bytes / bandwidth, and a deeper prefetch never
    delays the copy needed next. With several, a small copy issued behind a large one on
    another queue no longer waits for it: the two share the bandwidth. With `queues` 0 the
    engine round-robins among every copy in flight (each its own queue): the more copies
    outstanding, the later each lands.

    The fluid state is advanced lazily, only as far as the simulator asks (a copy's landing,
    HBM busy time up to now): the simulator issues copies in time order, and nothing is issued
    while compute waits, so what lies ahead of a wait cannot change its landing."""

    def __init__(self, bandwidth: float, issue_s: float, overhead_bytes: float,
                 queues: int = 1) -> None:
        if queues < 0:
            raise ValueError(f"a core needs at least one DMA queue (0: one per copy in flight), "
                             f"not {queues}")
        self.bw, self.issue_s, self.overhead = bandwidth, issue_s, overhead_bytes
        self.round_robin = queues == 0
        queues = max(queues, 1)
        self.queues: list[deque] = [deque() for _ in range(queues)]
        self.queue_of: list[int] = []        # the queue each copy went to
        self.begins: list[float] = []        # when each copy's bytes start to flow
        self.ends: list[float] = []          # when it lands (inf until the fluid gets there)
        self._ready: list[float] = []        # issue time + issue cost
        self._left: list[float] = []         # bytes (with overhead) still to move
        self._load = [0.0] * queues          # bytes still to move per queue
        self.now = 0.0                       # how far the fluid state has been advanced
        self._bstart: list[float] = []       # intervals with bytes moving, merged
        self._bend: list[float] = []
        self._cum: list[float] = []          # busy time before each interval

    def issue(self, t: float, nbytes: float) -> int:
        """Start a copy at time t (not before what the engine has moved: the last issue, wait or
        busy query); returns its id."""
        if t < self.now * (1 - 1e-12) - 1e-18:
            raise ValueError(f"a copy issued at {t} s, before the engine's {self.now} s")
        cid = len(self.ends)
        size = nbytes + self.overhead
        if len(self.queues) == 1 and not self.round_robin:
            # One queue: the fluid has a closed form (a copy flows alone, at the bandwidth,
            # from its issue cost or the previous landing), so no state is kept pending.
            begin = max(t + self.issue_s, self.ends[-1] if self.ends else 0.0)
            end = begin + size / self.bw
            self.queue_of.append(0)
            self.begins.append(begin)
            self.ends.append(end)
            self._moving(begin, end)
            self.now = t
            return cid
        self._advance(t)
        if self.round_robin:
            q = next((i for i, waiting in enumerate(self.queues) if not waiting), None)
            if q is None:
                q = len(self.queues)
                self.queues.append(deque())
                self._load.append(0.0)
        else:
            q = min(range(len(self.queues)), key=lambda i: (self._load[i], i))
        self.queue_of.append(q)
        self.begins.append(math.inf)
        self.ends.append(math.inf)
        self._ready.append(t + self.issue_s)
        self._left.append(size)
        self._load[q] += size
        self.queues[q].append(cid)
        return cid

    def landing(self, cid: int) -> float:
        if self.ends[cid] == math.inf:
            self._advance(math.inf, until=cid)
        return self.ends[cid]

    def busy(self, t: float) -> float:
        """Time in [0, t] with bytes moving."""
        self._advance(t)
        i = bisect.bisect_right(self._bstart, t) - 1
        if i < 0:
            return 0.0
        return self._cum[i] + min(t, self._bend[i]) - self._bstart[i]

    def drain(self) -> None:
        """Land every copy (for the timeline: copies nobody waited for)."""
        self._advance(math.inf)

    @property
    def copies(self) -> int:
        return len(self.ends)

    def _moving(self, a: float, b: float) -> None:
        """Bytes move over [a, b]: extend the last busy interval or start one."""
        if self._bend and self._bend[-1] == a:
            self._bend[-1] = b
            return
        self._cum.append(self._cum[-1] + self._bend[-1] - self._bstart[-1] if self._bend
                         else 0.0)
        self._bstart.append(a)
        self._bend.append(b)

    def _advance(self, until_t: float, until: int | None = None) -> None:
        """Move the fluid to time `until_t`, or until copy `until` lands."""
        while self.now < until_t:
            heads = [q[0] for q in self.queues if q]
            if not heads:
                if until_t != math.inf:
                    self.now = until_t
                return
            flowing = [c for c in heads if self._ready[c] <= self.now]
            later = min((self._ready[c] for c in heads if self._ready[c] > self.now),
                        default=math.inf)
            if not flowing:
                self.now = min(later, until_t) if later != math.inf else until_t
                continue
            rate = self.bw / len(flowing)
            first = min(flowing, key=lambda c: self._left[c])
            finish = self._left[first] / rate
            dt = min(finish, later - self.now, until_t - self.now)
            for c in flowing:
                if self.begins[c] == math.inf:
                    self.begins[c] = self.now
            end = self.now + finish if dt == finish else self.now + dt
            self._moving(self.now, end)
            for c in flowing:
                q = self.queue_of[c]
                if dt == finish and (c == first or self._left[c] <= self._left[first]):
                    moved = self._left[c]
                    self._left[c] = 0.0
                    self.ends[c] = end
                    self.queues[q].popleft()
                else:
                    moved = rate * dt
                    self._left[c] -= moved
                self._load[q] = max(0.0, self._load[q] - moved)
            self.now = end
            if until is not None and self.ends[until] != math.inf:
                return


_BF16 = ir.MatrixFacts()


def merged_op(measure: dict | None, kind: str, op: str) -> bool:
    """Whether a whole-kernel measure has no row for the op because libtpu merged its code
    into its neighbours' rows: the rows add up to the whole kernel, so its cycles are in them
    and pricing it again would count them twice. Known when its layer kind has op rows (an
    op-level measure's missing op failed to compile alone: that one is counted)."""
    if not measure or "op_level" in measure or f"{kind}.{op}" in {r["key"] for r in
                                                                 measure["rows"]}:
        return False
    return any(r["group"] == "op" and r["kind"] == kind for r in measure["rows"])


@dataclass
class Model:
    """What the simulator reads besides the trace: the IR, the batch, cached tokens, rates, and
    the work counted from the emitted kernel at that batch (counted here if not given; a verify
    step's kernel with `verify_rows`)."""

    s: ir.ScheduleIR
    batch: int
    tokens: int
    rates: Rates
    rank: int = 0
    work: KernelWork | None = None
    verify_rows: int | None = None
    # A `mkc.perf.bundles` measure of this kernel: ops, copies and collectives priced by the
    # cycles libtpu scheduled for them (an op merged into its neighbours' rows is in theirs,
    # `merged_op`; others it lacks are counted, and listed in `counted_ops`).
    compiled: dict | None = None
    # The counted work of the kernel `compiled` measured, when that is another geometry of the
    # same spec (a tuner's candidate priced by its input's measure): a weight read is priced
    # at the measured op's cycles per weight value, so a bigger or smaller tile costs its
    # values. Default: this kernel's own work.
    compiled_work: KernelWork | None = None

    def __post_init__(self) -> None:
        if self.work is None:
            self.work = kernel_work(self.s, self.batch, self.verify_rows)
        self._prices: dict[tuple[str, str], tuple[float, Work, float, Work, float]] = {}
        self.counted_ops: set[tuple[str, str]] = set()
        self._per_read_s: dict[tuple[str, str], float] = {}
        self.rows = {r["key"]: r for r in (self.compiled or {}).get("rows", [])}
        self.collective_cycles: dict[tuple[str, int], float] = defaultdict(float)
        self.layer_cycles: dict[str, float] = defaultdict(float)     # per layer, not in an op
        self.step_cycles = 0.0                                       # per step, not in an op
        for r in self.rows.values():
            cycles = r["cycles"] + r["per_iteration"]
            if r["group"] == "collective":
                self.collective_cycles[r["kind"], r["spec_line"]] += cycles
            elif r["group"] == "op":
                continue
            elif r["name"] == "layer loop":
                for kind in set(self.s.layer_kinds):
                    self.layer_cycles[kind] += cycles
            elif r["kind"]:
                self.layer_cycles[r["kind"]] += cycles
            else:
                self.step_cycles += cycles
        dims = tuple(int(x) for x in self.s.topology.split("=")[1].split("x"))
        self.grid = dims
        self.cores_per_host = target.topology(self.s.chip, dims).cores_per_host
        self.chip_coords = target.rank_chip_coords(self.s.chip, dims)    # as libtpu lays them
        self.kv_buffers = {b.name: b for b in self.s.buffers if b.cls == "kv" and b.scope}

    # ---- op costs ------------------------------------------------------------------------
    def seconds(self, w: Work) -> float:
        """Counted work priced: VPU and EUP operations at their rates, each matmul class at the
        longer of loading its values into the MXU and its FLOPs."""
        r = self.rates
        t = w.vector / r.vpu_ops_per_s + w.transcendental / r.eup_ops_per_s
        for (dtype, rows), values in w.matrix.items():
            t += max(values / r.feed_values_per_s(dtype), 2 * rows * values / r.mxu_rate(dtype))
        return t

    def feed_seconds(self, w: Work) -> float:
        """The MXUs taking in `w`'s stationary values at their push rate
        (`Rates.feed_values_per_s`, measured on TPU7x): the least time its matmuls take whatever
        libtpu's static schedule says (it issues a weight push a bundle; the MXU takes it in
        over many cycles)."""
        r = self.rates
        return sum(v / r.feed_values_per_s(dtype) for (dtype, _), v in w.matrix.items())

    def op_prices(self, kind: str, op: str) -> tuple[float, Work, float, Work, float]:
        """(seconds where the op begins (with its fixed overhead), work per weight value,
        seconds per weight value, work per KV tile, seconds per KV tile). Compiled: the op's
        cycles outside its read loops where it begins, one iteration of its copy-waiting loop
        per weight read (`per_read`) and of its run-time loop per KV tile; the Work figures are
        then empty."""
        got = self._prices.get((kind, op))
        row = self.rows.get(f"{kind}.{op}")
        if got is None and row is not None:
            got = self._compiled_prices(row, (self.compiled_work or self.work).op(kind, op))
            self._prices[kind, op] = got
        if got is None and merged_op(self.compiled, kind, op):
            got = (0.0, Work(), 0.0, Work(), 0.0)
            self._prices[kind, op] = got
        if got is None:
            if self.compiled is not None:
                self.counted_ops.add((kind, op))
            ow: OpWork = self.work.op(kind, op)
            per_value = ow.per_weight_value()
            got = (self.rates.op_overhead_s + self.seconds(ow.at_op), per_value,
                   self.seconds(per_value), ow.kv_tile, self.seconds(ow.kv_tile))
            self._prices[kind, op] = got
        return got

    def _compiled_prices(self, row: dict, measured: OpWork) -> tuple:
        """An op's prices from its compiled row (see `op_prices`). A weight read costs its
        values at the row's cycles per weight value: its copy-waiting loops' cycles over the
        values a call reads, or, with none, its run-time loop's iteration (an expert) over the
        values one iteration reads (a loop of run-time length is counted once). Each part is
        never cheaper than pushing its matmuls' weights into the MXU (`feed_seconds`). Without
        counted weight values, a read costs one loop iteration whatever its size
        (`per_value` is then flagged by a zero-value Work and `read` charges it per read)."""
        c = self.rates.cycle_s
        per_read = row["read_cycles"] / row["reads"] if row["reads"] else row["per_iteration"]
        loop = row["read_cycles"] if row["reads"] else row["per_iteration"]
        values = measured.weight_values
        per_value_s = max(loop * c / values, self.feed_seconds(measured.per_weight_value())
                          ) if values else 0.0
        self._per_read_s[measured.kind, measured.op] = 0.0 if values else per_read * c
        return (max((row["cycles"] - row["read_cycles"]) * c, self.feed_seconds(measured.at_op)),
                Work(), per_value_s, Work(),
                max(row["per_iteration"] * c, self.feed_seconds(measured.kv_tile)))

    def per_read_seconds(self, kind: str, op: str) -> float:
        """A compiled op's price per weight read when it has no counted weight values (else 0:
        priced per value)."""
        return self._per_read_s.get((kind, op), 0.0)

    # ---- collectives ---------------------------------------------------------------------
    def stage_seconds(self, size: int, stride: int, nbytes: float) -> float:
        """One round over the group of `size` ranks `stride` apart that holds this rank: a
        remote copy of `nbytes` to every peer, issued one after another (the other chips' first,
        the sibling last, as the hand kernels do), each landing after its fixed cost and its
        bytes; the round ends when the last has landed. This core's copies to one chip share its
        link there (`ici_link_bytes_per_s`), and every rank runs the round at once (its own
        group's), so every core of this chip sends as many bytes across chips as this one:
        together at most `ici_chip_bytes_per_s`. A round inside a collective: the part of the
        copies' fixed cost a collective pays once (`collective_entry_s`) is not in it."""
        r = self.rates
        cpc = self.s.cores_per_chip
        base = self.rank - (self.rank // stride % size) * stride
        peers = [base + i * stride for i in range(size) if base + i * stride != self.rank]
        me = self.rank // cpc
        sib = [p for p in peers if p // cpc == me]
        far = [p for p in peers if p // cpc != me]
        t = 0.0
        if far:
            x0 = self.chip_coords[self.rank]
            hops = max(sum(abs(a - b) for a, b in zip(x0, self.chip_coords[p])) for p in far)
            per_chip = max(Counter(p // cpc for p in far).values())
            links = max(cpc * len(far) * nbytes / r.ici_chip_bytes_per_s,
                        per_chip * nbytes / r.ici_link_bytes_per_s,
                        (len(far) - 1) * r.remote_issue_s + nbytes / r.ici_link_bytes_per_s)
            t = r.ici_copy_s - r.collective_entry_s + max(0, hops - 1) * r.ici_hop_s + links
        if sib:
            t = max(t, len(far) * r.remote_issue_s + r.sibling_copy_s - r.collective_entry_s
                    + len(sib) * nbytes / r.sibling_bytes_per_s)
        return t

    def round_seconds(self, rd: Round, first: bool = False) -> float:
        """A round's sends and latency; the `first` of its collective pays the entry too."""
        return self.stage_seconds(rd.size, rd.stride, rd.nbytes) + (
            self.rates.collective_entry_s if first else 0.0)

    def sums_seconds(self, rd: Round, kind: str, line: int) -> float:
        """A round's sums as counted, where the measure has no row for the collective's line
        (else 0: its compiled cycles price them, `compiled_collective_seconds`)."""
        return 0.0 if (kind, line) in self.collective_cycles else rd.sums / self.rates.vpu_ops_per_s

    def compiled_collective_seconds(self, kind: str, line: int) -> float:
        return self.collective_cycles.get((kind, line), 0.0) * self.rates.cycle_s

    def collective_seconds(self, rounds: tuple[Round, ...], kind: str = "", line: int = 0
                           ) -> float:
        """A collective's rounds, one after another: each round's sends, then its sums: as
        compiled, the cycles of the collective's spec line in `kind`'s layers; counted where
        the measure has no row for that line."""
        compiled = self.collective_cycles.get((kind, line))
        total = self.rates.collective_entry_s if rounds else 0.0
        for rd in rounds:
            total += self.stage_seconds(rd.size, rd.stride, rd.nbytes)
            if compiled is None:
                total += rd.sums / self.rates.vpu_ops_per_s
        return total + (compiled or 0.0) * self.rates.cycle_s


def simulate(m: Model, events: list[Event], keep_timeline: bool = True) -> Result:
    replay = _Replay(m, keep_timeline)
    EventHandlers("the step-time simulator", {
        CopyStart: replay.start_copy, CopyWait: replay.wait_copy, Read: replay.read,
        OpBegin: replay.begin_op, Collective: replay.run_collective,
        LayerBegin: replay.begin_layer, EpilogueBegin: replay.begin_epilogue,
        Alloc: replay.mark, Free: replay.mark, ViewOpen: replay.mark, ViewClose: replay.mark,
        # an op's writes cost nothing of their own (its work is counted where it begins and
        # reads), and the kernel's exit is the step's end
        Write: None, Exit: None}).replay(events)
    return replay.result()


class _Replay:
    """The simulator's state as it replays a trace: the time compute has reached, the DMA
    engine, the copies each semaphore waits for, the op being charged, and the figures kept."""

    def __init__(self, m: Model, keep_timeline: bool) -> None:
        r = m.rates
        self.m, self.keep_timeline = m, keep_timeline
        self.eng = DmaEngine(r.hbm_stream_bytes_per_s, r.dma_issue_s,
                             r.dma_overhead_bytes, queues=int(r.dma_queues))
        self.sem_copies: dict[tuple, deque] = defaultdict(deque)
        self.copy_info: dict[int, tuple] = {}    # id -> (buffer, issued, where, line, bytes)
        self.copy_buf: dict[int, str] = {}
        self.t = r.step_fixed_s
        self.by_kind: dict[str, dict[str, float]] = defaultdict(lambda: dict.fromkeys(CAUSES, 0.0))
        self.by_kind["prologue"]["prologue/epilogue"] += r.step_fixed_s
        self.stalls: dict[tuple, Stall] = {}
        self.timeline: list[Interval] = []
        self.marks: list[Mark] = []
        self.hbm_bytes = 0
        self.layer, self.kind, self.op_name = -1, "prologue", ""
        self.op_costs: dict[tuple[str, str], OpCost] = {}
        self.current = OpCost("", "")
        self.per_value, self.per_value_s, self.kv_tile, self.kv_tile_s = Work(), 0.0, Work(), 0.0
        self.per_read_s = 0.0
        self.kv_bufs: dict[str, int] = defaultdict(int)      # layer kind -> its KV caches
        # (kind, op) -> an overlapped collective's rounds left and when the first lands
        self.in_flight: dict[tuple[str, str], tuple[deque, float]] = {}
        for b in m.kv_buffers.values():
            self.kv_bufs[b.scope[0]] += 1
        self.compute(m.step_cycles * r.cycle_s)              # the entry barrier, first copies

    def _in_tail(self) -> bool:
        return self.kind in ("prologue", "epilogue")

    def compute(self, dt: float) -> None:
        """Advance compute by dt, splitting it by whether HBM streams under it."""
        if dt <= 0:
            return
        t, kind, timeline = self.t, self.kind, self.timeline
        if self.keep_timeline:
            last = timeline[-1] if timeline else None
            if last is not None and last.track == "compute" and last.name == self.op_name \
                    and last.end == t and last.layer == self.layer:
                timeline[-1] = Interval("compute", self.op_name, last.start, t + dt, self.layer, kind)
            else:
                timeline.append(Interval("compute", self.op_name or kind, t, t + dt, self.layer, kind))
        hidden = min(self.eng.busy(t + dt) - self.eng.busy(t), dt)
        self.t = t + dt
        if self._in_tail():
            self.by_kind[kind]["prologue/epilogue"] += dt
            return
        self.by_kind[kind]["weight streaming"] += hidden
        self.by_kind[kind]["exposed compute"] += dt - hidden

    # ---- copies ----------------------------------------------------------------------------
    def start_copy(self, e: CopyStart) -> None:
        cid = self.eng.issue(self.t, e.nbytes)
        self.hbm_bytes += e.nbytes
        self.sem_copies[e.sem].append(cid)
        buf = e.buffer or (f"{e.src[0]} (store)" if e.src else "")
        self.copy_buf[cid] = buf
        if self.keep_timeline:
            self.copy_info[cid] = (buf, self.t, e.where, e.span.line, e.nbytes)

    def wait_copy(self, e: CopyWait) -> None:
        cid = self.sem_copies[e.sem].popleft()
        done = self.eng.landing(cid)
        if done > self.t:
            self._stall(e, self.copy_buf[cid], done)

    def _stall(self, e: CopyWait, buf: str, done: float) -> None:
        """Compute waits from now until `done` for a copy into (or out of) `buf`."""
        dt, kind = done - self.t, self.kind
        # every wait that blocked compute is a stall, the tail's too: one total everywhere
        # (the table's column, the stall list, the pictures' stall rows)
        self.by_kind[kind]["stalls"] += dt
        key = (buf, e.span.line, e.span.file, kind)
        st = self.stalls.get(key)
        if st is None:
            st = self.stalls[key] = Stall(buf, e.span.line, e.span.file, kind, where=e.where)
        st.seconds += dt
        st.count += 1
        if self.keep_timeline:
            self.timeline.append(Interval("stall", buf, self.t, done, self.layer, kind,
                                          line=e.span.line))
        self.t = done

    def mark(self, e: Alloc | Free | ViewOpen | ViewClose) -> None:
        if self.keep_timeline:
            self.marks.append(Mark(self.t, e, self.layer))

    # ---- compute ---------------------------------------------------------------------------
    def read(self, e: Read) -> None:
        """A read charges the current op's work per weight value or per KV tile it reads."""
        cost = e.tag.cost
        if cost is ReadCost.WEIGHTS:
            facts = self.m.s.matrix_facts
            values = sum(n * (facts.get(name) or _BF16).values_per_byte
                         for name, n in e.tag.weights(self.kind, e.nbytes))
            if values:
                self.current.weight_values += values
                dt = values * self.per_value_s + self.per_read_s
                self.current.charge(self.per_value, values, dt)
                self.compute(dt)
        elif cost is ReadCost.KV_TILE and self.kv_tile_s:
            share = 1.0 / self.kv_bufs[self.kind]    # the tile's work, over its caches' reads
            self.current.kv_tiles += share
            self.current.charge(self.kv_tile, share, share * self.kv_tile_s)
            self.compute(share * self.kv_tile_s)

    def begin_op(self, e: OpBegin) -> None:
        k, name = e.tag.kind, e.tag.op
        at_op_s, self.per_value, self.per_value_s, self.kv_tile, self.kv_tile_s = \
            self.m.op_prices(k, name)
        self.per_read_s = self.m.per_read_seconds(k, name)
        current = self.op_costs.get((k, name))
        if current is None:
            current = self.op_costs[k, name] = OpCost(k, name)
        self.current = current
        current.calls += 1
        current.charge(self.m.work.op(k, name).at_op, 1.0, at_op_s)
        self.op_name = str(e.tag)
        self.compute(at_op_s)

    def run_collective(self, e: Collective) -> None:
        if isinstance(e.tag, OverlapPart):
            self._overlapped(e)
            return
        dt = self.m.collective_seconds(e.tag.rounds(self.m.batch, self.m.s.cores_per_chip),
                                       self.kind, e.span.line)
        if self.keep_timeline:
            self.timeline.append(Interval("collective", str(e.tag), self.t, self.t + dt,
                                          self.layer, self.kind, line=e.span.line))
        self.t += dt
        self.by_kind[self.kind]["prologue/epilogue" if self._in_tail() else "collectives"] += dt

    def _overlapped(self, e: Collective) -> None:
        """A part of an overlapped collective: its start sends the first round; an advance
        lands the round in flight (compute waits for what has not arrived), sums it and sends
        the next, or leaves the last in flight; its finish lands the rest and runs its compiled
        instructions."""
        m, tag, line = self.m, e.tag, e.span.line
        key = (self.kind, tag.collective.op)
        if tag.part == "start":
            rounds = deque(tag.collective.rounds(m.batch, m.s.cores_per_chip))
            self.in_flight[key] = (rounds, self.t + m.round_seconds(rounds[0], first=True))
            return
        if tag.part == "advance" and len(self.in_flight[key][0]) == 1:
            # the last stage stays in flight until the finish (`InFlight.advance`): a kernel
            # narrower than the collective's widest form has fewer stages than advances
            return
        rounds, done = self.in_flight.pop(key)
        while True:
            self._collective_wait(str(tag), done, line)
            self._collective_compute(m.sums_seconds(rounds.popleft(), self.kind, line))
            if not rounds or tag.part == "advance":
                break
            done = self.t + m.round_seconds(rounds[0])
        if rounds:
            self.in_flight[key] = (rounds, self.t + m.round_seconds(rounds[0]))
        else:
            self._collective_compute(m.compiled_collective_seconds(self.kind, line))

    def _collective_wait(self, name: str, done: float, line: int) -> None:
        """Compute waits for an overlapped collective's round until `done`."""
        if done > self.t:
            if self.keep_timeline:
                self.timeline.append(Interval("collective", name, self.t, done, self.layer,
                                              self.kind, line=line))
            self.by_kind[self.kind]["collectives"] += done - self.t
            self.t = done

    def _collective_compute(self, dt: float) -> None:
        self.t += dt
        self.by_kind[self.kind]["collectives"] += dt

    def begin_layer(self, e: LayerBegin) -> None:
        self._enter(e.tag.kind, e.tag.layer)
        self.compute(self.m.layer_cycles.get(e.tag.kind, 0.0) * self.m.rates.cycle_s)

    def begin_epilogue(self, e: EpilogueBegin) -> None:
        self._enter("epilogue", -1)

    def _enter(self, kind: str, layer: int) -> None:
        self.op_name, self.current = "", OpCost("", "")
        self.kind, self.layer = kind, layer

    # ---- the result ------------------------------------------------------------------------
    def result(self) -> Result:
        hbm_busy_s = self.eng.busy(self.t)
        if self.keep_timeline:
            self.timeline += self._copy_intervals()
        by_cause = dict.fromkeys(CAUSES, 0.0)
        for causes in self.by_kind.values():
            for c, v in causes.items():
                by_cause[c] += v
        return Result(step_s=self.t, by_cause=by_cause,
                      by_kind={k: dict(v) for k, v in self.by_kind.items()},
                      stalls=sorted(self.stalls.values(), key=lambda x: -x.seconds),
                      hbm_bytes=self.hbm_bytes, hbm_busy_s=hbm_busy_s, copies=self.eng.copies,
                      timeline=self.timeline, marks=self.marks, op_costs=self.op_costs,
                      work=self.m.work)

    def _copy_intervals(self) -> list[Interval]:
        """Every copy's interval on its DMA queue, once the engine has landed them all."""
        eng = self.eng
        eng.drain()
        return [Interval("dma", buf, eng.begins[cid], eng.ends[cid], -1, where, line=line,
                         nbytes=nbytes, issued=issued, queue=eng.queue_of[cid])
                for cid, (buf, issued, where, line, nbytes) in self.copy_info.items()]
