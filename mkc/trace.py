"""Unroll the schedule IR into the event trace of one decode step, in program order.

The trace covers the prologue, every layer (so every layer-kind transition), and the
epilogue. Each DMA carries the content tag it delivers and each read the tag it expects,
so checks can tell a stale or clobbered slot from a fresh one. Codegen emits the same
structure (same points, same slot arithmetic); this module is its executable model.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from mkc import ir
from mkc.diagnostics import Span
from mkc.program import layer_program


@dataclass(slots=True)      # not frozen: 30k events a K3 trace, and frozen init is 2x slower
class Event:
    seq: int
    op: str                    # alloc | free | start | wait | read | write | exit
    buffer: str = ""           # VMEM buffer ("" for HBM-only events)
    slot: int | None = None
    dma: int | None = None
    sem: tuple = ()
    nbytes: int = 0
    tag: object = None         # content delivered (start/write) or expected (read)
    src: tuple | None = None   # for a start reading VMEM: (buffer, slot, expected tag)
    hbm: tuple | None = None   # for a start touching HBM state: (region, "read" | "write")
    where: str = ""
    span: Span = field(default_factory=Span.unknown)


@dataclass(frozen=True)
class TraceOptions:
    """How `build_trace` unrolls a step for the step-time model (`mkc.perf`). The defaults give
    exactly the trace the checks read; every option only adds events or resizes copies."""

    batch: int | None = None       # size state and KV copies at this batch (None: the largest)
    sequences: int | None = None   # KV tiles hold this many sequences (a verify step's rows
                                   # are fewer sequences; None: one per row)
    experts: int | None = None     # routed experts each MoE layer runs (None: the worst case)
    kv_tokens: int | None = None   # unroll the whole KV stream over this many cached tokens
    compute: bool = False          # add `op` and `collective` events, bytes on weight reads
    whole_runs: bool = False       # unroll every ring tile and routed expert (the checks read
                                   # a whole period of each run: `periodic_tiles_traced`)


class TraceBuilder:
    def __init__(self) -> None:
        self.events: list[Event] = []
        self._dma = 0

    def _add(self, **kw) -> Event:
        e = Event(seq=len(self.events), **kw)
        self.events.append(e)
        return e

    def alloc(self, buffer: str, where: str, span: Span) -> None:
        self._add(op="alloc", buffer=buffer, where=where, span=span)

    def free(self, buffer: str, where: str, span: Span) -> None:
        self._add(op="free", buffer=buffer, where=where, span=span)

    def start(self, *, dst: str, slot: int | None, sem: tuple, nbytes: int, tag: object,
              where: str, span: Span, src: tuple | None = None, hbm: tuple | None = None
              ) -> None:
        self._dma += 1
        self._add(op="start", buffer=dst, slot=slot, dma=self._dma, sem=sem, nbytes=nbytes,
                  tag=tag, src=src, hbm=hbm, where=where, span=span)

    def wait(self, *, sem: tuple, nbytes: int, where: str, span: Span) -> None:
        self._add(op="wait", sem=sem, nbytes=nbytes, where=where, span=span)

    def read(self, buffer: str, slot: int | None, tag: object, where: str, span: Span,
             nbytes: int = 0) -> None:
        self._add(op="read", buffer=buffer, slot=slot, tag=tag, where=where, span=span,
                  nbytes=nbytes)

    def write(self, buffer: str, slot: int | None, tag: object, where: str, span: Span) -> None:
        self._add(op="write", buffer=buffer, slot=slot, tag=tag, where=where, span=span)

    def view(self, op: str, view_id: str, layer: int, label: str, where: str, span: Span
             ) -> None:
        """A pool view becoming live (`view_open`) or dead (`view_close`) for a layer."""
        self._add(op=op, buffer=view_id, tag=("view", label, layer), where=where, span=span)


def layer_label(s: ir.ScheduleIR, layer: int) -> str:
    """How diagnostics name an iteration of the layer loop: a model layer, or one of its
    sublayers when the loop runs attention and MLP as separate iterations (K3)."""
    per_layer = len(s.layer_kinds) // s.dims["num_hidden_layers"]
    if per_layer == 1:
        return f"layer {layer} ({s.layer_kinds[layer]})"
    return f"layer {layer // per_layer} {s.layer_kinds[layer]}"


def build_trace(s: ir.ScheduleIR, options: TraceOptions | None = None) -> list[Event]:
    """The event trace of one step. With `options.compute` it also carries an `op` event as
    each op begins (tag: (kind, op, layer); kind "tail" for embed, final_norm, lm_head), a
    `collective` event where each collective runs (tag: (kind of collective, its IR entry)),
    a `layer` event as each layer begins (tag: (kind, layer)), an `epilogue` event, and the
    bytes of every weight read: what the step-time model needs on top of the checks'."""
    opts = options or TraceOptions()
    tb = TraceBuilder()

    def sized(b: ir.Buffer) -> int:
        return _nbytes(b.at_batch(opts.batch) if opts.batch else b)

    def op_event(kind: str, op: str, layer: int, where: str) -> None:
        if opts.compute:
            tb._add(op="op", tag=(kind, op, layer), where=where, span=Span.unknown(s.source))

    def collective_event(what: str, entry, where: str) -> None:
        if opts.compute:
            tb._add(op="collective", tag=(what, entry), where=where, span=entry.span)

    st, par = s.stream, s.parity

    def traced(tiles: int) -> int:
        """Tiles of one family's run the trace unrolls (all of them for the step-time model)."""
        return tiles if opts.whole_runs else periodic_tiles_traced(tiles, st.slots, st.ahead)

    # The ring stream as traced: each family's run shortened by whole periods of slots, so the
    # trace's size does not grow with smaller tiles (same residues, same hazards).
    tile_bytes: list[int] = []
    layer_tile_offset: list[int] = []
    for kname in s.layer_kinds:
        layer_tile_offset.append(len(tile_bytes))
        for f in st.families[kname]:
            tile_bytes += [f.tile_bytes] * traced(f.tiles)
    tail_tile_offset = len(tile_bytes)
    for f in st.tail:
        tile_bytes += [f.tile_bytes] * traced(f.tiles)
    total_tiles = len(tile_bytes)
    vec_bytes = par.rows * par.cols * 4
    n_layers = len(s.layer_kinds)
    ring_sem = lambda slot: ("ring", slot)                       # noqa: E731
    vec_sem = lambda slot: ("vectors", slot)                     # noqa: E731

    def start_tile(t: int, where: str) -> None:
        if t < total_tiles:
            tb.start(dst=st.ring, slot=t % st.slots, sem=ring_sem(t % st.slots),
                     nbytes=tile_bytes[t], tag=("tile", t), where=where, span=st.span)

    def consume_tiles(family: ir.Family, first: int, where: str) -> int:
        """Consume the family's run of tiles from `first`; returns the next tile."""
        for t in range(first, first + traced(family.tiles)):
            # The consumer waits for its own family's tile size.
            tb.wait(sem=ring_sem(t % st.slots), nbytes=family.tile_bytes, where=where,
                    span=st.span)
            tb.read(st.ring, t % st.slots, ("tile", t), where, st.span,
                    tile_bytes[t] if opts.compute else 0)
            start_tile(t + st.ahead, where)
        return first + traced(family.tiles)

    def start_vectors(layer: int, where: str) -> None:
        tb.start(dst="vectors", slot=layer % 2, sem=vec_sem(layer % 2), nbytes=vec_bytes,
                 tag=("vectors", layer), where=where, span=par.span)

    # ---- pool views ----------------------------------------------------------------------
    views = {f"{p.name}.{v.name}": v for p in s.pools for v in p.views}
    # Worst case for routed experts: every row picks top_k experts of this rank's group.
    expert_count = min(s.top_k * s.rows_max, s.per_rank.get("local_experts", 0))
    if opts.experts is not None:
        expert_count = min(opts.experts, s.per_rank.get("local_experts", 0))

    def pooled_bytes(view_id: str, kname: str, fam: str) -> int:
        return next(m.nbytes for m in views[view_id].matrices[kname] if m.name == fam)

    def open_view(view_id: str, layer: int, where: str, span: Span) -> None:
        """`span` is the statement whose copy opens the view: a pool overlap points there."""
        tb.view("view_open", view_id, layer, layer_label(s, layer), where, span)

    def start_weights(view_id: str, layer: int, where: str, span: Span) -> None:
        """Copy layer `layer`'s matrices of this weight view (if its kind has any)."""
        kname = s.layer_kinds[layer]
        mats = views[view_id].matrices.get(kname, [])
        if not mats:
            return
        open_view(view_id, layer, where, span)
        for m in mats:
            tb.start(dst=view_id, slot=m.name, sem=(view_id, m.name), nbytes=m.nbytes,
                     tag=("pool", layer, m.name), where=where, span=span)

    def start_expert(view_id: str, layer: int, k: int, where: str, span: Span) -> None:
        v = views[view_id]
        for m in v.matrices["expert"]:
            tb.start(dst=view_id, slot=(k % v.slots, m.name), sem=(view_id, k % v.slots, m.name),
                     nbytes=m.nbytes, tag=("expert", layer, k), where=where, span=span)

    def run_experts(view_id: str, layer: int, where: str, span: Span) -> None:
        v = views[view_id]
        # Expert k is fetched `slots` ahead into slot k % slots: as periodic as a ring's tiles.
        count = expert_count if opts.whole_runs else periodic_tiles_traced(expert_count, v.slots,
                                                                           v.slots)
        for k in range(count):
            for m in v.matrices["expert"]:
                tb.wait(sem=(view_id, k % v.slots, m.name), nbytes=m.nbytes, where=where,
                        span=span)
                tb.read(view_id, (k % v.slots, m.name), ("expert", layer, k), where, span,
                        m.nbytes if opts.compute else 0)
            if k + v.slots < count:
                start_expert(view_id, layer, k + v.slots, where, span)

    # ---- prologue ------------------------------------------------------------------------
    for view_id, v in views.items():
        if v.slots == 0 and s.layer_kinds:
            start_weights(view_id, 0, "prologue", v.span)
    for t in range(min(st.ahead, total_tiles)):
        start_tile(t, "prologue")
    for layer in range(min(par.ahead, n_layers)):
        start_vectors(layer, "prologue")
    op_event("tail", "embed", -1, "prologue: embedding")
    tb.write("x", None, ("x", -1), "prologue: embedding", Span.unknown(s.source))
    if s.embed_reduce is not None:
        collective_event("allreduce", s.embed_reduce, "prologue: embedding")
    head_norm_bytes = s.buffer("head_norm").vmem_bytes
    tb.start(dst="head_norm", slot=None, sem=("head_norm",), nbytes=head_norm_bytes,
             tag=("head_norm",), where="prologue", span=Span.unknown(s.source))

    # ---- layers --------------------------------------------------------------------------
    programs = {kname: layer_program(s, kname) for kname in s.kinds}
    seen_kind = {kname: 0 for kname in s.kinds}      # layers of each kind already run
    for layer, kname in enumerate(s.layer_kinds):
        k = s.kinds[kname]
        label = layer_label(s, layer)
        if opts.compute:
            tb._add(op="layer", tag=(kname, layer), where=label, span=Span.unknown(s.source))
        tile = layer_tile_offset[layer]
        families = {f.name: f for f in st.families[kname]}
        vector_families = {name for name, _ in k.vectors}
        loaded = {t.state: t.buffer for t in k.transfers if t.direction == "load"}
        holds = {t.buffer: ("state", layer) for t in k.transfers}   # tag each state buffer holds

        def where(p: int) -> str:
            if p == 0:
                return f"{label} at start"
            if p == len(k.ops):
                return f"{label} at end"
            return f"{label} before {k.ops[p]}"

        for step in programs[kname]:
            t = step.transfer
            if step.kind == "scope_open":
                for b in step.buffers:
                    tb.alloc(b.name, where(step.point), b.span)
            elif step.kind == "scope_close":
                for b in step.buffers:
                    tb.free(b.name, where(step.point), b.span)
            elif step.kind == "vectors":
                if par.ahead == 0:
                    start_vectors(layer, where(0))
                tb.wait(sem=vec_sem(layer % 2), nbytes=vec_bytes, where=where(0), span=par.span)
                if par.ahead > 0 and layer + par.ahead < n_layers:
                    start_vectors(layer + par.ahead, where(0))
            elif step.kind == "start" and t.direction == "load":
                tb.start(dst=t.buffer, slot=None, sem=(t.direction, t.buffer),
                         nbytes=sized(s.buffer(t.buffer)), tag=("state", layer),
                         hbm=(("state", t.state, layer), "read"),
                         where=where(step.point), span=t.span)
            elif step.kind == "start":
                tb.start(dst="", slot=None, sem=(t.direction, t.buffer),
                         nbytes=sized(s.buffer(t.buffer)), tag=None,
                         src=(t.buffer, None, ("state-updated", layer)),
                         hbm=(("state", t.state, layer), "write"),
                         where=where(step.point), span=t.span)
            elif step.kind == "wait" or (step.kind == "drain" and seen_kind[kname] > 0):
                tb.wait(sem=(t.direction, t.buffer), nbytes=sized(s.buffer(t.buffer)),
                        where=where(step.point), span=t.span)
            elif step.kind == "prefetch":
                if layer + 1 < n_layers:
                    start_weights(step.view, layer + 1, where(step.point), k.prefetch.span)
            elif step.kind == "fetch":
                open_view(step.view, layer, where(step.point), k.fetch.span)
                for e in range(min(views[step.view].slots, expert_count)):
                    start_expert(step.view, layer, e, where(step.point), k.fetch.span)
            elif step.kind == "pool_wait":
                m = next(m for m in views[step.view].matrices[kname] if m.name == step.family)
                tb.wait(sem=(step.view, m.name), nbytes=m.nbytes, where=where(step.point),
                        span=views[step.view].span)
            elif step.kind == "view_close":
                tb.view("view_close", step.view, layer, label, f"{label} after {k.ops[step.point]}",
                        views[step.view].span)
            elif step.kind in ("allreduce", "allgather", "exchange"):
                collective_event(step.kind, step.allreduce or step.collective,
                                 f"{label} after {step.op}")
            elif step.kind == "op":
                op = step.op
                w = f"{label} {op}"
                op_event(kname, op, layer, w)
                if op in k.matmuls and k.matmuls[op] not in k.pooled:
                    family = families[k.matmuls[op]]
                    tile = consume_tiles(family, tile, w)
                for fam, view_id in sorted(k.pooled.items()):
                    if k.matmuls.get(op) == fam or fam in k.op_reads[op]:
                        tb.read(view_id, fam, ("pool", layer, fam), w, views[view_id].span,
                                pooled_bytes(view_id, kname, fam) if opts.compute else 0)
                if k.fetch is not None and op == k.fetch.consumer:
                    run_experts(f"{k.fetch.pool}.{k.fetch.view}", layer, w, k.fetch.span)
                if vector_families & set(k.op_reads[op]):
                    tb.read("vectors", layer % 2, ("vectors", layer), w, par.span)
                for sname in k.op_reads[op]:
                    if sname in loaded:
                        b = s.buffer(loaded[sname])
                        tb.read(b.name, None, holds[b.name], w, b.span)
                        if sname in k.op_writes[op]:
                            holds[b.name] = ("state-updated", layer)
                            tb.write(b.name, None, holds[b.name], w, b.span)
                if k.kv is not None and op == k.kv.op:
                    _kv_events(tb, s, k, layer, w, opts)
        seen_kind[kname] += 1

    # ---- epilogue ------------------------------------------------------------------------
    if opts.compute:
        tb._add(op="epilogue", where="epilogue", span=Span.unknown(s.source))
    for kname, k in s.kinds.items():
        for t in k.transfers:
            for _ in range(t.drain if seen_kind[kname] else 0):
                tb.wait(sem=(t.direction, t.buffer), nbytes=sized(s.buffer(t.buffer)),
                        where="epilogue: drain", span=t.span)
    tb.wait(sem=("head_norm",), nbytes=head_norm_bytes, where="epilogue",
            span=Span.unknown(s.source))
    op_event("tail", "final_norm", -1, "epilogue final_norm")
    tb.read("head_norm", None, ("head_norm",), "epilogue final_norm", Span.unknown(s.source))
    op_event("tail", "lm_head", -1, "epilogue lm_head")
    consume_tiles(st.tail[0], tail_tile_offset, "epilogue lm_head")
    tb._add(op="exit", where="kernel exit", span=Span.unknown(s.source))
    return tb.events


