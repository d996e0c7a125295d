"""Pass `stream`: the weight ring (`ring NAME: N slots of bf16 tiles up to R x C`) and the
stream through it (`stream NAME ahead A { kind: families... then lm_head }`)."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import Span, fail
from mkc.lang import ast
from mkc.lang.statements.ring import Ring
from mkc.lang.statements.stream import Stream
from mkc.model.graph import DecodeGraph, LayerKind
from mkc.resolve.names import unknown, unused_kind, validate_identifier
from mkc.resolve.state import ResolveState

RING_DTYPES = ("bf16",)
# Cost-model constant for choosing the ring tile: what one extra DMA costs, in bytes moved.
TILE_OVERHEAD_BYTES = 64 * 1024


def resolve_stream(s: ResolveState) -> ResolveState:
    sched, graph = s.sched, s.graph
    ring, st = _ring_and_stream(sched, graph)
    listed: dict[str, list[ast.Name]] = {}
    for sk in st.per_kind:
        if unused_kind(s, sk.kind.text):
            continue
        if sk.kind.text not in graph.kinds:
            raise unknown("layer kind", sk.kind, sorted(graph.kinds))
        if sk.kind.text in listed:
            raise fail("E-DUPLICATE", f"the stream lists {sk.kind.text} twice", sk.kind.span,
                       hint=f"keep one `{sk.kind.text}: ...` line")
        listed[sk.kind.text] = sk.families
    for kname in sorted(set(graph.layer_kinds)):
        _check_kind_listed(graph.kinds[kname], s.pooled.get(kname, {}), listed, st)
    tail = [m.name for m in graph.tail_matrices()]
    if not st.tail:
        raise fail("E-STREAM", f"the stream must end with `then {', '.join(tail)}`", st.span,
                   hint=f"add `then {', '.join(tail)}` as the stream's last line")
    _check_listed_in_order(st.tail, tail, "tail", st.span, hint=f"end the stream with `then "
                                                                f"{', '.join(tail)}`")
    _check_codes_stream(s)
    return replace(s, stream=_stream(ring, st, graph, s.pooled))


def _check_codes_stream(s: ResolveState) -> None:
    """A dense class stored as codes (`format CLASS int8 channel rounded`) streams: its codes
    and their scales ride the ring's tiles, which a pool view does not have."""
    from mkc.resolve.formats import format_span
    ring = s.sched.rings[0]
    tensors = [t for k in set(s.graph.layer_kinds) for t in s.graph.kinds[k].tensors.values()]
    coded = sorted({t.format_class for t in tensors + list(s.graph.globals.values())
                    if t.role == "matrix" and t.dtype in ir.CODE_DTYPES})
    if coded and ir.max_code_cols(ring.max_cols) == 0:
        raise fail("E-FORMAT", f"`format {coded[0]} {s.graph.formats[coded[0]].spelled}` multiplies "
                   f"codes {ir.CODE_DOT_COLUMNS} columns a dot, and ring {ring.name.text}'s tiles "
                   f"are at most {ring.max_cols} columns", format_span(s.sched, coded[0]),
                   hint=f"widen the ring's tiles to at least {ir.CODE_DOT_COLUMNS} columns "
                        f"(`... tiles up to {ring.max_rows} x {ir.CODE_DOT_COLUMNS}`), or keep "
                        f"{coded[0]} bf16")
    for kname in sorted(set(s.graph.layer_kinds)):
        for t in s.graph.kinds[kname].tensors.values():
            view = s.pooled.get(kname, {}).get(t.name)
            if view and t.dtype in ir.CODE_DTYPES:
                fmt = s.graph.formats[t.format_class]
                raise fail("E-FORMAT", f"{kname}.{t.name} is held in pool view {view}, and "
                           f"`format {t.format_class} {fmt.spelled}` stores a class's matrices as "
                           "codes with their scales in the ring's tiles: every matrix of "
                           f"{t.format_class} must stream", format_span(s.sched, t.format_class),
                           hint=f"stream {kname}.{t.name} (take it out of view {view} and list "
                                f"it in the stream), or keep {t.format_class} bf16")


