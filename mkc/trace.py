"""Unroll the schedule IR into the event trace of one decode step, in program order.

The trace covers the prologue, every layer (so every layer-kind transition), and the
epilogue. Each DMA carries the content tag it delivers and each read the tag it expects,
so checks can tell a stale or clobbered slot from a fresh one. Codegen emits the same
structure (same points, same slot arithmetic); this module is its executable model.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from mkc import ir
from mkc.diagnostics import Span
from mkc.program import layer_program
from mkc.steps import AllReduce, Step
from mkc.tags import (Content, KvTile, LayerBegins, LayerMatrix, LayerVectors, LayerState, OpBegins,
                      RingTile, RoutedExpert, ViewLayer, WholeBuffer)


@dataclass(frozen=True, slots=True)
class Event:
    """One event of the trace: its place in it (`seq`), where in the step it happens as
    diagnostics say it, and the statement behind it. One subclass per kind of event; a consumer
    dispatches on the type through an `EventHandlers` table, which refuses a type it does not
    know."""

    seq: int
    where: str
    span: Span


@dataclass(frozen=True, slots=True)
class Alloc(Event):
    """A scoped buffer's range opens: the buffer is live (and usable) until its `Free`."""

    buffer: str


@dataclass(frozen=True, slots=True)
class Free(Event):
    buffer: str


@dataclass(frozen=True, slots=True)
class CopyStart(Event):
    """A DMA starts: into VMEM `buffer` (slot `slot`), or out of VMEM (`src`) into HBM state,
    signalling `sem` with `nbytes` when it lands."""

    buffer: str                # VMEM destination ("" for a copy into HBM)
    slot: object               # the destination's slot (None: a buffer of one slot)
    sem: tuple
    nbytes: int
    tag: Content | None        # the content it delivers (None: a store)
    src: tuple | None = None   # a copy out of VMEM: (buffer, slot, the content it expects)
    hbm: tuple | None = None   # a copy of HBM state: (StateRegion, "read" | "write")


@dataclass(frozen=True, slots=True)
class CopyWait(Event):
    """Compute waits for the oldest copy on `sem`, for `nbytes`."""

    sem: tuple
    nbytes: int


@dataclass(frozen=True, slots=True)
class Read(Event):
    """Compute reads a VMEM region expecting `tag`; `nbytes` of weights for the step-time
    model (0 in the checks' trace)."""

    buffer: str
    slot: object
    tag: Content
    nbytes: int = 0


@dataclass(frozen=True, slots=True)
class Write(Event):
    """Compute writes `tag` into a VMEM region."""

    buffer: str
    slot: object
    tag: Content


@dataclass(frozen=True, slots=True)
class ViewOpen(Event):
    """A pool view ("pool.view") becomes live for a layer: its first copy in."""

    view: str
    tag: ViewLayer


@dataclass(frozen=True, slots=True)
class ViewClose(Event):
    """A pool view becomes dead: the last op reading it ends."""

    view: str
    tag: ViewLayer


@dataclass(frozen=True, slots=True)
class OpBegin(Event):
    """(Step-time model only) a graph op begins."""

    tag: OpBegins


@dataclass(frozen=True, slots=True)
class Collective(Event):
    """(Step-time model only) a collective runs; its step prices it (`mkc.steps.collectives`)."""

    tag: Step


@dataclass(frozen=True, slots=True)
class LayerBegin(Event):
    """(Step-time model only) an iteration of the layer loop begins."""

    tag: LayerBegins


@dataclass(frozen=True, slots=True)
class EpilogueBegin(Event):
    """(Step-time model only) the layer loop has ended."""


@dataclass(frozen=True, slots=True)
class Exit(Event):
    """The kernel exits: nothing may be in flight."""


EVENT_TYPES: tuple[type[Event], ...] = (Alloc, Free, CopyStart, CopyWait, Read, Write, ViewOpen,
                                        ViewClose, OpBegin, Collective, LayerBegin, EpilogueBegin,
                                        Exit)
