"""Pass `collectives`: each phase's all-reduces of partial sums, all-gathers and sibling
exchanges of column-split products, the embedding's exact all-reduce, and the receive
buffers they use."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir, target
from mkc.diagnostics import Span, fail
from mkc.lang import ast
from mkc.lang.statements.collectives import AllReduce, sibling_swap_text
from mkc.model.graph import LayerKind, ShardingError
from mkc.model.sharding import ShardTable
from mkc.resolve.names import unknown
from mkc.resolve.sharding import group
from mkc.resolve.state import KindCollectives, ResolveState, widest_rows

ALLREDUCE_ALGORITHMS = ("direct", "two_level")
TWO_LEVEL_GROUPS = ("chip", "host")
WIRE_DTYPES = ("bf16", "f32")
# An all-gathered product travels and is received in bf16 (the spec has no wire word for it);
# its receive buffer and the step-time model's bytes both follow this.
GATHER_WIRE = "bf16"


def resolve_collectives(s: ResolveState) -> ResolveState:
    B = s.batch[1]
    rows_max = widest_rows(s)
    rules = {c: (w, st) for c, w, st in s.shards.rules}
    collectives: dict[str, KindCollectives] = {}
    for kname, ks in s.phase_schedules.items():
        phase, kind = s.phases[kname], s.graph.kinds[kname]
        allreduces = _allreduces(phase, kind, s.topology, s.shards, rows_max)
        gathers, exchanges, buffers = _gathers(phase, kind, s.topology, s.mesh_axis, B, rules)
        scopes = [b.scope for b in s.kind_buffers[kname] if b.scope]
        overlapped = {n.text: n.span for line in (*phase.allreduces, *phase.allgathers)
                      if line.overlap for n in line.ops}
        reader = {op: ks.ops[overlap_window(ks, op, scopes, span)[1]] for op, span in overlapped.items()}
        collectives[kname] = KindCollectives(
            allreduces=[replace(a, finish_before=reader.get(a.after_op)) for a in allreduces],
            allgathers=[replace(g, finish_before=reader.get(g.after_op)) for g in gathers],
            exchanges=exchanges, buffers=tuple(buffers))
    embed_reduce = _embed_reduce(s, collectives)
    return replace(s, collectives=collectives, embed_reduce=embed_reduce,
                   reduce_buffers=_receive_buffers(collectives, embed_reduce, B, rows_max))


def overlap_window(k: ir.KindSchedule, op: str, scopes: list[tuple[str, int, int]],
                   span: Span) -> tuple[int, int]:
    """(i, j): an overlapped collective after op i finishes before op j, the first op reading
    its result; ops i + 1 .. j - 1 compute while it runs (`span`: the op's name on the
    collective's line). Refused where no op lies between,
    where nothing in the layer reads it, or where the window crosses a `scoped` range's edge
    (a collective in flight cannot pass a `pl.run_scoped` boundary)."""
    i = k.ops.index(op)
    value = k.op_values[op][1][0]
    j = next((m for m in range(i + 1, len(k.ops)) if value in k.op_values[k.ops[m]][0]), None)
    if j is None:
        raise fail("E-OVERLAP", f"no later op of {k.name} reads {op}'s result; an overlapped "
                   "collective finishes before its first reader", span, hint="drop `overlap`")
    if j == i + 1:
        raise fail("E-OVERLAP", f"{k.ops[j]} reads {op}'s result right after it: no op computes "
                   "while the collective runs", span,
                   hint="drop `overlap`, or overlap a collective whose result is read later")
    for _, first, last in scopes:
        # a scope covers points first..last+1; the collective starts after op i and finishes
        # at point j, before that point's copies and scopes
        if any(i < edge < j for edge in (first, last + 1)):
            raise fail("E-OVERLAP", f"the collective after {op} would run across an edge of the "
                       f"scoped range of ops {k.ops[first]} to {k.ops[last]}: a collective in "
                       "flight cannot cross a pl.run_scoped boundary", span,
                       hint="drop `overlap`, or keep the scoped range's ends out of ops "
                            f"{k.ops[i + 1]} to {k.ops[j - 1]}")
    return i, j


def _embed_reduce(s: ResolveState, kinds: dict[str, KindCollectives]) -> ir.AllReduce:
    """The vocab-sharded embedding lookup is an exact all-reduce over the vocab group (one rank
    of it holds each row): it reuses the first all-reduce over that group (the first layer's
    first, on a whole-mesh vocabulary), so it adds no receive buffer, and scatters as that
    one does."""
    H = s.dims.hidden_size
    vocab_group = s.shards.rule("vocab")
    same_group = [a for k in dict.fromkeys(s.dims.layer_kinds) for a in kinds[k].allreduces
                  if _group_of(a.stages) == vocab_group]
    if not same_group:
        return ir.AllReduce("embed", "direct", "bf16", (vocab_group,), H)
    return replace(same_group[0], after_op="embed", width=H, finish_before=None)


def reduced_width(kind: LayerKind, op: str) -> int:
    """Columns of an op's output (what an all-reduce after it moves)."""
    o = kind.ops[kind.op_names().index(op)]
    return o.width or (kind.tensors[o.matmul].shape[1] if o.matmul else 0)


def _receive_buffers(kinds: dict[str, KindCollectives], embed_reduce: ir.AllReduce, B: int,
                     rows_max: int) -> tuple[ir.Buffer, ...]:
    """The all-reduces' buffers, each as wide as the widest payload of its uses and in the
    kernels whose rows use it (`Buffer.rows`): per group, one-shot stages' receive slots for
    each span of kernel widths between the rows all-reduces scatter from (`ir.row_spans`);
    where an all-reduce scatters, each reduce-scattering group's slots (`scatter`), send
    staging and all-gather of the sums in the gather dtype (`sums`), and the later stages'
    slots for chunks (`chunk`)."""
    reduces = [a for k in kinds.values() for a in k.allreduces] + [embed_reduce]
    spans = ir.row_spans(reduces, rows_max)
    found: dict[tuple, tuple[int, int, int]] = {}     # (role, wire, size, stride) -> (width, rows)

    def use(a: ir.AllReduce, role: tuple, wire: str, group: tuple[int, int], width: int,
            lo: int, hi: int) -> None:
        key = (a.owner or "", role, wire, *group)
        w, x, y = found.get(key, (0, lo, hi))
        found[key] = (max(w, width), min(x, lo), max(y, hi))

    for a in reduces:
        for lo, hi in spans:
            if not a.scattered(lo):
                for group in a.stages:
                    use(a, (0, lo, hi), a.wire_dtype, group, a.width, lo, hi)
                continue
            scatters = a.scatter_stages()
            for size, stride, chunk in scatters:
                use(a, (1, "scatter"), a.wire_dtype, (size, stride), chunk, lo, hi)
                use(a, (3, "sums"), a.gather_dtype, (size, stride), chunk, lo, hi)
            for group in a.stages[len(scatters):]:
                use(a, (2, "chunk"), a.wire_dtype, group, scatters[-1][2], lo, hi)
    out = []
    for (owner, role, wire, size, stride), (w, lo, hi) in sorted(found.items()):
        rows = None if (lo, hi) == (1, rows_max) else (lo, hi)
        owner = owner or None
        if role[0] == 0:
            name = ir.AllReduce.buffer_name(wire, size, stride,
                                            None if hi == rows_max else (lo, hi), owner)
        else:
            name = ir.AllReduce.role_buffer_name(role[1], wire, size, stride, owner)
        out.append(ir.Buffer(name, "collective", (2, size, B, w), wire, batch_axis=2, rows=rows))
        if role[-1] == "scatter":
            out.append(ir.Buffer(ir.AllReduce.staging_name(wire, size, stride, owner),
                                 "collective", (size, B, w), wire, batch_axis=1, rows=rows))
    return tuple(out)


def _allreduces(phase: ast.Phase, kind: LayerKind, topo: target.Topology, shards: ShardTable,
                rows_max: int) -> list[ir.AllReduce]:
    """`allreduce OPS ALGORITHM wire DTYPE [scatter [from N rows]]`: every op leaving partial
    sums is reduced once, over the ranks holding its parts."""
    kname, ops = kind.name, kind.op_names()
    partial_over = {o.name: o.partial or (kind.tensors[o.matmul].partial_out if o.matmul else ())
                    for o in kind.ops}
    partial_ops = [o for o, classes in partial_over.items() if classes]
    width_of = {o.name: reduced_width(kind, o.name) for o in kind.ops}
    allreduces: list[ir.AllReduce] = []
    for ar in phase.allreduces:
        if ar.algorithm.text not in ALLREDUCE_ALGORITHMS:
            raise unknown("all-reduce algorithm", ar.algorithm, list(ALLREDUCE_ALGORITHMS))
        if ar.wire_dtype.text not in WIRE_DTYPES:
            raise unknown("wire dtype", ar.wire_dtype, list(WIRE_DTYPES))
        for n in ar.ops:
            if n.text not in ops:
                raise unknown(f"op of layer kind {kname}", n, ops)
            if n.text not in partial_ops:
                raise fail("E-COLLECTIVE", f"{n.text} does not produce partial sums; nothing to "
                           "all-reduce", n.span,
                           hint=f"ops of {kname} with partial outputs: {', '.join(partial_ops)}")
            if any(a.after_op == n.text for a in allreduces):
                raise fail("E-DUPLICATE", f"{n.text} is all-reduced twice", n.span,
                           hint="list each op in one allreduce")
            try:
                over = shards.reduction_group(partial_over[n.text])
            except ShardingError as e:
                raise fail("E-SHARD", f"{kname}.{n.text}: {e}", n.span,
                           hint="shard those classes over nested groups (one `tp / N`, the "
                                "other `over N`)") from None
            stages = _stages(ar, topo, over, n.text)
            allreduces.append(ir.AllReduce(n.text, ar.algorithm.text, ar.wire_dtype.text,
                                           stages, width_of[n.text], ar.span,
                                           _scatter_from(ar, rows_max),
                                           nested=_nested(ar, stages),
                                           gather_dtype=_gather_dtype(ar)))
    for p_op in partial_ops:
        if not any(a.after_op == p_op for a in allreduces):
            # Point at the allreduce line to extend, or the phase to add one to.
            raise fail("E-COLLECTIVE", f"{kname}.{p_op} leaves partial sums that nothing reduces",
                       phase.allreduces[0].span if phase.allreduces else phase.kind.span,
                       hint=f"add `allreduce {', '.join(partial_ops)} direct wire bf16`")
    return allreduces


def _scatter_from(ar: AllReduce, rows_max: int) -> int | None:
    """The rows from which `ar` runs scattered (None: never): some kernel must have the
    rows. Any width scatters: a chunk is padded to whole lane tiles (`ir.scatter_chunk`)."""
    sc = ar.scatter
    if sc is None:
        return None
    rows = 1 if sc.rows is None else sc.rows
    if rows < 1:
        raise fail("E-COLLECTIVE", f"scatter from {rows} rows: every kernel has at least one "
                   "row", sc.span, hint="write `scatter` to scatter at every kernel width, or "
                   f"`scatter from N rows` with N from 2 to {rows_max}")
    if rows > rows_max:
        raise fail("E-COLLECTIVE", f"scatter from {rows} rows: no kernel of this spec has that "
                   f"many (its widest, of the batch range and verify step, has {rows_max})",
                   sc.span, hint=f"write `scatter from N rows` with N up to {rows_max}, or drop "
                   "`scatter` to keep the one-shot stages")
    return rows


def _nested(ar: AllReduce, stages: tuple[tuple[int, int], ...]) -> bool:
    """`scatter nested`: each stage reduce-scatters, which needs a second stage to nest."""
    sc = ar.scatter
    if sc is None or sc.nested is None:
        return False
    if len(stages) < 2:
        raise fail("E-COLLECTIVE", f"scatter nested: a {ar.algorithm.text} all-reduce has one "
                   "stage, nothing to nest in it", sc.nested.span,
                   hint="drop `nested`, or nest the stages of a `two_level chip` or "
                        "`two_level host` all-reduce")
    return True


def _gather_dtype(ar: AllReduce) -> str:
    """`scatter gather DTYPE`: the dtype the scattered form's sums travel back in."""
    sc = ar.scatter
    if sc is None or sc.gather is None:
        return "f32"
    if sc.gather.text not in WIRE_DTYPES:
        raise unknown("gather dtype", sc.gather, list(WIRE_DTYPES))
    return sc.gather.text


def algorithm_stages(topo: target.Topology, over: tuple[int, int]
                     ) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    """Every algorithm's spelling and stages for the group `over` on this topology."""
    out = [("direct", (over,))]
    for level, cores in (("chip", topo.chip.cores_per_chip), ("host", topo.cores_per_host)):
        stages = two_level_stages(*over, cores)
        if stages is not None:
            out.append((f"two_level {level}", stages))
    return out


def two_level_stages(size: int, stride: int, level_cores: int) -> tuple[tuple[int, int], ...] | None:
    """The stages of a two-level all-reduce over the group (size, stride) whose first level
    is the group's members within each `level_cores` consecutive ranks (a chip, a host), or
    None when that level would hold one member or the whole group."""
    if level_cores % stride:
        return None
    first = level_cores // stride
    if first <= 1 or first >= size or size % first:
        return None
    return ((first, stride), (size // first, level_cores))


def _stages(ar: AllReduce, topo: target.Topology, over: tuple[int, int], op: str
            ) -> tuple[tuple[int, int], ...]:
    """The direct stages of `ar` reducing `op`'s partial sums over the rank group `over`."""
    n = topo.num_cores
    size, stride = over
    if ar.algorithm.text == "direct":
        if ar.level is not None:
            raise fail("E-COLLECTIVE", f"a direct all-reduce takes no group ('{ar.level.text}')",
                       ar.level.span, hint="write `direct wire bf16`, or `two_level chip`")
        return (over,)
    if ar.level is None or ar.level.text not in TWO_LEVEL_GROUPS:
        where = ar.level.span if ar.level else ar.algorithm.span
        raise fail("E-COLLECTIVE", "a two_level all-reduce needs its first-level group",
                   where, hint="write `two_level chip` or `two_level host`")
    if ar.level.text == "chip" and topo.chip.cores_per_chip == 1:
        raise fail("E-COLLECTIVE", f"two_level chip reduces over the sibling cores of a chip, "
                   f"but a {topo.chip.name} chip is one rank: there is no sibling level",
                   ar.level.span,
                   hint="use `direct`" + (" or `two_level host`" if 1 < topo.cores_per_host < n
                                          else ""))
    level_cores = (topo.chip.cores_per_chip if ar.level.text == "chip"
                   else topo.cores_per_host)
    stages = two_level_stages(size, stride, level_cores)
    if stages is None:
        valid = [lv for lv, c in (("chip", topo.chip.cores_per_chip),
                                  ("host", topo.cores_per_host)) if two_level_stages(size, stride, c)]
        where = (f"on this topology ({level_cores} of {n} cores per {ar.level.text})"
                 if over == (n, 1) else
                 f"for {op} on this topology: its parts are on {size} ranks"
                 + (f" of stride {stride}" if stride > 1 else "")
                 + f", {level_cores} cores per {ar.level.text}")
        raise fail("E-COLLECTIVE", f"two_level {ar.level.text} has a single level {where}",
                   ar.level.span,
                   hint="use `direct`" + "".join(f" or `two_level {lv}`" for lv in valid)
                   + (f"; or reduce {op} on a line of its own" if over != (n, 1) else ""))
    return stages


def _group_of(stages: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The rank group (size, stride) a sequence of all-reduce stages reduces over."""
    size = 1
    for s, _ in stages:
        size *= s
    return (size, stages[0][1])


def _gathers(phase: ast.Phase, kind: LayerKind, topo: target.Topology, axis: str, B: int,
             rules: dict[str, tuple[int, int]]
             ) -> tuple[list[ir.AllGather], list[ir.Exchange], list[ir.Buffer]]:
    """All-gathers and sibling exchanges: every op whose product is column-split by a shard
    rule needs exactly one, over exactly that rule's group."""
    split = {o.name: cls for o in kind.ops if o.matmul and (cls := kind.tensors[o.matmul].split_out)
             and rules[cls][0] > 1}            # a 1-way split is whole
    done: dict[str, Span] = {}          # op -> the line that gathers it
    gathers, gather_buffers = _allgathers(phase, kind, split, done, topo, axis, B, rules)
    exchanges, exchange_buffers = _exchanges(phase, kind, split, done, topo, B, rules)
    for op_name, cls in split.items():
        if op_name not in done:
            sibling = rules[cls] == (topo.chip.cores_per_chip, 1)
            how = sibling_swap_text("f32") if sibling else "allgather {} over ..."
            lines = phase.exchanges if sibling else phase.allgathers
            raise fail("E-COLLECTIVE", f"{kind.name}.{op_name} leaves its output split "
                       f"{rules[cls][0]} ways (`shard {cls}`) and nothing gathers it",
                       lines[0].span if lines else phase.kind.span, hint=f"add `{how.format(op_name)}`")
    return gathers, exchanges, gather_buffers + exchange_buffers


def _gathered_op(n: ast.Name, span: Span, kind: LayerKind, split: dict[str, str],
                 done: dict[str, Span]) -> tuple[str, int]:
    """(shard class, width) of an op a gather line names; records it in `done`."""
    ops = kind.op_names()
    if n.text not in ops:
        raise unknown(f"op of layer kind {kind.name}", n, ops)
    if n.text not in split:
        raise fail("E-COLLECTIVE", f"{n.text} does not produce column shards; nothing to "
                   "gather", n.span, hint=f"ops of {kind.name} with split outputs: "
                   + (", ".join(split) or "none"))
    if n.text in done:
        raise fail("E-DUPLICATE", f"{n.text} is gathered twice", n.span,
                   hint=f"the first is at line {done[n.text].line}")
    done[n.text] = span
    return split[n.text], kind.tensors[kind.ops[ops.index(n.text)].matmul].shape[1]


def _allgathers(phase: ast.Phase, kind: LayerKind, split: dict[str, str], done: dict[str, Span],
                topo: target.Topology, axis: str, B: int, rules: dict[str, tuple[int, int]]
                ) -> tuple[list[ir.AllGather], list[ir.Buffer]]:
    gathers, buffers = [], []
    for ag in phase.allgathers:
        size, stride = group(ag.group, axis, topo)
        for n in ag.ops:
            cls, width = _gathered_op(n, ag.span, kind, split, done)
            if (size, stride) != rules[cls]:
                raise fail("E-COLLECTIVE", f"{n.text} is split {rules[cls][0]} ways by "
                           f"`shard {cls}`, but this gathers over {size} ranks", ag.group.span,
                           hint="gather over the group the shard rule names")
            gathers.append(ir.AllGather(n.text, size, stride, width, GATHER_WIRE, ag.span))
            buffers.append(ir.Buffer(ir.AllGather.buffer_name(n.text), "collective",
                                     (2, size, B, width), GATHER_WIRE, batch_axis=2, span=ag.span))
    return gathers, buffers


def _exchanges(phase: ast.Phase, kind: LayerKind, split: dict[str, str], done: dict[str, Span],
               topo: target.Topology, B: int, rules: dict[str, tuple[int, int]]
               ) -> tuple[list[ir.Exchange], list[ir.Buffer]]:
    cores = topo.chip.cores_per_chip
    exchanges, buffers = [], []
    for ex in phase.exchanges:
        if ex.peer.text != "sibling":
            raise unknown("exchange peer", ex.peer, ["sibling"])
        if cores == 1:
            raise fail("E-COLLECTIVE", f"a {topo.chip.name} chip is one rank: it has no sibling "
                       "core to exchange with", ex.peer.span,
                       hint="shard the op over a rank group and `allgather` it over that group")
        if ex.wire_dtype.text not in WIRE_DTYPES:
            raise unknown("wire dtype", ex.wire_dtype, list(WIRE_DTYPES))
        for n in ex.ops:
            cls, width = _gathered_op(n, ex.span, kind, split, done)
            if rules[cls] != (cores, 1):
                raise fail("E-COLLECTIVE", f"{n.text} is split {rules[cls][0]} ways by "
                           f"`shard {cls}`; a sibling exchange joins the {cores} cores of a "
                           "chip", ex.span,
                           hint=f"write `shard {cls} over chip`, or gather over the rule's group")
            exchanges.append(ir.Exchange(n.text, width, ex.wire_dtype.text, ex.span))
            buffers.append(ir.Buffer(ir.Exchange.buffer_name(n.text), "collective",
                                     (2, cores, B, width), ex.wire_dtype.text,
                                     batch_axis=2, span=ex.span))
    return exchanges, buffers

