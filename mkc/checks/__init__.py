"""Checks over the schedule IR and its event trace; each returns diagnostics, never raises."""
from __future__ import annotations

from mkc import ir
from mkc.checks.capacity import check_hbm, check_vmem, vmem_budget, vmem_budget_bytes
from mkc.checks.dma import check_dma
from mkc.checks.pool import check_pools
from mkc.diagnostics import Diagnostic, MkcError
from mkc.trace import Event, build_trace

__all__ = ["run_checks", "vmem_budget"]


def run_checks(s: ir.ScheduleIR) -> list[Event]:
    """Run every check; raise one MkcError carrying all diagnostics found. Returns the checked
    trace, which the VMEM budget report reads.

    Checks on the IR alone run first and stop before the trace when they fail: the trace's
    size is bounded only for schedules whose every buffer fits (KV slots, say)."""
    diags = check_hbm(s) + _check_each_buffer_fits(s)
    if diags:
        raise MkcError(diags)
    events = build_trace(s)
    diags += check_vmem(s, events)
    diags += check_dma(s, events)
    diags += check_pools(s, events)
    if diags:
        raise MkcError(diags)
    return events


def _check_each_buffer_fits(s: ir.ScheduleIR) -> list[Diagnostic]:
    budget = vmem_budget_bytes(s)
    diags = []
    for b in s.buffers:
        b = b.at_batch(s.batch_max)
        if b.vmem_bytes > budget:
            span = b.span if b.span.file == s.source else s.setting_spans.get("vmem", b.span)
            diags.append(Diagnostic(
                "E-VMEM-CAPACITY", f"{b.name} alone needs {b.vmem_bytes / 2**20:.2f} MiB of VMEM "
                f"at batch {s.batch_max}, over the budget of {budget / 2**20:.2f} MiB", span,
                hint="fewer slots, smaller tiles or a smaller batch",
                notes=[f"{b.name}: {b.cls} {list(b.shape)} {b.dtype}"]))
    return diags