VMEM_CHANGES: tuple[type[Event], ...] = (Alloc, Free, ViewOpen, ViewClose)


class UnknownEventError(TypeError):
    """A consumer of the trace met an event type it has no entry for: a compiler bug (an event
    kind added without teaching every consumer), never a spec's."""


EventHandler = Callable[[Any], None]


class EventHandlers:
    """A consumer's dispatch over trace events, keyed by event type (as Pallas keys lowering
    rules by primitive): every type the consumer may meet (`covers`, by default every event
    type) maps to its handler, or to None for one it passes over on purpose. A table missing
    one of them is refused when built, and an event of a type outside it when met, naming the
    consumer and the type, so no event is dropped silently."""

    def __init__(self, consumer: str, handlers: dict[type[Event], EventHandler | None],
                 covers: tuple[type[Event], ...] = EVENT_TYPES) -> None:
        missing = [t.__name__ for t in covers if t not in handlers]
        if missing:
            raise UnknownEventError(f"{consumer} has no entry for trace event types "
                                    f"{', '.join(missing)}: give each a handler, or None to pass "
                                    "over it")
        self.consumer = consumer
        self._table = dict(handlers)

    def handler(self, e: Event) -> EventHandler | None:
        """The handler of `e`'s type (None: passed over); UnknownEventError for a type the
        table does not hold."""
        try:
            return self._table[type(e)]
        except KeyError:
            raise self._unknown(e) from None

    def replay(self, events: Iterable[Event]) -> None:
        """Hand each event to its handler, in order."""
        table = self._table
        for e in events:
            handle = table.get(type(e), _UNKNOWN)
            if handle is None:
                continue
            if handle is _UNKNOWN:
                raise self._unknown(e)
            handle(e)

    def _unknown(self, e: object) -> UnknownEventError:
        return UnknownEventError(f"{self.consumer} does not handle trace event type "
                                 f"{type(e).__name__} (event {getattr(e, 'seq', '?')}): add it to "
                                 "its table")


_UNKNOWN: Any = object()          # what `EventHandlers.replay` finds for a type not in the table


@dataclass(frozen=True)
class TraceOptions:
    """How `build_trace` unrolls a step for the step-time model (`mkc.perf`). The defaults give
    exactly the trace the checks read; every option only adds events or resizes copies."""

    batch: int | None = None       # size state and KV copies at this batch (None: the largest)
    sequences: int | None = None   # KV tiles hold this many sequences (a verify step's rows
                                   # are fewer sequences; None: one per row)
    experts: int | None = None     # routed experts each MoE layer runs (None: the worst case)
    kv_tokens: int | None = None   # unroll the whole KV stream over this many cached tokens
    compute: bool = False          # add `OpBegin`, `Collective`, `LayerBegin` and
                                   # `EpilogueBegin` events, bytes on weight reads
    whole_runs: bool = False       # unroll every ring tile and routed expert (the checks read
                                   # a whole period of each run: `periodic_tiles_traced`)


