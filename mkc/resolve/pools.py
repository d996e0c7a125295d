"""Pass `pools`: `pool NAME { view ... }`, time-shared VMEM regions whose views hold whole
matrices (a layer kind's, or routed experts' in slots)."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.lang.statements.pool import PoolView
from mkc.model.graph import DecodeGraph
from mkc.resolve.names import unknown, validate_identifier
from mkc.resolve.state import ResolveState


def pooled_bytes(rows: int, cols: int, dtype: str, stacked: bool = False) -> int:
    """Bytes of a matrix in a pool; the layout (128-lane bf16 column panels of whole tiles, or
    stacked; u8 data two rows per element) is defined once, in `mkc.runtime.pool`."""
    return ir.pooled_rows(rows, cols, dtype, stacked) * ir.POOL_ROW_BYTES


def expert_slot_bytes(graph: DecodeGraph) -> int:
    """Bytes of one routed expert's slot: its matrices one after another, each in pool form.
    HBM holds each local expert as this image (`mkc.runtime.experts.pack_expert`)."""
    return sum(pooled_bytes(*t.shape, t.dtype, t.stacked) for t in graph.experts.values())


def resolve_pools(s: ResolveState) -> ResolveState:
    """The pools and, per layer kind, which matrix family lives in which `pool.view`."""
    graph = s.graph
    pools: list[ir.Pool] = []
    pooled: dict[str, dict[str, str]] = {}
    for p in s.sched.pools:
        pname = validate_identifier(p.name, "pool", graph)
        if any(q.name == pname for q in pools):
            raise fail("E-DUPLICATE", f"pool '{pname}' is declared twice", p.name.span,
                       hint="give each pool its own name")
        views: list[ir.PoolView] = []
        for v in p.views:
            vname = validate_identifier(v.name, "pool view")
            if any(w.name == vname for w in views):
                raise fail("E-DUPLICATE", f"view '{vname}' of pool {pname} is declared twice",
                           v.name.span, hint="give each view its own name")
            if v.slot_of is not None:
                views.append(_slot_view(v, vname, pname, graph))
            else:
                views.append(_weight_view(v, vname, pname, graph, pooled))
        pools.append(ir.Pool(pname, max(v.nbytes for v in views), views, p.span))
    return replace(s, pools=pools, pooled=pooled)


def _slot_view(v: PoolView, vname: str, pname: str, graph: DecodeGraph) -> ir.PoolView:
    """`view NAME: N slots of expert`: room for N routed experts' matrices."""
    if v.slot_of.text != "expert":
        raise unknown("slot content", v.slot_of, ["expert"])
    if not graph.experts:
        raise fail("E-POOL", f"{graph.dims.name} has no routed experts to hold",
                   v.slot_of.span, hint="remove the slot view")
    if v.slots < 1:
        raise fail("E-POOL", "a slot view needs at least one slot", v.span,
                   hint="e.g. `view experts: 4 slots of expert`")
    mats, off = [], 0
    for t in graph.experts.values():
        mats.append(ir.PooledMatrix("expert", t.name, t.shape[0], t.shape[1], t.dtype, off,
                                    t.stacked))
        off += pooled_bytes(*t.shape, t.dtype, t.stacked)
    return ir.PoolView(vname, pname, {"expert": mats}, v.slots, off, off * v.slots, v.span)


def _weight_view(v: PoolView, vname: str, pname: str, graph: DecodeGraph,
                 pooled: dict[str, dict[str, str]]) -> ir.PoolView:
    """`view NAME: KIND(FAMILIES), ...`: one layer's matrices of each kind listed, at a
    time. Records in `pooled` where each matrix lives."""
    matrices: dict[str, list[ir.PooledMatrix]] = {}
    for vk in v.kinds:
        kname = vk.kind.text
        if kname not in graph.kinds:
            raise unknown("layer kind", vk.kind, sorted(graph.kinds))
        if kname in matrices:
            raise fail("E-DUPLICATE", f"{kname} is listed twice in view {vname}",
                       vk.kind.span, hint="list each kind's matrices once")
        kind = graph.kinds[kname]
        order = [t.name for t in kind.tensors.values() if t.role == "matrix"]
        mats, off = [], 0
        for n in vk.families:
            if n.text not in order:
                raise unknown(f"matrix family of {kname}", n, order)
            if n.text in pooled.get(kname, {}):
                raise fail("E-DUPLICATE", f"{kname}.{n.text} is already held in "
                           f"{pooled[kname][n.text]}", n.span, hint="a matrix lives in one view")
            t = kind.tensors[n.text]
            mats.append(ir.PooledMatrix(kname, t.name, t.shape[0], t.shape[1], t.dtype, off))
            off += pooled_bytes(*t.shape, t.dtype)
            pooled.setdefault(kname, {})[n.text] = f"{pname}.{vname}"
        matrices[kname] = mats
    return ir.PoolView(vname, pname, matrices, 0, 0,
                       max(sum(pooled_bytes(m.rows, m.cols, m.dtype) for m in ms)
                           for ms in matrices.values()), v.span)
