"""Pass `refills`: each phase's `refill RING after OP [from N rows | up to N rows]`, the ring
refills that the tiles its layer consumes up to OP start for tiles read after OP, held back
until OP is done (`mkc.ir.held_refills`)."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.lang import ast
from mkc.resolve.names import unknown
from mkc.resolve.phases import point
from mkc.resolve.state import ResolveState, widest_rows


def resolve_refills(s: ResolveState) -> ResolveState:
    rows_max = widest_rows(s)
    refills = {kname: _refill(s.phases[kname], ks, s.sched.rings[0].name.text, s.stream, rows_max)
               for kname, ks in s.phase_schedules.items()}
    return replace(s, refills=refills)


def _refill(phase: ast.Phase, ks: ir.KindSchedule, ring: str, stream: ir.Stream, rows_max: int
            ) -> ir.RingRefill | None:
    if not phase.refills:
        return None
    if len(phase.refills) > 1:
        raise fail("E-DUPLICATE", "a phase holds its ring refills back once", phase.refills[1].span,
                   hint="keep one `refill` line")
    r = phase.refills[0]
    if r.ring.text != ring:
        raise unknown("ring", r.ring, [ring])
    if r.start.where != "after":
        raise fail("E-STREAM", "held-back refills start after an op of the layer", r.start.anchor.span,
                   hint="write `after OP`")
    last = point(r.start, ks.ops, ks.name) - 1
    # The kind's stream is in consumption order: the tiles consumed up to OP are a prefix.
    readers = {fam: i for i, op in enumerate(ks.ops) if (fam := ks.matmuls.get(op)) is not None}
    families = stream.families.get(ks.name, [])
    held = [f for f in families if readers[f.name] <= last]
    tiles = sum(f.tiles for f in held)
    if not tiles:
        streaming = [op for op in ks.ops if ks.matmuls.get(op) in {f.name for f in families}]
        raise fail("E-STREAM", f"no op of {ks.name} up to {ks.ops[last]} reads ring {ring}, so "
                   "there is no refill to hold back", r.span,
                   hint=(f"name an op after one that reads it ({', '.join(streaming)})"
                         if streaming else "remove the line: the kind streams nothing"))
    if r.rows is not None and not 1 <= r.rows <= rows_max:
        bound = "up to" if r.up_to else "from"
        raise fail("E-STREAM", f"refill {bound} {r.rows} rows: no kernel of this spec has that many "
                   f"(its widest, of the batch range and verify step, has {rows_max})", r.span,
                   hint=f"write `{bound} N rows` with N up to {rows_max}, or drop it to hold back "
                        "at every width")
    if r.up_to:
        return ir.RingRefill(ks.ops[last], tiles, 1, r.rows, span=r.span)
    return ir.RingRefill(ks.ops[last], tiles, r.rows or 1, span=r.span)