class TraceBuilder:
    def __init__(self) -> None:
        self.events: list[Event] = []

    def alloc(self, buffer: str, where: str, span: Span) -> None:
        self.events.append(Alloc(len(self.events), where, span, buffer))

    def free(self, buffer: str, where: str, span: Span) -> None:
        self.events.append(Free(len(self.events), where, span, buffer))

    def start(self, *, dst: str, slot: object, sem: tuple, nbytes: int, tag: Content | None,
              where: str, span: Span, src: tuple | None = None, hbm: tuple | None = None
              ) -> None:
        self.events.append(CopyStart(len(self.events), where, span, dst, slot, sem, nbytes, tag,
                                     src, hbm))

    def wait(self, *, sem: tuple, nbytes: int, where: str, span: Span) -> None:
        self.events.append(CopyWait(len(self.events), where, span, sem, nbytes))

    def read(self, buffer: str, slot: object, tag: Content, where: str, span: Span,
             nbytes: int = 0) -> None:
        self.events.append(Read(len(self.events), where, span, buffer, slot, tag, nbytes))

    def write(self, buffer: str, slot: object, tag: Content, where: str, span: Span) -> None:
        self.events.append(Write(len(self.events), where, span, buffer, slot, tag))

    def open_view(self, view_id: str, layer: int, label: str, where: str, span: Span) -> None:
        """A pool view becoming live for a layer."""
        self.events.append(ViewOpen(len(self.events), where, span, view_id, ViewLayer(layer, label)))

    def close_view(self, view_id: str, layer: int, label: str, where: str, span: Span) -> None:
        self.events.append(ViewClose(len(self.events), where, span, view_id, ViewLayer(layer, label)))

    def begin_op(self, tag: OpBegins, where: str, span: Span) -> None:
        self.events.append(OpBegin(len(self.events), where, span, tag))

    def collective(self, step: Step, where: str, span: Span) -> None:
        self.events.append(Collective(len(self.events), where, span, step))

    def begin_layer(self, tag: LayerBegins, where: str, span: Span) -> None:
        self.events.append(LayerBegin(len(self.events), where, span, tag))

    def begin_epilogue(self, where: str, span: Span) -> None:
        self.events.append(EpilogueBegin(len(self.events), where, span))

    def exit(self, where: str, span: Span) -> None:
        self.events.append(Exit(len(self.events), where, span))


def layer_label(s: ir.ScheduleIR, layer: int) -> str:
    """How diagnostics name an iteration of the layer loop: a model layer, or one of its
    sublayers when the loop runs attention and MLP as separate iterations (K3)."""
    per_layer = len(s.layer_kinds) // s.dims["num_hidden_layers"]
    if per_layer == 1:
        return f"layer {layer} ({s.layer_kinds[layer]})"
    return f"layer {layer // per_layer} {s.layer_kinds[layer]}"


