"""Checks over the schedule IR and its event trace; each returns diagnostics, never raises."""
from __future__ import annotations

from mkc import ir
from mkc.checks.capacity import check_hbm, check_vmem, vmem_budget
from mkc.checks.dma import check_dma
from mkc.checks.pool import check_pools
from mkc.diagnostics import Diagnostic, MkcError
from mkc.trace import Event, build_trace

__all__ = ["run_checks", "vmem_budget"]


def run_checks(s: ir.ScheduleIR) -> list[Event]:
    """Run every check; raise one MkcError carrying all diagnostics found. Returns the checked
    trace, which the VMEM budget report reads."""
    events = build_trace(s)
    diags: list[Diagnostic] = []
    diags += check_vmem(s, events)
    diags += check_hbm(s)
    diags += check_dma(s, events)
    diags += check_pools(s, events)
    if diags:
        raise MkcError(diags)
    return events
