"""Capacity: VMEM live bytes at every program point (tile-padded), and HBM per chip."""
from __future__ import annotations

from mkc import ir
from mkc.diagnostics import Diagnostic, Span
from mkc.trace import Event


def vmem_budget(s: ir.ScheduleIR, events: list[Event], batch: int | None = None
                ) -> tuple[int, str, list[ir.Buffer]]:
    """(peak bytes, where, buffers live there) for the kernel built at `batch` (default: the
    largest): resident buffers plus the scoped ones open."""
    buffers = [b.at_batch(batch or s.batch_max) for b in s.buffers]
    resident = [b for b in buffers if b.scope is None]
    by_name = {b.name: b for b in buffers}
    base = sum(b.vmem_bytes for b in resident)
    live: dict[str, ir.Buffer] = {}
    peak, where, at_peak = base, "kernel start", list(resident)
    for e in events:
        if e.op == "alloc":
            live[e.buffer] = by_name[e.buffer]
            total = base + sum(b.vmem_bytes for b in live.values())
            if total > peak:
                peak, where, at_peak = total, e.where, resident + list(live.values())
        elif e.op == "free":
            live.pop(e.buffer, None)
    return peak, where, at_peak


def check_vmem(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    budget = s.vmem_limit - s.vmem_reserve
    peak, where, live = vmem_budget(s, events)
    if peak <= budget:
        return []
    biggest = sorted(live, key=lambda b: -b.vmem_bytes)
    notes = [f"{b.name:<16} {b.cls:<11} {str(b.shape):<24} {b.dtype:<5} "
             f"{b.vmem_bytes / 2**20:8.2f} MiB" for b in biggest]
    span = biggest[0].span
    if span.file != s.source:          # a buffer mkc adds itself: point at the vmem line
        span = s.setting_spans.get("vmem", span)
    return [Diagnostic(
        "E-VMEM-CAPACITY",
        f"VMEM needs {peak / 2**20:.2f} MiB at {where}, over the budget of "
        f"{budget / 2**20:.2f} MiB (limit {s.vmem_limit >> 20} MiB minus reserve "
        f"{s.vmem_reserve / 2**20:.2f} MiB)", span,
        hint=f"shrink the largest buffer ({biggest[0].name}, {biggest[0].vmem_bytes / 2**20:.2f} "
             "MiB): fewer ring slots, a smaller tile or batch, or scope it more tightly",
        notes=["live at the peak (tile-padded):"] + notes)]


def check_hbm(s: ir.ScheduleIR) -> list[Diagnostic]:
    per_chip = sum(s.hbm_bytes_per_rank.values()) * s.cores_per_chip
    capacity = s.hbm_per_core * s.cores_per_chip
    if per_chip <= capacity:
        return []
    parts = ", ".join(f"{k} {v * s.cores_per_chip / 1e9:.1f} GB"
                      for k, v in s.hbm_bytes_per_rank.items())
    return [Diagnostic(
        "E-HBM-CAPACITY", f"each chip needs {per_chip / 1e9:.1f} GB of HBM but has "
        f"{capacity / 1e9:.1f} GB", s.setting_spans.get("context", Span.unknown(s.source)),
        notes=[parts],
        hint="use a larger topology (more chips share the weights), a shorter context or a "
             "smaller batch")]