def _ring_and_stream(sched: ast.Schedule, graph: DecodeGraph) -> tuple[Ring, Stream]:
    """The one ring and the one stream through it, each checked on its own."""
    if len(sched.rings) != 1 or len(sched.streams) != 1:
        span = (sched.rings[1].span if len(sched.rings) > 1 else
                sched.streams[1].span if len(sched.streams) > 1 else sched.name.span)
        raise fail("E-STREAM", "a schedule needs exactly one weight ring and one stream through it",
                   span, hint="declare `ring NAME: N slots of bf16 tiles up to R x C` and "
                              "`stream NAME ahead A { kind: families... then lm_head }`")
    ring, st = sched.rings[0], sched.streams[0]
    validate_identifier(ring.name, "ring", graph)
    if ring.dtype.text not in RING_DTYPES:
        raise unknown("ring dtype", ring.dtype, list(RING_DTYPES))
    for what, v in (("rows", ring.max_rows), ("columns", ring.max_cols)):
        if v <= 0 or v % ir.LANES:
            raise fail("E-ALIGN", f"ring tile {what} {v} is not a multiple of {ir.LANES}",
                       ring.span, hint=f"TPU tiles are (16, 128) for bf16 and activations put tile "
                                       f"rows on lanes: use {_nearest_multiples(v, ir.LANES)}")
    if ring.slots < 1:
        raise fail("E-STREAM", "a ring needs at least one slot", ring.span, hint="use 2 or more")
    if st.ring.text != ring.name.text:
        raise unknown("ring", st.ring, [ring.name.text])
    if st.ahead < 1:
        raise fail("E-STREAM", "stream distance must be at least 1 tile", st.span,
                   hint=f"`ahead {ring.slots}` keeps every slot busy")
    return ring, st


def _check_kind_listed(kind: LayerKind, in_pool: dict[str, str],
                       listed: dict[str, list[ast.Name]], st: Stream) -> None:
    """A layer kind's matrices not held in a pool stream in consumption order; a matrix an op
    reads whole (not by a matmul) cannot stream in tiles."""
    kname = kind.name
    multiplied = {o.matmul for o in kind.ops if o.matmul}
    for t in kind.tensors.values():
        if t.role == "matrix" and t.name not in multiplied and t.name not in in_pool:
            readers = ", ".join(kind.ops[i].name for i in kind.readers(t.name))
            raise fail("E-POOL", f"{kname}.{t.name} is read whole by {readers}, so it cannot "
                       "stream through the ring in tiles", st.span,
                       hint=f"hold it in a pool view: `view NAME: {kname}({t.name}, ...)`")
    order = [t.name for t in kind.matrices() if t.name not in in_pool]
    names = listed.get(kname, [])
    if not order and not names:
        return
    if kname not in listed:
        raise fail("E-STREAM", f"stream lists no weights for layer kind {kname}", st.span,
                   hint=f"add `{kname}: {', '.join(order)}`")
    for n in names:
        if n.text in in_pool:
            raise fail("E-STREAM", f"{kname}.{n.text} is held in pool view {in_pool[n.text]}; "
                       "it cannot also stream", n.span, hint="list each matrix in one place")
    _check_listed_in_order(names, order, kname, st.span,
                           hint=f"list them in consumption order: {', '.join(order)}")


def _check_listed_in_order(names: list[ast.Name], expected: list[str], owner: str,
                           empty_span: Span, hint: str) -> None:
    """A stream line must name each of `owner`'s `expected` matrices once, in that order. The
    first problem is reported at its item: a name not expected, a name listed again, names left
    out (at the line's last item) or, the line then being a reordering, the first item out of
    place."""
    seen: set[str] = set()
    for n in names:
        if n.text not in expected:
            raise unknown(f"matrix family of {owner}", n, expected)
        if n.text in seen:
            raise fail("E-DUPLICATE", f"the stream lists {owner}.{n.text} twice", n.span,
                       hint=f"keep one {n.text}; " + hint)
        seen.add(n.text)
    missing = [e for e in expected if e not in seen]
    if missing:
        raise fail("E-STREAM", f"{owner} matrices {', '.join(missing)} are not streamed",
                   names[-1].span if names else empty_span, hint=hint)
    # Every name listed once and none missing: `names` is a reordering of `expected`.
    for n, e in zip(names, expected, strict=True):
        if n.text != e:
            raise fail("E-STREAM-ORDER", f"{owner} weights are listed out of consumption order",
                       n.span, hint=hint)


