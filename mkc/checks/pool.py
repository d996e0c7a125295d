"""Pool views: the views of one pool share its bytes, so no two may be live at the same time.

A view is live from its first copy in (`view_open`, which may sit in the layer before the one
that reads it) to the end of the last op reading it (`view_close`).
"""
from __future__ import annotations

from mkc import ir
from mkc.diagnostics import Diagnostic
from mkc.trace import Event


def check_pools(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    live: dict[str, tuple[str, Event]] = {}       # pool -> (view id, its open event)
    first: dict[tuple[str, str], Diagnostic] = {}  # (view, other view) -> its first overlap
    repeats: dict[tuple[str, str], int] = {}
    for e in events:
        if e.op not in ("view_open", "view_close"):
            continue
        pool = e.buffer.split(".")[0]
        if e.op == "view_close":
            if pool in live and live[pool][0] == e.buffer:
                del live[pool]
            continue
        if pool in live:
            other, opened = live[pool]
            key = (e.buffer, other)
            repeats[key] = repeats.get(key, 0) + 1
            # Blame the copy made for the later layer: it is the one issued too early.
            early, fine = (opened, e) if opened.tag.layer > e.tag.layer else (e, opened)
            first.setdefault(key, Diagnostic(
                "E-POOL-OVERLAP",
                f"{e.buffer} of {e.tag} is copied into pool {pool} at {e.where}, while "
                f"{other} of {opened.tag} (opened at {opened.where}) is still live",
                early.span, hint="start the copy after the last op that reads the other view, "
                                 "or give the views separate buffers",
                notes=[f"{fine.buffer} of {fine.tag} is opened by the copy at line "
                       f"{fine.span.line}", f"trace events {opened.seq} and {e.seq}"]))
        live[pool] = (e.buffer, e)
    diags = []
    for key, d in first.items():
        if repeats[key] > 1:
            d.notes.append(f"the same overlap recurs {repeats[key] - 1} more times in the step")
        diags.append(d)
    return diags
