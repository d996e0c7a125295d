"""Pass `parity`: `parity vectors ahead A`, the double-buffered block of per-layer vectors
(norm weights, biases) every layer kind lays out in its own rows."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.resolve.state import ResolveState


def resolve_parity(s: ResolveState) -> ResolveState:
    sched, graph = s.sched, s.graph
    if len(sched.parities) != 1:
        span = sched.parities[1].span if sched.parities else sched.name.span
        raise fail("E-PARITY", "a schedule needs exactly one `parity` block for per-layer vectors",
                   span, hint="add `parity vectors ahead 1`")
    p = sched.parities[0]
    if p.name.text != "vectors":
        raise fail("E-NAME", f"the parity block must be called 'vectors', not '{p.name.text}'",
                   p.name.span, hint="write `parity vectors ahead 1`")
    if p.ahead < 0:
        raise fail("E-PARITY", "parity distance cannot be negative", p.span, hint="use 1")
    layout: dict[str, dict[str, tuple[int, int, int]]] = {}
    width = rows = 0
    for kname in sorted(set(graph.layer_kinds)):
        row = 0
        layout[kname] = {}
        for t in graph.kinds[kname].vectors():
            n_rows = t.shape[0] if len(t.shape) == 2 else 1
            layout[kname][t.name] = (row, n_rows, t.shape[-1])
            row += n_rows
            width = max(width, t.shape[-1])
        rows = max(rows, row)
    cols = -(-width // ir.LANES) * ir.LANES
    rows = -(-rows // ir.SUBLANE_TILE["f32"]) * ir.SUBLANE_TILE["f32"]
    return replace(s, parity=ir.Parity(name="vectors", ahead=p.ahead, rows=rows, cols=cols,
                                       layout=layout, span=p.span))