def _stream(ring: Ring, st: Stream, graph: DecodeGraph,
            pooled: dict[str, dict[str, str]]) -> ir.Stream:
    """The stream's families with their tiles, and where each layer's tiles start."""
    def family(kname: str, t) -> ir.StreamFamily:
        if t.dtype in ir.CODE_DTYPES:       # 8-bit codes: two rows a slot row, scale rows
            fmt = graph.formats[t.format_class]
            tr, tc = choose_tile(t.shape[0], t.shape[1], ir.max_code_rows(ring.max_rows),
                                 ir.max_code_cols(ring.max_cols), value_bytes=1)
            return ir.StreamFamily(kname, t.name, t.shape[0], t.shape[1], -(-t.shape[0] // tr),
                                   -(-t.shape[1] // tc), t.partial_out, tr, tc, codes=t.dtype,
                                   fp8_operand=fmt.fp8_operand, format_class=t.format_class)
        tr, tc = choose_tile(t.shape[0], t.shape[1], ring.max_rows, ring.max_cols)
        return ir.StreamFamily(kname, t.name, t.shape[0], t.shape[1], -(-t.shape[0] // tr),
                               -(-t.shape[1] // tc), t.partial_out, tr, tc)

    layer_kinds = graph.layer_kinds
    families = {kname: [family(kname, t) for t in graph.kinds[kname].matrices()
                        if t.name not in pooled.get(kname, {})]
                for kname in sorted(set(layer_kinds))}
    tail = [family("tail", m) for m in graph.tail_matrices()]
    offsets, t = [], 0
    for kname in layer_kinds:
        offsets.append(t)
        t += sum(f.tiles for f in families[kname])
    useful = sum(f.rows * f.cols * ir.DTYPE_BYTES[f.codes] * layer_kinds.count(k)
                 for k, fs in families.items() for f in fs) + sum(
        f.rows * f.cols * ir.DTYPE_BYTES[f.codes] for f in tail)
    streamed = sum(f.run_bytes * layer_kinds.count(k)
                   for k, fs in families.items() for f in fs) + sum(f.run_bytes for f in tail)
    every = [f for fs in families.values() for f in fs] + tail
    shapes = sorted({shape for f in every for shape in f.slot_shapes})
    return ir.Stream(ring=ring.name.text, slots=ring.slots, ahead=st.ahead, dtype=ring.dtype.text,
                     tile_rows=max(r for r, _ in shapes),
                     tile_cols=max(f.read_cols for f in every), families=families, tail=tail,
                     layer_tile_offset=offsets, tail_tile_offset=t,
                     total_tiles=t + sum(f.tiles for f in tail),
                     useful_bytes=useful, streamed_bytes=streamed,
                     tile_shapes=shapes, span=st.span)


def choose_tile(rows: int, cols: int, max_rows: int, max_cols: int,
                value_bytes: int = 2) -> tuple[int, int]:
    """A family's tile: multiples of 128 within the ring bound, minimising the bytes its
    copies move (padding included; `value_bytes` a value: 1 for 8-bit codes, whose column
    blocks add their scale rows) plus a per-copy overhead; ties go to larger tiles."""
    best = None
    # A tile larger than the matrix rounded up to 128 only adds padding, so the search stops
    # there: its cost is bounded by the matrix, not by the ring's bound.
    for r in range(128, min(max_rows, max(128, -(-rows // 128) * 128)) + 1, 128):
        for c in range(128, min(max_cols, max(128, -(-cols // 128) * 128)) + 1, 128):
            n = -(-rows // r) * -(-cols // c)
            scales = 0 if value_bytes == 2 else -(-cols // c) * ir.SCALE_ROWS * c * 2
            key = (n * (r * c * value_bytes + TILE_OVERHEAD_BYTES) + scales, -r * c, -c)
            if best is None or key < best[0]:
                best = (key, (r, c))
    return best[1]


def _nearest_multiples(v: int, unit: int) -> str:
    """The positive multiples of ``unit`` either side of ``v``: "128 or 256", or "128" below it."""
    below = v // unit * unit
    return f"{below} or {below + unit}" if below > 0 else str(unit)
