"""Checks over the schedule IR and its event trace; each returns diagnostics, never raises."""
from __future__ import annotations

from mkc import ir
from mkc.checks.capacity import (check_compiler_scratch, check_each_buffer_fits, check_hbm, check_vmem,
                                 vmem_budget)
from mkc.checks.dma import check_dma
from mkc.checks.expect import check_expectations
from mkc.checks.kv_ring import check_kv_rings
from mkc.checks.pool import check_pools
from mkc.diagnostics import Diagnostic, MkcError
from mkc.trace import Event, build_trace

__all__ = ["run_checks", "vmem_budget"]


def run_checks(s: ir.ScheduleIR) -> list[Event]:
    """Run every check; raise one MkcError carrying all diagnostics found. Returns the checked
    trace, which the VMEM budget report reads.

    Checks on the IR alone run first and stop before the trace when they fail: the trace's
    size is bounded only for schedules whose every buffer fits (KV slots, say)."""
    diags = (check_hbm(s) + check_compiler_scratch(s) + check_each_buffer_fits(s)
             + check_kv_rings(s))
    if diags:
        raise MkcError(one_per_statement(diags))
    events = build_trace(s)
    diags += check_vmem(s, events)
    diags += check_dma(s, events)
    diags += check_pools(s, events)
    if not diags:           # a margin is news only on a spec that is otherwise sound
        diags += check_expectations(s, events)
    if diags:
        raise MkcError(one_per_statement(diags))
    return events


def one_per_statement(diags: list[Diagnostic]) -> list[Diagnostic]:
    """One diagnostic per code and statement: the same problem found again there (the KV
    cache's value tiles after its key tiles, say) is a note of the first."""
    first: dict[tuple, Diagnostic] = {}
    kept = []
    for d in diags:
        same = first.get((d.code, d.span))
        if same is None:
            first[(d.code, d.span)] = d
            kept.append(d)
        else:
            same.notes.append(f"also: {d.message}")
    return kept