def _kv_events(tb: TraceBuilder, s: ir.ScheduleIR, k: ir.KindSchedule, layer: int,
               where: str, opts: TraceOptions) -> None:
    kv = k.kv
    bufs = [b for b in s.buffers if b.cls == "kv" and b.scope and b.scope[0] == k.name]
    if opts.kv_tokens is None:
        n_tiles = periodic_tiles_traced(s.context // kv.tokens, kv.slots, kv.ahead)
    else:
        n_tiles = -(-opts.kv_tokens // kv.tokens)
    if opts.sequences or opts.batch:
        bufs = [b.at_batch(opts.sequences or opts.batch) for b in bufs]
    nbytes = {b.name: _nbytes(b) // b.shape[0] for b in bufs}
    for b in bufs:
        tb.alloc(b.name, where, kv.span)

    def start(t: int) -> None:
        if t < n_tiles:
            for b in bufs:
                tb.start(dst=b.name, slot=t % kv.slots, sem=(b.name, t % kv.slots),
                         nbytes=nbytes[b.name], tag=("kv", layer, t), where=where, span=kv.span)

    for t in range(min(kv.ahead, n_tiles)):
        start(t)
    for t in range(n_tiles):
        for b in bufs:
            tb.wait(sem=(b.name, t % kv.slots), nbytes=nbytes[b.name], where=where, span=kv.span)
            tb.read(b.name, t % kv.slots, ("kv", layer, t), where, kv.span)
        start(t + kv.ahead)
    for b in bufs:
        tb.free(b.name, where, kv.span)


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
