"""Pool views: the views of one pool share its bytes, so no two may be live at the same time.

A view is live from its first copy in (`ViewOpen`, which may sit in the layer before the one
that reads it) to the end of the last op reading it (`ViewClose`).
"""
from __future__ import annotations

from mkc import ir
from mkc.diagnostics import Diagnostic
from mkc.trace import (Alloc, Collective, CopyStart, CopyWait, EpilogueBegin, Event, EventHandlers,
                       Exit, Free, LayerBegin, OpBegin, Read, ViewClose, ViewOpen, Write)


def check_pools(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    live: dict[str, ViewOpen] = {}                 # pool -> the open event of its live view
    first: dict[tuple[str, str], Diagnostic] = {}  # (view, other view) -> its first overlap
    repeats: dict[tuple[str, str], int] = {}

    def view_closes(e: ViewClose) -> None:
        pool = e.view.split(".")[0]
        if pool in live and live[pool].view == e.view:
            del live[pool]

    def view_opens(e: ViewOpen) -> None:
        pool = e.view.split(".")[0]
        if pool in live:
            opened = live[pool]
            other = opened.view
            key = (e.view, other)
            repeats[key] = repeats.get(key, 0) + 1
            # Blame the copy made for the later layer: it is the one issued too early.
            early, fine = (opened, e) if opened.tag.layer > e.tag.layer else (e, opened)
            first.setdefault(key, Diagnostic(
                "E-POOL-OVERLAP",
                f"{e.view} of {e.tag} is copied into pool {pool} at {e.where}, while "
                f"{other} of {opened.tag} (opened at {opened.where}) is still live",
                early.span, hint="start the copy after the last op that reads the other view, "
                                 "or give the views separate buffers",
                notes=[f"{fine.view} of {fine.tag} is opened by the copy at line "
                       f"{fine.span.line}", f"trace events {opened.seq} and {e.seq}"]))
        live[pool] = e

    EventHandlers("the pool check", {
        ViewOpen: view_opens, ViewClose: view_closes,
        Alloc: None, Free: None, CopyStart: None, CopyWait: None, Read: None, Write: None,
        OpBegin: None, Collective: None, LayerBegin: None, EpilogueBegin: None, Exit: None,
    }).replay(events)
    diags = []
    for key, d in first.items():
        if repeats[key] > 1:
            d.notes.append(f"the same overlap recurs {repeats[key] - 1} more times in the step")
        diags.append(d)
    return diags
