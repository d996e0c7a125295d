"""The headroom a spec promises (`expect vmem|hbm headroom at least N`), measured by the
capacity model: VMEM left under the budget at every kernel width the spec builds (its
smallest and largest batch and its verify step's rows), HBM left per chip."""
from __future__ import annotations

from mkc import ir
from mkc.checks.capacity import bounding_widths, vmem_budget, vmem_budget_bytes
from mkc.diagnostics import Diagnostic
from mkc.trace import Event

MIB = 1 << 20


def vmem_headroom(s: ir.ScheduleIR, events: list[Event]) -> dict[int, int]:
    """VMEM bytes left under the budget at each kernel width (rows) the spec builds."""
    budget = vmem_budget_bytes(s)
    return {b: budget - vmem_budget(s, events, b)[0]
            for b in sorted({s.batch_min, s.batch_max, s.rows_max, *bounding_widths(s)})}


def hbm_headroom(s: ir.ScheduleIR) -> int:
    """HBM bytes left per chip."""
    return (s.hbm_per_core - sum(s.hbm_bytes_per_rank.values())) * s.cores_per_chip


def _width(s: ir.ScheduleIR, rows: int) -> str:
    return f"batch {rows}" if rows <= s.batch_max else f"the verify step's {rows} rows"


def check_expectations(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    diags = []
    for e in s.expectations:
        if e.resource == "vmem":
            left = vmem_headroom(s, events)
            rows, least = min(left.items(), key=lambda kv: (kv[1], kv[0]))
            if least < e.at_least:
                unit, scale = ("MiB", MIB) if e.at_least - least >= MIB // 100 else ("KiB", 1024)
                widths = ", ".join(f"{_width(s, r)} {v / scale:.2f} {unit}" for r, v in left.items())
                diags.append(Diagnostic(
                    "E-EXPECT", f"at {_width(s, rows)} the kernel leaves {least / scale:.2f} "
                    f"{unit} of VMEM under the budget, less than the {e.at_least / scale:.2f} "
                    f"{unit} this spec expects", e.span, notes=[f"VMEM left at each kernel width: {widths}"],
                    hint="free VMEM (fewer ring slots, smaller tiles or batch, tighter scopes) "
                         "or expect less"))
        else:
            left = hbm_headroom(s)
            if left < e.at_least:
                diags.append(Diagnostic(
                    "E-EXPECT", f"each chip leaves {left / 1e9:.2f} GB of HBM free, less than "
                    f"the {e.at_least / 1e9:.2f} GB ({e.at_least / 2**30:.2f} GiB) this spec "
                    "expects", e.span,
                    hint="use a larger topology, a shorter context or a smaller batch, or "
                         "expect less"))
    return diags
