"""Resolve a parsed schedule against the model graph and target into the schedule IR: a flat
list of small passes (`driver.PASSES`), each reading what the ones before it resolved."""
from __future__ import annotations

from mkc import ir
from mkc.diagnostics import MkcError
from mkc.lang import ast
from mkc.resolve.driver import PASS_NAMES, PASSES, run
from mkc.resolve.slices import name_smallest_slice, smallest_topology
from mkc.resolve.state import ResolveState

__all__ = ["PASSES", "PASS_NAMES", "ResolveState", "name_smallest_slice", "resolve",
           "resolve_state", "smallest_topology"]


def resolve_state(sched: ast.Schedule, model_override: str | None = None, *,
                  after: str | None = None, suggest: bool = True) -> ResolveState:
    """The state after pass `after` (every pass: its `schedule_ir` is set); `suggest` lets a
    diagnostic about the slice's size name the smallest slice that would work."""
    try:
        return run(sched, model_override, after=after)
    except MkcError as e:
        if suggest:
            name_smallest_slice(e, sched, model_override)
        raise


def resolve(sched: ast.Schedule, model_override: str | None = None, *,
            suggest: bool = True) -> ir.ScheduleIR:
    """The schedule IR (see `resolve_state`)."""
    return resolve_state(sched, model_override, suggest=suggest).schedule_ir
