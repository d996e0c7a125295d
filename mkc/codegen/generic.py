"""The values the generic module template prints: schedule constants as readable Python
literals (named dataclasses of `mkc.runtime`, wrapped at 100 columns), the layer functions
(`mkc.codegen.layers`) and the kernel's inputs, outputs and scratch by name."""
from __future__ import annotations

import dataclasses
import json

from mkc import ir
from mkc.codegen.layers import DTYPE_SOURCE, layer_source
from mkc.steps.collectives import exchange_name, gather_name, reduce_name
from mkc.model.sharding import ShardTable
from mkc.runtime.collectives import FromRows, GatherSums, ReduceScatter, Stage
from mkc.runtime.context import KindPlan, StateCopy, spread_on_host
from mkc.runtime import experts
from mkc.runtime.experts import ExpertSlots
from mkc.runtime.kv import KvTiles
from mkc.runtime.pool import WeightView
from mkc.runtime.ring import Ring, StreamedMatrix
from mkc.runtime.vectors import Parity

WIDTH = 100


def json_chunks(value, width: int = 92) -> list[str]:
    """`value` as sorted JSON, cut into Python string literals of at most about `width`
    characters, to be concatenated: any config value (non-finite floats too, as JSON spells
    them) becomes source by repr alone."""
    text = json.dumps(value, sort_keys=True)
    return [repr(text[i:i + width]) for i in range(0, len(text), width)]


def literal(value, col: int = 0, base: int = 0) -> str:
    """`value` as Python source starting at column `col` of a line indented `base`:
    dataclasses by their class name (the module imports them); containers and argument lists
    that do not fit on the line hang under their opening bracket, or, if that is too deep, open
    a block indented four more than the line."""
    flat = _flat(value)
    if col + len(flat) <= WIDTH:
        return flat
    if dataclasses.is_dataclass(value):
        opening, closing = type(value).__name__ + "(", ")"
        items = [(f"{name}=", v) for name, v in _set_fields(value)]
    elif isinstance(value, dict):
        opening, closing = "{", "}"
        items = [(f"{k!r}: ", v) for k, v in value.items()]
    elif isinstance(value, (list, tuple)):
        opening, closing = ("[", "]") if isinstance(value, list) else ("(", ")")
        items = [("", v) for v in value]
        if isinstance(value, tuple) and len(value) == 1:
            closing = ",)"
    else:
        return flat
    hanging = col + len(opening)
    text = opening + _pack(items, hanging) + closing
    inner = base + 4
    block = opening + "\n" + " " * inner + _pack(items, inner) + "\n" + " " * base + closing
    # hang under the bracket where that fits in as few lines as a block would take
    if _fits(text, col) and text.count("\n") <= block.count("\n"):
        return text
    return block


def _pack(items: list[tuple[str, object]], inner: int) -> str:
    """Items separated by commas, as many per line as fit, continuation lines at `inner`."""
    lines, line = [], ""
    for i, (key, v) in enumerate(items):
        text = key + literal(v, inner + len(key), inner) + ("," if i < len(items) - 1 else "")
        if line and "\n" not in text and inner + len(line) + 1 + len(text) <= WIDTH:
            line += " " + text
        else:
            if line:
                lines.append(line)
            line = text
    lines.append(line)
    return ("\n" + " " * inner).join(lines)


def _set_fields(value) -> list[tuple[str, object]]:
    """A dataclass's fields by name, those at their default left out (the call gives them)."""
    def default(f: dataclasses.Field) -> object:
        if f.default_factory is not dataclasses.MISSING:
            return f.default_factory()
        return f.default
    return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)
            if not (f.init and getattr(value, f.name) == default(f))]


def _fits(text: str, col: int) -> bool:
    return all(col * (i == 0) + len(line) <= WIDTH for i, line in enumerate(text.splitlines()))