class StepTracer:
    """One decode step's trace under construction: the stream, vector, pool-view, expert and
    KV mechanisms' events, which the steps of every layer (`mkc.steps`) and the prologue and
    epilogue call."""

    def __init__(self, s: ir.ScheduleIR, opts: TraceOptions) -> None:
        self.s, self.opts, self.tb = s, opts, TraceBuilder()
        st = s.stream
        # The ring stream as traced: each family's run shortened by whole periods of slots, so
        # the trace's size does not grow with smaller tiles (same residues, same hazards).
        self.tile_bytes: list[int] = []
        self.tile_tags: list[tuple[str | None, int]] = []     # RingTile's matrix, scale bytes
        self.layer_tile_offset: list[int] = []
        for kname in s.layer_kinds:
            self.layer_tile_offset.append(len(self.tile_bytes))
            for f in st.families[kname]:
                self._add_run(f)
        self.tail_tile_offset = len(self.tile_bytes)
        for f in st.tail:
            self._add_run(f)
        self.total_tiles = len(self.tile_bytes)
        self.vec_bytes = s.parity.rows * s.parity.cols * 4
        self.views = {f"{p.name}.{v.name}": v for p in s.pools for v in p.views}
        # Worst case for routed experts: every row picks top_k experts of this rank's group.
        local = s.per_rank.get("local_experts", 0)
        self.expert_count = min(s.top_k * s.rows_max if opts.experts is None else opts.experts, local)
        self.rows = opts.batch or s.rows_max     # the traced kernel's rows

    def _add_run(self, f: ir.StreamFamily) -> None:
        """A family's run of tiles as traced: each tile's bytes (a column block's last row tile
        of 8-bit codes carries its scale rows) and, for codes, what a read of it is."""
        for k in run_indices(f.tiles, self.traced(f.tiles), self.s.stream):
            self.tile_bytes.append(f.bytes_of(k))
            scale = f.bytes_of(k) - f.tile_bytes
            self.tile_tags.append((None, 0) if f.codes == "bf16" else (f"{f.kind}.{f.name}", scale))

    def ring_tile(self, t: int) -> RingTile:
        matrix, scale = self.tile_tags[t]
        return RingTile(t) if matrix is None else RingTile(t, matrix, scale)

    def sized(self, b: ir.Buffer) -> int:
        return _nbytes(b.at_batch(self.opts.batch) if self.opts.batch else b)

    def op_event(self, kind: str, op: str, layer: int, where: str) -> None:
        if self.opts.compute:
            self.tb.begin_op(OpBegins(kind, op, layer), where, Span.unknown(self.s.source))

    def collective_event(self, step: Step, where: str) -> None:
        """A collective step (`mkc.steps.collectives`) runs: its tag, which prices it."""
        if self.opts.compute:
            self.tb.collective(step, where, step.entry.span)

    def traced(self, tiles: int) -> int:
        """Tiles of one family's run the trace unrolls (all of them for the step-time model)."""
        st = self.s.stream
        return tiles if self.opts.whole_runs else periodic_tiles_traced(tiles, st.slots, st.ahead)

    # ---- the ring stream and the parity vectors ----------------------------------------------
    def start_tile(self, t: int, where: str) -> None:
        st = self.s.stream
        if t < self.total_tiles:
            self.tb.start(dst=st.ring, slot=t % st.slots, sem=("ring", t % st.slots),
                          nbytes=self.tile_bytes[t], tag=self.ring_tile(t), where=where,
                          span=st.span)

    def consume_tiles(self, family: ir.StreamFamily, first: int, where: str,
                      held: list[int] | None = None, hold_from: int = 0) -> int:
        """Consume the family's run of tiles from `first`; returns the next tile. Each tile's
        refill starts as it is consumed or, for tiles from `hold_from` on, joins `held`
        (`refill`: started later)."""
        st, tb = self.s.stream, self.tb
        for t in range(first, first + self.traced(family.tiles)):
            # The consumer waits for its own family's tile size.
            tb.wait(sem=("ring", t % st.slots), nbytes=self.tile_bytes[t], where=where, span=st.span)
            tb.read(st.ring, t % st.slots, self.ring_tile(t), where, st.span,
                    self.tile_bytes[t] if self.opts.compute else 0)
            if held is None or t < hold_from:
                self.start_tile(t + st.ahead, where)
            elif t + st.ahead < self.total_tiles:
                held.append(t + st.ahead)
        return first + self.traced(family.tiles)

    def start_vectors(self, layer: int, where: str) -> None:
        self.tb.start(dst="vectors", slot=layer % 2, sem=("vectors", layer % 2),
                      nbytes=self.vec_bytes, tag=LayerVectors(layer), where=where,
                      span=self.s.parity.span)

    # ---- pool views ----------------------------------------------------------------------
    def pooled_bytes(self, view_id: str, kname: str, fam: str) -> int:
        return next(m.nbytes for m in self.views[view_id].matrices[kname] if m.name == fam)

    def open_view(self, view_id: str, layer: int, where: str, span: Span) -> None:
        """`span` is the statement whose copy opens the view: a pool overlap points there."""
        self.tb.open_view(view_id, layer, layer_label(self.s, layer), where, span)

    def start_weights(self, view_id: str, layer: int, where: str, span: Span) -> None:
        """Copy layer `layer`'s matrices of this weight view (if its kind has any)."""
        mats = self.views[view_id].matrices.get(self.s.layer_kinds[layer], [])
        if not mats:
            return
        self.open_view(view_id, layer, where, span)
        for m in mats:
            self.tb.start(dst=view_id, slot=m.name, sem=(view_id, m.name), nbytes=m.nbytes,
                          tag=LayerMatrix(layer, m.name), where=where, span=span)

    def routed_expert(self, view_id: str, layer: int, k: int) -> RoutedExpert:
        """What selected expert k's slot holds: each of its matrices with its bytes."""
        return RoutedExpert(layer, k, tuple((m.name, m.nbytes)
                                            for m in self.views[view_id].matrices["expert"]))

    def start_expert(self, view_id: str, layer: int, k: int, where: str, span: Span) -> None:
        """Selected expert k's one copy: its slot's image, all its matrices, into slot k % slots
        (`mkc.runtime.experts`)."""
        v = self.views[view_id]
        self.tb.start(dst=view_id, slot=k % v.slots, sem=(view_id, k % v.slots),
                      nbytes=v.slot_bytes, tag=self.routed_expert(view_id, layer, k), where=where,
                      span=span)

    def run_experts(self, view_id: str, layer: int, where: str, span: Span) -> None:
        v, tb = self.views[view_id], self.tb
        # Expert k is fetched `slots` ahead into slot k % slots: as periodic as a ring's tiles.
        count = (self.expert_count if self.opts.whole_runs
                 else periodic_tiles_traced(self.expert_count, v.slots, v.slots))
        for k in range(count):
            tb.wait(sem=(view_id, k % v.slots), nbytes=v.slot_bytes, where=where, span=span)
            tb.read(view_id, k % v.slots, self.routed_expert(view_id, layer, k), where, span,
                    v.slot_bytes if self.opts.compute else 0)
            if k + v.slots < count:
                self.start_expert(view_id, layer, k + v.slots, where, span)

    # ---- KV tiles ------------------------------------------------------------------------
    def _kv_tiles(self, k: ir.KindSchedule) -> tuple[list[ir.Buffer], dict[str, int], int]:
        """The kind's KV tile buffers (sized as traced), each one's bytes a tile, and the
        tiles the trace streams."""
        s, opts, kv = self.s, self.opts, k.kv
        bufs = [b for b in s.buffers if b.cls == "kv" and b.name in kv.tile_buffers]
        # the cache's tiles: the context's, or a window's KV ring's (all of it once wrapped)
        tiles = kv.cache_tokens(s.context) // kv.tokens
        if opts.kv_tokens is None:
            n_tiles = periodic_tiles_traced(tiles, kv.slots, kv.ahead)
        else:
            n_tiles = min(-(-opts.kv_tokens // kv.tokens), tiles)
        if opts.sequences or opts.batch:
            bufs = [b.at_batch(opts.sequences or opts.batch) for b in bufs]
        return bufs, {b.name: _nbytes(b) // b.shape[0] for b in bufs}, n_tiles

    def _start_kv_tile(self, k: ir.KindSchedule, layer: int, t: int, where: str,
                       tiles: tuple[list[ir.Buffer], dict[str, int], int]) -> None:
        bufs, nbytes, n_tiles = tiles
        kv = k.kv
        if t < n_tiles:
            for b in bufs:
                self.tb.start(dst=b.name, slot=t % kv.slots, sem=(b.name, t % kv.slots),
                              nbytes=nbytes[b.name], tag=KvTile(layer, t), where=where,
                              span=kv.span)

    def kv_start(self, k: ir.KindSchedule, layer: int, where: str) -> None:
        """The first `ahead` tiles' copies (at the layer's start, or at the op reading them)."""
        tiles = self._kv_tiles(k)
        for t in range(k.kv.ahead):
            self._start_kv_tile(k, layer, t, where, tiles)

    def kv_landed(self, k: ir.KindSchedule, layer: int, where: str) -> None:
        """`at layer start`: the op writing the new rows waits the first tiles' copies and
        writes its rows into the tiles that hold them."""
        bufs, nbytes, n_tiles = self._kv_tiles(k)
        kv = k.kv
        for t in range(min(kv.ahead, n_tiles)):
            for b in bufs:
                self.tb.wait(sem=(b.name, t % kv.slots), nbytes=nbytes[b.name], where=where,
                             span=kv.span)
                self.tb.write(b.name, t % kv.slots, KvTile(layer, t), where, kv.span)

    def kv_events(self, k: ir.KindSchedule, layer: int, where: str) -> None:
        """The op reading the KV tiles: each tile waited (the first `ahead` already were,
        `at layer start`), read, and the tile `ahead` on started; the op scopes the tile
        buffers itself unless they are copied from the layer's start."""
        tb, kv = self.tb, k.kv
        tiles = bufs, nbytes, n_tiles = self._kv_tiles(k)
        if not kv.at_start:
            for b in bufs:
                tb.alloc(b.name, where, kv.span)
            self.kv_start(k, layer, where)
        for t in range(n_tiles):
            for b in bufs:
                if not (kv.at_start and t < kv.ahead):
                    tb.wait(sem=(b.name, t % kv.slots), nbytes=nbytes[b.name], where=where,
                            span=kv.span)
                tb.read(b.name, t % kv.slots, KvTile(layer, t), where, kv.span)
            self._start_kv_tile(k, layer, t + kv.ahead, where, tiles)
        if not kv.at_start:
            for b in bufs:
                tb.free(b.name, where, kv.span)


@dataclass
class LayerTrace:
    """One iteration of the layer loop as its steps trace it (`mkc.steps`: `step.trace(t)`)."""

    tracer: StepTracer
    layer: int
    kname: str
    seen: int                     # layers of this kind already run
    tile: int                     # the next ring tile this layer consumes
    first_tile: int = field(init=False)     # the layer's first ring tile
    holds: dict = field(init=False)     # the tag each state buffer holds, as ops update it
    held_refills: list = field(init=False)   # ring refills held back to a `Refill` step

    def __post_init__(self) -> None:
        s = self.tracer.s
        self.s, self.tb, self.k = s, self.tracer.tb, s.kinds[self.kname]
        self.label = layer_label(s, self.layer)
        self.families = {f.name: f for f in s.stream.families[self.kname]}
        self.vector_families = {name for name, _ in self.k.vectors}
        self.loaded = {t.state: t.buffer for t in self.k.transfers if t.direction == "load"}
        self.holds = {t.buffer: LayerState(self.layer) for t in self.k.transfers}
        self.held_refills = []
        self.first_tile = self.tile

    def where(self, p: int) -> str:
        if p == 0:
            return f"{self.label} at start"
        if p == len(self.k.ops):
            return f"{self.label} at end"
        return f"{self.label} before {self.k.ops[p]}"

    def sized(self, buffer: str) -> int:
        return self.tracer.sized(self.s.buffer(buffer))


def build_trace(s: ir.ScheduleIR, options: TraceOptions | None = None) -> list[Event]:
    """The event trace of one step. With `options.compute` it also carries an `OpBegin`
    event as each op begins, a `Collective` event where each collective runs, a `LayerBegin`
    event as each layer begins, an `EpilogueBegin` event, and the bytes of every weight read:
    what the step-time model needs on top of the checks'."""
    opts = options or TraceOptions()
    tracer = StepTracer(s, opts)
    tb, st, par = tracer.tb, s.stream, s.parity
    n_layers = len(s.layer_kinds)

    # ---- prologue ------------------------------------------------------------------------
    for view_id, v in tracer.views.items():
        if v.slots == 0 and s.layer_kinds:
            tracer.start_weights(view_id, 0, "prologue", v.span)
    for t in range(min(st.ahead, tracer.total_tiles)):
        tracer.start_tile(t, "prologue")
    for layer in range(min(par.ahead, n_layers)):
        tracer.start_vectors(layer, "prologue")
    tracer.op_event("tail", "embed", -1, "prologue: embedding")
    tb.write("x", None, WholeBuffer("x"), "prologue: embedding", Span.unknown(s.source))
    if s.embed_reduce is not None:
        tracer.collective_event(AllReduce(0, op="embed", entry=s.embed_reduce), "prologue: embedding")
    head_norm_bytes = s.buffer("head_norm").vmem_bytes
    tb.start(dst="head_norm", slot=None, sem=("head_norm",), nbytes=head_norm_bytes,
             tag=WholeBuffer("head_norm"), where="prologue", span=Span.unknown(s.source))

    # ---- layers: each step of the kind's program adds its events ------------------------
    programs = {kname: layer_program(s, kname) for kname in s.kinds}
    seen_kind = {kname: 0 for kname in s.kinds}
    for layer, kname in enumerate(s.layer_kinds):
        if opts.compute:
            tb.begin_layer(LayerBegins(kname, layer), layer_label(s, layer), Span.unknown(s.source))
        lt = LayerTrace(tracer, layer, kname, seen_kind[kname], tracer.layer_tile_offset[layer])
        for step in programs[kname]:
            step.trace(lt)
        seen_kind[kname] += 1

    # ---- epilogue ------------------------------------------------------------------------
    if opts.compute:
        tb.begin_epilogue("epilogue", Span.unknown(s.source))
    for kname, k in s.kinds.items():
        for t in k.transfers:
            for _ in range(t.drain if seen_kind[kname] else 0):
                tb.wait(sem=(t.direction, t.buffer), nbytes=tracer.sized(s.buffer(t.buffer)),
                        where="epilogue: drain", span=t.span)
    tb.wait(sem=("head_norm",), nbytes=head_norm_bytes, where="epilogue",
            span=Span.unknown(s.source))
    tracer.op_event("tail", "final_norm", -1, "epilogue final_norm")
    tb.read("head_norm", None, WholeBuffer("head_norm"), "epilogue final_norm", Span.unknown(s.source))
    tracer.op_event("tail", "lm_head", -1, "epilogue lm_head")
    tracer.consume_tiles(st.tail[0], tracer.tail_tile_offset, "epilogue lm_head")
    tb.exit("kernel exit", Span.unknown(s.source))
    return tb.events


def run_indices(n_tiles: int, traced: int, st: ir.Stream) -> range | list[int]:
    """The tiles of a run of `n_tiles` its `traced` tiles stand for (`periodic_tiles_traced`):
    the first ones, then the run's last ones (the same residues mod the slots)."""
    if traced == n_tiles:
        return range(n_tiles)
    head = 2 * (min(st.ahead, st.slots + 1) + st.slots) + 1 + st.slots
    return [*range(head), *range(n_tiles - (traced - head), n_tiles)]


def periodic_tiles_traced(n_tiles: int, slots: int, ahead: int) -> int:
    """How many tiles of a uniform run (KV tiles; one family's weight tiles; a layer's routed
    experts through their slots) the trace unrolls
    to show every pattern of a run of `n_tiles` through `slots` slots, `ahead` tiles ahead.

    The events of tile t depend on t only through t % slots, whether t is issued in the
    warm-up (t < ahead) and whether it still issues tile t + ahead (t + ahead < n_tiles).
    A distance beyond the slot count already clobbers a slot within the first slots + 1
    tiles. So a stream that keeps the warm-up, a full period of steady state and the tail,
    with the same residue mod `slots`, has the same hazards as the whole one, and the check
    costs the same at any context length."""
    warm = 2 * (min(ahead, slots + 1) + slots) + 1
    if n_tiles <= warm + slots:
        return n_tiles
    return warm + slots + (n_tiles - warm) % slots


def _nbytes(b: ir.Buffer) -> int:
    """Unpadded bytes of a whole buffer: what one DMA of it moves and its semaphore counts."""
    n = ir.DTYPE_BYTES[b.dtype]
    for d in b.shape:
        n *= d
    return n
