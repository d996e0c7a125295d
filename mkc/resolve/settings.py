"""Passes `batch` (the batch range and the context) and `vmem` (the VMEM limit and reserve)."""
from __future__ import annotations

from dataclasses import replace

from mkc.diagnostics import fail
from mkc.resolve.names import require
from mkc.resolve.state import ResolveState


def resolve_batch(s: ResolveState) -> ResolveState:
    batch = require(s.sched, "batch", "batch 1 to 8")
    lo, hi = batch.value
    if not 1 <= lo <= hi:
        raise fail("E-BATCH", f"batch range {lo} to {hi} is empty or starts below 1",
                   batch.span, hint="write `batch 1` or `batch 1 to 8`")
    context = require(s.sched, "context", "context 4096")
    if context.value < 1:
        raise fail("E-CONTEXT", f"context {context.value} leaves no room for the token being "
                   "decoded", context.span, hint="the context is the KV cache length in tokens: "
                   "e.g. `context 4096`")
    return replace(s, batch=(lo, hi), context=context.value)


def resolve_vmem(s: ResolveState) -> ResolveState:
    limit, reserve = require(s.sched, "vmem", "vmem limit 64 MiB reserve 6 MiB").value
    chip = s.topology.chip
    if limit.value > chip.vmem_bytes:
        raise fail("E-VMEM-LIMIT", f"vmem limit {limit.value >> 20} MiB exceeds the "
                   f"{chip.vmem_bytes >> 20} MiB of VMEM per {chip.name} TensorCore",
                   limit.span, hint=f"use at most {chip.vmem_bytes >> 20} MiB")
    if reserve.value >= limit.value:
        raise fail("E-VMEM-LIMIT", "vmem reserve leaves no room under the limit", reserve.span,
                   hint="the reserve is headroom for compiler scratch: a few MiB")
    return replace(s, vmem_limit=limit.value, vmem_reserve=reserve.value)