def _repeating(value: tuple) -> str | None:
    """A long tuple as a short expression where it has one (a layer pattern repeated, an
    arithmetic run of tile offsets), after a prefix of at most 3 items: else None."""
    if len(value) < 8:
        return None
    for first in range(4):
        head, rest = value[:first], value[first:]
        body = None
        for period in range(1, len(rest) // 2 + 1):
            times, extra = divmod(len(rest), period)
            if rest == rest[:period] * times + rest[:extra]:
                body = f"{_items(rest[:period])} * {times}" + (f" + {_items(rest[:extra])}" if extra else "")
                break
        step = rest[1] - rest[0] if all(type(v) is int for v in rest) else 0
        if body is None and step > 0 and all(b - a == step for a, b in zip(rest, rest[1:])):
            body = f"tuple(range({rest[0]}, {rest[-1] + step}, {step}))"
        if body is not None:
            return f"{_items(head)} + {body}" if head else body
    return None


def _items(value: tuple) -> str:
    """A tuple's items written out: also each piece of a shortened one, never itself shortened
    (a period written `A + B * 2` would bind wrongly under its `* N`)."""
    return "(" + ", ".join(_flat(v) for v in value) + ("," if len(value) == 1 else "") + ")"


def _flat(value) -> str:
    if isinstance(value, tuple) and (short := _repeating(value)) is not None:
        return short
    if dataclasses.is_dataclass(value):
        args = ", ".join(f"{name}={_flat(v)}" for name, v in _set_fields(value))
        return f"{type(value).__name__}({args})"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_flat(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ", ".join(_flat(v) for v in value) + "]"
    if isinstance(value, tuple):
        return _items(value)
    return repr(value)


def _streamed(f: ir.StreamFamily) -> StreamedMatrix:
    return StreamedMatrix(f.name, f.rows, f.cols, f.row_tiles, f.col_tiles, f.tile_rows, f.tile_cols,
                          codes=f.codes, fp8_operand=f.fp8_operand, format_class=f.format_class)


def _matrix_name(kind: str, name: str) -> str:
    return f"{kind}_{name}".upper()


class _Name(str):
    """A module constant's name, printed bare inside a literal."""

    def __repr__(self) -> str:
        return str(self)


# The core's resident buffers whose last dim is the hidden size (mkc.resolve makes them).
_HIDDEN_WIDE = ("x", "embed_rows", "head_norm")


def _scratch_shape(b: ir.Buffer, s: ir.ScheduleIR, ring: Ring) -> str:
    """A resident buffer's shape as source: in the module's named constants where it follows
    one (the ring's slots, the vector blocks, the hidden size), else its numbers."""
    if b.cls == "ring" and b.shape == (ring.slots, *ring.slot_shape):
        return "(RING.slots, *RING.slot_shape)"
    if b.name == "vectors" and b.shape == (2, s.parity.rows, s.parity.cols):
        return "(2, VECTORS.rows, VECTORS.cols)"
    source = b.shape_expr("ROWS")
    if b.name in _HIDDEN_WIDE and b.shape[-1] == s.dims["hidden_size"]:
        source = source[:-1].rsplit(", ", 1)[0] + ", HIDDEN)"
    return source


@dataclasses.dataclass
class _StreamPlan:
    """The ring stream's matrix families as the module names them."""

    matrix_literals: list[tuple[str, str]]                 # (constant, its StreamedMatrix)
    order: dict[str, list[_Name]]                          # kind ("tail" last) -> its families
    streamed: dict[str, dict[str, tuple[int, _Name]]]      # kind -> family -> (first tile, name)


def _stream_plan(s: ir.ScheduleIR) -> _StreamPlan:
    st = s.stream
    plan = _StreamPlan([], {}, {})
    for kname, fams in list(st.families.items()) + [("tail", st.tail)]:
        offset = 0
        for f in fams:
            name = _matrix_name(kname, f.name)
            plan.matrix_literals.append((name, literal(_streamed(f), len(name) + 3)))
            plan.order.setdefault(kname, []).append(_Name(name))
            plan.streamed.setdefault(kname, {})[f.name] = (offset, _Name(name))
            offset += f.tiles
    plan.order = {kname: plan.order.get(kname, []) for kname in [*sorted(s.kinds), "tail"]}
    return plan


def _collective_literals(s: ir.ScheduleIR, counter: dict[str, int]
                         ) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """The module constants of the all-reduce stages (the embedding's first) and of the
    gathers, each stage naming its receive buffer and use counter."""

    spans = ir.row_spans([a for k in s.kinds.values() for a in k.allreduces] + [s.embed_reduce],
                         s.rows_max)

    def stage(buf: str, size: int, stride: int) -> Stage:
        return Stage(buf, counter[buf], size, stride)

    def form(a: ir.AllReduce, lo: int, hi: int) -> tuple:
        """The stages of `a` in the kernels of `lo` to `hi` rows."""
        owner = a.owner
        if not a.scattered(lo):
            span = None if hi == s.rows_max else (lo, hi)
            return tuple(stage(ir.AllReduce.buffer_name(a.wire_dtype, size, stride, span, owner),
                               size, stride) for size, stride in a.stages)
        wire, scatters = a.wire_dtype, a.scatter_stages()
        reduce_scatters, gathers = [], []
        # the columns each reduce-scatter takes: an inner gather cuts its result back to them
        taken = [0] + [chunk for _, _, chunk in scatters[:-1]]
        for (size, stride, _), columns in zip(scatters, taken):
            first = stage(ir.AllReduce.role_buffer_name("scatter", wire, size, stride, owner),
                          size, stride)
            sums = stage(ir.AllReduce.role_buffer_name("sums", a.gather_dtype, size, stride,
                                                       owner), size, stride)
            reduce_scatters.append(ReduceScatter(
                first.buffer, ir.AllReduce.staging_name(wire, size, stride, owner),
                first.counter, size, stride))
            gathers.insert(0, GatherSums(sums.buffer, sums.counter, size, stride, columns))
        return (*reduce_scatters,
                *(stage(ir.AllReduce.role_buffer_name("chunk", wire, sz, st, owner), sz, st)
                  for sz, st in a.stages[len(scatters):]),
                *gathers)

    def stages(a: ir.AllReduce) -> tuple | FromRows:
        """Its stages by the kernel's rows: one tuple, or `FromRows` where they change."""
        chosen: tuple | FromRows = form(a, *spans[0])
        last = chosen
        for lo, hi in spans[1:]:
            here = form(a, lo, hi)
            if here != last:
                chosen, last = FromRows(lo, chosen, here), here
        return chosen

    reduce_literals = [("EMBED_REDUCE", literal(stages(s.embed_reduce), 15))]
    gather_literals = []
    for kname in sorted(s.kinds):
        k = s.kinds[kname]
        for a in k.allreduces:
            name = reduce_name(kname, a.after_op)
            reduce_literals.append((name, literal(stages(a), len(name) + 3)))
        for g in k.allgathers:
            buf = ir.AllGather.buffer_name(g.after_op)
            name = gather_name(kname, g.after_op)
            gather_literals.append((name, literal(Stage(buf, counter[buf], g.size, g.stride), len(name) + 3)))
        for e in k.exchanges:
            buf = ir.Exchange.buffer_name(e.after_op)
            name = exchange_name(kname, e.after_op)
            gather_literals.append((name, literal(Stage(buf, counter[buf], 2, 1), len(name) + 3)))
    return reduce_literals, gather_literals


@dataclasses.dataclass
class _KindPlans:
    """Each layer kind's plan and what its state copies and KV caches add to the module."""

    kinds: dict[str, KindPlan] = dataclasses.field(default_factory=dict)
    state_arrays: list[tuple] = dataclasses.field(default_factory=list)   # HBM state and caches
    row_states: list[tuple] = dataclasses.field(default_factory=list)     # (array, batch axis)
    spread_states: list[str] = dataclasses.field(default_factory=list)
    sems: list[str] = dataclasses.field(default_factory=lambda: ["sem__head_norm", "sem__embed"])
    sem_arrays: list[tuple[str, int]] = dataclasses.field(default_factory=list)   # (name, size)
    drains: list[tuple] = dataclasses.field(default_factory=list)


def _kind_plans(s: ir.ScheduleIR, streamed: dict[str, dict[str, tuple[int, _Name]]]) -> _KindPlans:
    plans = _KindPlans()
    for kname in sorted(s.kinds):
        k = s.kinds[kname]
        copies = []
        states = {}
        for t in k.transfers:
            copies.append(StateCopy(t.direction, f"{kname}__{t.state}", t.buffer,
                                    s.buffer(t.buffer).batch_axis or 0))
            states[t.state] = t.buffer
            plans.sems.append(copies[-1].sem)
            plans.drains += [(kname, copies[-1].name, t)] * t.drain
        # KV caches (HBM `<kind>__<cache>`), each streamed through its tile buffer.
        caches = tuple(f"{kname}__{c}" for c in k.kv.caches) if k.kv else ()
        kv_bufs = [s.buffer(b) for b in k.kv.tile_buffers] if k.kv else []
        kv_plan = {}
        if k.kv is not None:
            kv_plan = dict(caches=caches, kv=KvTiles(k.kv.tokens, k.kv.slots, k.kv.ahead,
                                                     k.kv.ring, k.kv.at_start),
                           kv_rows=k.kv.rows_buffer,
                           kv_tiles=k.kv.tile_buffers if k.kv.at_start else ())
        refill = (k.refill.tiles, k.refill.from_rows, k.refill.to_rows) if k.refill else ()
        plans.kinds[kname] = KindPlan(streamed=streamed.get(kname, {}), states=states,
                                      copies=tuple(copies), refill=refill, **kv_plan)
        if k.kv is not None:
            plans.sems.append(plans.kinds[kname].kv_sem)
            plans.sem_arrays += [(f"sem__{b}", k.kv.slots) for b in plans.kinds[kname].kv_tiles]
        for sname in sorted(k.states):
            if any(t.state == sname for t in k.transfers):
                buf = s.buffer(states[sname])
                plans.state_arrays.append((f"{kname}__{sname}", kname, buf.shape_expr("ROWS"),
                                           DTYPE_SOURCE[buf.dtype]))
                plans.row_states.append((f"{kname}__{sname}", buf.batch_axis))
                if spread_on_host(buf.batch_axis, len(buf.shape)):
                    plans.spread_states.append(f"{kname}__{sname}")
        for c, b in zip(caches, kv_bufs):
            tokens = k.kv.ring or "CONTEXT"       # a window's KV ring: its slots, not the context
            plans.state_arrays.append((c, kname, f"(SEQS, {tokens}, {b.shape[-1]})", DTYPE_SOURCE[b.dtype]))
    return plans


def _scratch_shapes(s: ir.ScheduleIR, ring: Ring, sems: list[str], collectives: list[ir.Buffer],
                    sem_arrays: list[tuple[str, int]] = ()) -> list[tuple[str, str, str]]:
    """(name, source, comment) of the resident VMEM buffers, the ring's, vectors' and copies'
    semaphores and the collectives' send and receive semaphores, in operand order."""
    resident = [b for b in s.buffers if b.scope is None and b.cls != "output"]
    scratch = [(b.name, f"vmem({_scratch_shape(b, s, ring)}, {DTYPE_SOURCE[b.dtype]}{_rows(b)})",
                b.cls) for b in resident]
    scratch += [("ring_sem", "dma_sems((RING.slots,))", ""),
                ("vectors_sem", "dma_sems((2,))", "")]
    scratch += [(n, "dma_sems()", "") for n in sems]
    scratch += [(n, f"dma_sems(({size},))", "") for n, size in sem_arrays]
    for b in collectives:
        scratch += [(b.name + "__send", f"dma_sems((2, {b.shape[1]}){_rows(b)})", ""),
                    (b.name + "__recv", f"dma_sems((2, {b.shape[1]}){_rows(b)})", "")]
    scratch.append(("collective_count", "smem((max(1, N_COLLECTIVE_COUNTERS),), jnp.int32)",
                    "use counters"))
    return scratch


def _rows(b: ir.Buffer) -> str:
    """The `rows=` argument of a scratch entry only some kernel widths allocate."""
    return "" if b.rows is None else f", rows={b.rows}"


def _weight_view(s: ir.ScheduleIR) -> tuple[WeightView | None, list[tuple], list[tuple]]:
    """A weight view: each kind's pooled matrices, prefetched by the layer before. Returns the
    view, its HBM inputs and its scratch (none without one)."""
    weight_views = [v for p in s.pools for v in p.views if v.slots == 0]
    if not weight_views:
        return None, [], []
    v = weight_views[0]
    row = ir.POOL_ROW_BYTES
    weight_view = WeightView(v.pool, {kind: {m.name: (m.offset // row, m.rows, m.cols, i)
                                             for i, m in enumerate(mats)}
                                      for kind, mats in sorted(v.matrices.items())})
    pooled_inputs = [(f"pool__{kind}__{m.name}", kind,
                      (ir.panel_rows(m.rows, m.dtype), -(-m.cols // ir.LANES) * ir.LANES))
                     for kind, mats in sorted(v.matrices.items()) for m in mats]
    copies = max(len(m) for m in v.matrices.values())
    return weight_view, pooled_inputs, [("pool_sem", f"dma_sems(({copies},))",
                                         "pooled matrix copies")]


def _expert_slots(s: ir.ScheduleIR) -> tuple[ExpertSlots | dict | None, list[tuple], list[tuple]]:
    """Routed experts: the kinds that run them fetch them into a pool's slot view, each layout
    (`ScheduleIR.experts_of`) into its own. Returns the slots (one `ExpertSlots`, or one per
    fetching kind where the kinds hold them in several layouts), their HBM inputs (name, kind,
    the slots' constant) and their scratch (none without routed experts)."""
    fetching = s.expert_kinds()
    if not fetching:
        return None, [], []
    row = ir.POOL_ROW_BYTES
    by_kind: dict[str, ExpertSlots] = {}
    for kname in fetching:
        f = s.kinds[kname].fetch
        view = s.pool_view(f"{f.pool}.{f.view}")
        mats = view.matrices["expert"]
        by_kind[kname] = ExpertSlots(
            pool=f.pool, slots=view.slots, slot_rows=view.slot_bytes // row,
            matrices={m.name: (m.offset // row, m.rows, m.cols) for m in mats},
            local_experts=s.per_rank["local_experts"], group_size=s.per_rank.get("expert_tp", 1),
            top_k=s.top_k, stacked=tuple(m.name for m in mats if m.stacked),
            hbm=experts.input_name(kname, kname == fetching[0]),
            formats=dict(sorted(s.kind_weight_formats.get(kname, {}).items())))
    one = len(fetching) == 1
    constant = {k: "EXPERTS" if one else f"EXPERTS[{k!r}]" for k in fetching}
    # Per kind, one HBM array of every local expert's slot image (its layers', indexed by the
    # layer's place among them): one copy, one semaphore per slot.
    expert_inputs = [(es.hbm, k, (f"{constant[k]}.slot_rows", str(ir.LANES)), constant[k])
                     for k, es in by_kind.items()]
    slots = max(es.slots for es in by_kind.values())
    scratch = [("expert_sem", f"dma_sems(({slots},))", "expert slot copies"),
               ("expert_list", f"smem(({constant[fetching[0]]}.local_experts,), jnp.int32)",
                "picked local experts"),
               ("expert_count", "smem((1,), jnp.int32)", "how many")]
    return (by_kind[fetching[0]] if one else by_kind), expert_inputs, scratch


def context(s: ir.ScheduleIR) -> dict:
    kind_ids = {name: i for i, name in enumerate(sorted(s.kinds))}
    st = s.stream
    stream = _stream_plan(s)
    # the collectives' receive buffers, each with its semaphores and use counter (a
    # reduce-scatter's send staging is read by its copies only)
    collectives = [b for b in s.buffers if b.cls == "collective" and not ir.is_staging(b.name)]
    reduce_literals, gather_literals = _collective_literals(
        s, {b.name: i for i, b in enumerate(collectives)})
    plans = _kind_plans(s, stream.streamed)
    ring = Ring(st.slots, st.ahead, st.total_tiles, tuple(tuple(t) for t in st.tile_shapes))
    weight_view, pooled_inputs, view_scratch = _weight_view(s)
    expert_slots, expert_inputs, expert_scratch = _expert_slots(s)
    dims_fields = {key: (tuple(v) if isinstance(v, list) else v) for key, v in s.dims.items()}
    dims_class = dataclasses.make_dataclass(s.dims_class[1], list(dims_fields))
    parity = s.parity
    return {
        "family_package": s.family_package, "dims_import": s.dims_class,
        "dims_literal": literal(dims_class(**dims_fields), 7),
        "config_chunks": json_chunks(s.model_config),
        "per_rank_literal": literal(dict(sorted(s.per_rank.items())), 11),
        "formats_literal": literal(dict(sorted(s.weight_formats.items())), 10),
        "shards_literal": literal(ShardTable.of(s.shards, s.ranks), 9),
        "kind_ids": kind_ids,
        "layer_kind_literal": literal(tuple(kind_ids[k] for k in s.layer_kinds), 13),
        "tile_offset_literal": literal(tuple(st.layer_tile_offset), 20),
        "matrix_literals": stream.matrix_literals,
        "ring_literal": literal(ring, 7),
        "stream_order_literal": literal(stream.order, 15),
        "vectors_literal": literal(Parity(parity.ahead, parity.rows, parity.cols,
                                          {k: {n: tuple(v) for n, v in fams.items()}
                                           for k, fams in parity.layout.items()}), 10),
        "reduce_literals": reduce_literals,
        "collective_imports": ", ".join(
            n for n in ("FromRows", "GatherSums", "ReduceScatter", "Stage")
            if n == "Stage" or any(f"{n}(" in lit for _, lit in reduce_literals)),
        "collectives": collectives,
        "kinds_literal": literal(plans.kinds, 8),
        "scratch_shapes": (_scratch_shapes(s, ring, plans.sems, collectives, plans.sem_arrays)
                           + view_scratch + expert_scratch),
        "layer_bodies": [(kname, layer_source(s, kname)) for kname in s.kinds],
        "drains": plans.drains,
        "tail_name": _matrix_name("tail", st.tail[0].name),
        "state_arrays": plans.state_arrays,
        "row_states_literal": literal(dict(plans.row_states), 13),
        "spread_states_literal": literal(tuple(plans.spread_states), 20),
        "vmem_inputs": [(b.name, b.shape_expr("ROWS"), DTYPE_SOURCE[b.dtype]) for b in s.vmem_inputs],
        "experts_literal": literal(expert_slots, 10),
        "expert_inputs": expert_inputs,
        "view_literal": literal(weight_view, 7),
        "pooled_inputs": pooled_inputs,
        "gather_literals": gather_literals,
    }
