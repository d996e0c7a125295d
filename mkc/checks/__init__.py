"""Checks over the schedule IR and its event trace; each returns diagnostics, never raises."""
from __future__ import annotations

from mkc import ir
from mkc.checks.capacity import check_each_buffer_fits, check_hbm, check_vmem, vmem_budget
from mkc.checks.dma import check_dma
from mkc.checks.pool import check_pools
from mkc.diagnostics import MkcError
from mkc.trace import Event, build_trace

__all__ = ["run_checks", "vmem_budget"]


def run_checks(s: ir.ScheduleIR) -> list[Event]:
    """Run every check; raise one MkcError carrying all diagnostics found. Returns the checked
    trace, which the VMEM budget report reads.

    Checks on the IR alone run first and stop before the trace when they fail: the trace's
    size is bounded only for schedules whose every buffer fits (KV slots, say)."""
    diags = check_hbm(s) + check_each_buffer_fits(s)
    if diags:
        raise MkcError(diags)
    events = build_trace(s)
    diags += check_vmem(s, events)
    diags += check_dma(s, events)
    diags += check_pools(s, events)
    if diags:
        raise MkcError(diags)
    return events

