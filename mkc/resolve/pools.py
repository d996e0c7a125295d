"""Pass `pools`: `pool NAME { view ... }`, time-shared VMEM regions whose views hold whole
matrices (a layer kind's, or routed experts' in slots)."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.lang.statements.pool import PoolView
from mkc.model.graph import DecodeGraph
from mkc.resolve.names import unknown, unused_kind, validate_identifier
from mkc.resolve.state import ResolveState


def pooled_bytes(rows: int, cols: int, dtype: str, stacked: bool = False) -> int:
    """Bytes of a matrix in a pool; the layout (128-lane bf16 column panels of whole tiles, or
    stacked; u8 data two rows per element) is defined once, in `mkc.runtime.pool`."""
    return ir.pooled_rows(rows, cols, dtype, stacked) * ir.POOL_ROW_BYTES


def expert_slot_bytes(graph: DecodeGraph, kind: str) -> int:
    """Bytes of one routed expert's slot in layer kind `kind`: its matrices one after another,
    each in pool form. HBM holds each local expert as this image
    (`mkc.runtime.experts.pack_expert`)."""
    return sum(pooled_bytes(*t.shape, t.dtype, t.stacked) for t in graph.experts_of(kind).values())


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
                views.append(_slot_view(v, vname, pname, graph, _fetching(s, f"{pname}.{vname}")))
            else:
                views.append(_weight_view(v, vname, pname, graph, pooled,
                                          [k for k in v.kinds if unused_kind(s, k.kind.text)]))
        pools.append(ir.Pool(pname, max(v.nbytes for v in views), views, p.span))
    return replace(s, pools=pools, pooled=pooled)


def _fetching(s: ResolveState, view: str) -> list[str]:
    """The layer kinds whose phase fetches routed experts into `view` ("pool.view")."""
    return [k for k, ph in s.phases.items() if any(f.view.text == view for f in ph.fetches)]


def _slot_view(v: PoolView, vname: str, pname: str, graph: DecodeGraph, kinds: list[str]
               ) -> ir.PoolView:
    """`view NAME: N slots of expert`: room for N routed experts' matrices, as the kinds that
    fetch into it hold them (one layout: a kind holding its experts in another has a view of
    its own)."""
    if v.slot_of.text != "expert":
        raise unknown("slot content", v.slot_of, ["expert"])
    if not graph.experts:
        raise fail("E-POOL", f"{graph.dims.name} has no routed experts to hold",
                   v.slot_of.span, hint="remove the slot view")
    if v.slots < 1:
        raise fail("E-POOL", "a slot view needs at least one slot", v.span,
                   hint="e.g. `view experts: 4 slots of expert`")
    layouts = {k: graph.experts_of(k) for k in kinds}
    if len({tuple((n, x.shape, x.dtype) for n, x in e.items()) for e in layouts.values()}) > 1:
        raise fail("E-POOL", f"view {vname} holds the routed experts of {', '.join(kinds)}, whose "
                   "experts are held in different layouts ("
                   + "; ".join(f"{k}: {_layout(e)}" for k, e in layouts.items()) + ")", v.span,
                   hint="give each layout a slot view of its own, e.g. `view experts_" + kinds[-1]
                        + ": 1 slot of expert`, and fetch each kind's experts into its own")
    mats, off = [], 0
    for t in (next(iter(layouts.values())) if layouts else graph.experts).values():
        mats.append(ir.PooledMatrix("expert", t.name, t.shape[0], t.shape[1], t.dtype, off,
                                    t.stacked))
        off += pooled_bytes(*t.shape, t.dtype, t.stacked)
    return ir.PoolView(vname, pname, {"expert": mats}, v.slots, off, off * v.slots, v.span)


def _layout(experts: dict) -> str:
    return ", ".join(f"{n} {t.dtype} {t.shape[0]}x{t.shape[1]}" for n, t in experts.items())


def _weight_view(v: PoolView, vname: str, pname: str, graph: DecodeGraph,
                 pooled: dict[str, dict[str, str]], unused: list) -> ir.PoolView:
    """`view NAME: KIND(FAMILIES), ...`: one layer's matrices of each kind listed (but the
    `unused` ones, `unused_kind`), at a time. Records in `pooled` where each matrix lives."""
    matrices: dict[str, list[ir.PooledMatrix]] = {}
    for vk in (vk for vk in v.kinds if vk not in unused):
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
