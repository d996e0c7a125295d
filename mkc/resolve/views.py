"""Pass `views`: each phase's copies into pool views (`fetch experts -> POOL.VIEW after OP`,
`prefetch next POOL.VIEW at|after P`), and that every layer finds the view it reads filled."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.lang import ast
from mkc.model.graph import LayerKind
from mkc.resolve.names import unknown
from mkc.resolve.phases import point
from mkc.resolve.state import ResolveState, ViewCopies


def resolve_views(s: ResolveState) -> ResolveState:
    copies = {kname: ViewCopies(fetch=_fetch(s.phases[kname], s.graph.kinds[kname], s.pools),
                                prefetch=_prefetch(s.phases[kname], s.graph.kinds[kname], s.pools))
              for kname in s.phase_schedules}
    _check_view_copies(s.dims.layer_kinds, s.phase_schedules, copies, s.phases, s.pools)
    return replace(s, view_copies=copies)


def _view(name: ast.Name, pools: list[ir.Pool], slots: bool) -> ir.PoolView:
    """The `POOL.VIEW` a copy names: a slot view (routed experts) or a weight view."""
    parts = name.text.split(".")
    views = [f"{p.name}.{v.name}" for p in pools for v in p.views if (v.slots > 0) == slots]
    if len(parts) != 2 or name.text not in views:
        raise unknown("slot view" if slots else "weight view", name, views)
    return next(p for p in pools if p.name == parts[0]).view(parts[1])


def _fetch(phase: ast.Phase, kind: LayerKind, pools: list[ir.Pool]) -> ir.ViewCopy | None:
    """Routed experts are fetched once they are picked and before an op reads them."""
    kname, ops = kind.name, kind.op_names()
    if len(phase.fetches) > 1 or len(phase.prefetches) > 1:
        extra = (phase.fetches[1:] + phase.prefetches[1:])[0]
        raise fail("E-DUPLICATE", "a phase fetches experts or prefetches a view once", extra.span,
                   hint="keep one line")
    consumers = [o.name for o in kind.ops if o.runs_experts]
    fetch = None
    for f in phase.fetches:
        v = _view(f.view, pools, slots=True)
        if not consumers:
            raise fail("E-POOL", f"no op of {kname} reads routed experts", f.span,
                       hint="fetch experts in the phase of the layer kind that runs them")
        start = point(f.start, ops, kname)
        picked = max(i for i, o in enumerate(kind.ops) if o.picks_experts)
        if start <= picked:
            raise fail("E-POOL", f"experts are known only after {ops[picked]} picks them",
                       f.start.anchor.span, hint=f"write `after {ops[picked]}`")
        if start > ops.index(consumers[0]):
            raise fail("E-POOL", f"experts are fetched after {consumers[0]} reads them",
                       f.start.anchor.span, hint=f"fetch them before {consumers[0]}")
        fetch = ir.ViewCopy(v.pool, v.name, start, consumers[0], f.span)
    if consumers and fetch is None:
        raise fail("E-POOL", f"{kname}.{consumers[0]} reads routed experts that nothing fetches",
                   phase.kind.span,
                   hint="add a slot view (`view experts: 4 slots of expert`) and "
                        "`fetch experts -> POOL.VIEW after route`")
    return fetch


def _prefetch(phase: ast.Phase, kind: LayerKind, pools: list[ir.Pool]) -> ir.ViewCopy | None:
    """The next layer's weight view, copied from a point of this layer."""
    prefetch = None
    for pf in phase.prefetches:
        v = _view(pf.view, pools, slots=False)
        if pf.start.where == "before next":
            raise fail("E-POOL", "a prefetch starts at a point of this layer",
                       pf.start.anchor.span, hint="e.g. `after routed_experts` or `at start`")
        prefetch = ir.ViewCopy(v.pool, v.name, point(pf.start, kind.op_names(), kind.name),
                               span=pf.span)
    return prefetch


def _check_view_copies(layer_kinds: tuple[str, ...], schedules: dict[str, ir.KindSchedule],
                       copies: dict[str, ViewCopies], phases: dict[str, ast.Phase],
                       pools: list[ir.Pool]) -> None:
    """Every layer that reads a weight view finds it prefetched by the layer before it (the
    first layer's is copied in the prologue), and every prefetch has a reader next. The
    lowering serves one weight view per step (a kind's routed experts each a slot view)."""
    weight_views = [v for p in pools for v in p.views if v.slots == 0]
    if len(weight_views) > 1:
        raise fail("E-POOL", f"{len(weight_views)} weight views; the lowering prefetches one per step",
                   weight_views[1].span, hint=f"hold every pooled matrix in {weight_views[0].pool}."
                                              f"{weight_views[0].name}")

    def views(kname: str) -> set[str]:
        return set(schedules[kname].pooled.values())

    for i in range(1, len(layer_kinds)):
        prev, cur = layer_kinds[i - 1], layer_kinds[i]
        prefetch = copies[prev].prefetch
        for v in sorted(views(cur)):
            got = prefetch and f"{prefetch.pool}.{prefetch.view}"
            if got != v:
                raise fail("E-POOL", f"layer {i} ({cur}) reads {v}, but phase {prev} before "
                           f"it does not prefetch it", phases[prev].kind.span,
                           hint=f"add `prefetch next {v} after OP` to phase {prev}")
    for kname, c in copies.items():
        if c.prefetch is None:
            continue
        v = f"{c.prefetch.pool}.{c.prefetch.view}"
        nexts = {layer_kinds[i + 1] for i in range(len(layer_kinds) - 1)
                 if layer_kinds[i] == kname}
        if not any(v in views(n) for n in nexts):
            raise fail("E-POOL", f"phase {kname} prefetches {v}, but no layer after a {kname} "
                       "layer reads it", c.prefetch.span, hint="remove the prefetch")
