"""The headroom a spec promises (`expect vmem|hbm headroom at least N`), measured by the
capacity model: VMEM left under the budget in every kernel the VMEM verdict judges (the decode
step at each bounding batch and every verify step, `capacity.kernels`), HBM left per chip."""
from __future__ import annotations

from mkc import ir
from mkc.checks.capacity import Kernel, judged_kernels, vmem_budget_bytes
from mkc.diagnostics import Diagnostic
from mkc.trace import Event

MIB = 1 << 20


def vmem_headroom(s: ir.ScheduleIR, events: list[Event]) -> dict[Kernel, int]:
    """VMEM bytes left under the budget in each kernel the VMEM verdict judges."""
    budget = vmem_budget_bytes(s)
    return {k: budget - peak for k, (peak, _, _) in judged_kernels(s, events)}


def hbm_headroom(s: ir.ScheduleIR) -> int:
    """HBM bytes left per chip."""
    return (s.hbm_per_core - sum(s.hbm_bytes_per_rank.values())) * s.cores_per_chip


def check_expectations(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    diags = []
    for e in s.expectations:
        if e.resource == "vmem":
            left = vmem_headroom(s, events)
            kernel, least = min(left.items(), key=lambda kv: kv[1])
            if least < e.at_least:
                unit, scale = ("MiB", MIB) if e.at_least - least >= MIB // 100 else ("KiB", 1024)
                each = "; ".join(f"{k} {v / scale:.2f} {unit}" for k, v in left.items())
                diags.append(Diagnostic(
                    "E-EXPECT", f"the {kernel} leaves {least / scale:.2f} {unit} of VMEM "
                    f"under the budget, less than the {e.at_least / scale:.2f} {unit} this spec "
                    "expects", e.span, notes=[f"VMEM left in each kernel the spec builds: {each}"],
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
