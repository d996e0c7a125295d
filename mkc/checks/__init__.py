"""Checks over the schedule IR and its event trace; each returns diagnostics, never raises."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from mkc import ir
from mkc.checks.capacity import (check_compiler_scratch, check_each_buffer_fits, check_hbm, check_vmem,
                                 vmem_budget)
from mkc.checks.checkpoint import check_checkpoint
from mkc.checks.dma import check_dma
from mkc.checks.expect import check_expectations
from mkc.checks.kv_ring import check_kv_rings
from mkc.checks.pool import check_pools
from mkc.diagnostics import Diagnostic, MkcError
from mkc.trace import Event, build_trace

__all__ = ["CHECKS", "Check", "run_checks", "vmem_budget"]


@dataclass(frozen=True)
class Check:
    name: str
    # (ir) -> diagnostics when `reads_trace` is False, else (ir, checked trace) -> diagnostics
    run: (Callable[[ir.ScheduleIR], list[Diagnostic]]
          | Callable[[ir.ScheduleIR, list[Event]], list[Diagnostic]])
    reads_trace: bool
    only_if_sound: bool = False   # runs only when every check before it found nothing


# In order. Checks on the IR alone come first: when any of them fails, the ones reading the
# trace do not run, since the trace's size is bounded only for schedules whose every buffer
# fits (KV slots, say).
CHECKS: tuple[Check, ...] = (
    Check("checkpoint", check_checkpoint, reads_trace=False),      # a checkpoint's tensor table
    Check("hbm", check_hbm, reads_trace=False),                    # HBM per chip
    Check("compiler_scratch", check_compiler_scratch, reads_trace=False),   # measured for the family
    Check("buffer_fits", check_each_buffer_fits, reads_trace=False),     # each buffer alone in VMEM
    Check("kv_rings", check_kv_rings, reads_trace=False),          # a KV ring holds its windows
    Check("vmem", check_vmem, reads_trace=True),                   # the VMEM peak in the budget
    Check("dma", check_dma, reads_trace=True),                     # copy hazards, waits, scopes
    Check("pools", check_pools, reads_trace=True),                 # no two views of a pool live
    # a margin is news only on a spec that is otherwise sound
    Check("expect", check_expectations, reads_trace=True, only_if_sound=True),
)


def run_checks(s: ir.ScheduleIR) -> list[Event]:
    """Run `CHECKS` in order; raise one MkcError carrying all diagnostics found. Returns the
    checked trace, which the VMEM budget report reads."""
    diags: list[Diagnostic] = []
    events: list[Event] | None = None
    for check in CHECKS:
        if check.only_if_sound and diags:
            continue
        if not check.reads_trace:
            diags += check.run(s)
            continue
        if events is None:
            if diags:
                raise MkcError(one_per_statement(diags))
            events = build_trace(s)
        diags += check.run(s, events)
    if diags:
        raise MkcError(one_per_statement(diags))
    return build_trace(s) if events is None else events


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

