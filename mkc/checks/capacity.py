"""Capacity: VMEM live bytes at every program point, as Mosaic allocates them, and HBM per chip.

The VMEM model follows what libtpu does with a generated kernel (learned from libtpu
compile-only: benchmarks/vmem_probe.py for per-buffer rules, benchmarks/vmem_sweep.py for
whole kernels; data in benchmarks/data/):

- every scratch buffer at its tiled size (`ir.padded_bytes`: lanes to 128, rows to a tile
  height that depends on dtype and row count), `pl.run_scoped` buffers only while their scope
  is open (scopes that never overlap share memory);
- kernel inputs and outputs held in VMEM (their windows, `ir.window_bytes`);
- compiler scratch: the register allocator's spill slots and Mosaic's internal scratch, which
  grow with the batch (the kernel unrolls its per-row loops). Modelled per model family from
  the sweep (`compiler_overhead_bytes`), an upper envelope of what libtpu allocated;
- semaphores live in their own memory (sflag, 16 KiB) and SMEM scratch in SMEM: neither is
  VMEM.

The kernel fits when all of it is at most the compiler's limit: the spec's `vmem limit`
(emitted as `vmem_limit_bytes`), but never more than the VMEM XLA can hand out, 64 KiB less
than the chip's (63.94 MiB of 64 on TPU7x). The spec's `reserve` is the user's headroom on
top of this model (the compiler's own scratch is modelled, not reserved):
budget = min(limit, usable VMEM) - reserve.
"""
from __future__ import annotations

import bisect
from collections.abc import Iterator

from mkc import ir
from mkc.diagnostics import Diagnostic, Span
from mkc.trace import Event

# XLA keeps 64 KiB of each TensorCore's VMEM for itself: its VMEM memory space is 67043328
# bytes on TPU7x (the "of 63.94M" in libtpu's out-of-memory error, and the scoped memory it
# grants a kernel asked for 64 MiB).
XLA_RESERVED_VMEM = 64 << 10

# Longer KV tiles add spill slots in the attention (Qwen: +417 KB at B8 from 128 to 512 tokens,
# +113 KB at B16 from 128 to 256): bytes per token of the longest KV tile past 128.
KV_TOKEN_SCRATCH = 1100
KV_BASE_TOKENS = 128
COMPILER_SCRATCH_MARGIN = 64 << 10


def usable_vmem_bytes(s: ir.ScheduleIR) -> int:
    """The VMEM XLA can hand the kernel: the chip's, less the 64 KiB it keeps."""
    return s.vmem_capacity - XLA_RESERVED_VMEM


def vmem_budget_bytes(s: ir.ScheduleIR, batch: int | None = None) -> int:
    """What the modelled peak (buffers, windows and compiler scratch) must fit in: the spec's
    limit within the usable VMEM, minus the spec's reserve. (`batch` is accepted for callers
    that ask per batch; the budget does not depend on it.)

    The spill slots count inside the limit. libtpu does not always put them there: at a 48 MiB
    limit its kernel use left them out and compiled, at 60 and 61 MiB it counted them and
    failed (benchmarks/data/vmem_sweep.json), so counting them is the safe side."""
    del batch
    return min(usable_vmem_bytes(s), s.vmem_limit) - s.vmem_reserve


def _interpolate(points: list[tuple[int, int]], batch: int) -> int:
    xs = [b for b, _ in points]
    i = bisect.bisect_left(xs, batch)
    if i < len(points) and points[i][0] == batch:
        return points[i][1]
    if i == 0:
        return points[0][1]
    if i == len(points):
        (b0, y0), (b1, y1) = points[-2:] if len(points) > 1 else (points[-1], points[-1])
        slope = (y1 - y0) / (b1 - b0) if b1 != b0 else 0
        return round(y1 + max(0.0, slope) * (batch - b1))
    (b0, y0), (b1, y1) = points[i - 1], points[i]
    return round(y0 + (y1 - y0) * (batch - b0) / (b1 - b0))


def compiler_overhead_bytes(s: ir.ScheduleIR, batch: int | None = None) -> int:
    """Modelled compiler scratch of the kernel built at `batch` rows (default: the widest)."""
    batch = batch or s.rows_max
    n = _interpolate(list(s.compiler_scratch), batch)
    tokens = max((k.kv.tokens for k in s.kinds.values() if k.kv), default=KV_BASE_TOKENS)
    n += KV_TOKEN_SCRATCH * max(0, tokens - KV_BASE_TOKENS) + COMPILER_SCRATCH_MARGIN
    return -(-n // 1024) * 1024


def vmem_inputs(s: ir.ScheduleIR, batch: int) -> list[ir.Buffer]:
    """Kernel inputs the family's module passes in VMEM (outputs are IR buffers, class
    "output")."""
    return [b.at_batch(batch) for b in s.vmem_inputs]


def vmem_window_bytes(s: ir.ScheduleIR, batch: int) -> int:
    """VMEM windows of the kernel's inputs and outputs at `batch`."""
    return (sum(ir.window_bytes(b.shape, b.dtype) for b in vmem_inputs(s, batch))
            + sum(b.at_batch(batch).vmem_bytes for b in s.buffers if b.cls == "output"))


def _compiler_buffer(nbytes: int) -> ir.Buffer:
    return ir.Buffer("compiler_scratch", "compiler", (nbytes,), "u8")


def vmem_timeline(s: ir.ScheduleIR, events: list[Event], batch: int | None = None
                  ) -> Iterator[tuple[Event | None, int, list[ir.Buffer]]]:
    """(event, bytes, buffers live) at kernel start (event None) and after each scoped
    allocation or free, for the kernel built at `batch` (default: the widest,
    `ScheduleIR.rows_max`): resident buffers, VMEM inputs and compiler scratch, plus the scoped
    buffers open."""
    batch = batch or s.rows_max
    buffers = [b.at_batch(batch) for b in s.buffers]
    resident = ([b for b in buffers if b.scope is None] + vmem_inputs(s, batch)
                + [_compiler_buffer(compiler_overhead_bytes(s, batch))])
    by_name = {b.name: b for b in buffers}
    base = sum(b.vmem_bytes for b in resident)
    live: dict[str, ir.Buffer] = {}
    yield None, base, list(resident)
    for e in events:
        if e.op == "alloc":
            live[e.buffer] = by_name[e.buffer]
        elif e.op == "free":
            live.pop(e.buffer, None)
        else:
            continue
        yield e, base + sum(b.vmem_bytes for b in live.values()), resident + list(live.values())


def vmem_budget(s: ir.ScheduleIR, events: list[Event], batch: int | None = None
                ) -> tuple[int, str, list[ir.Buffer]]:
    """(peak bytes, where, buffers live there) for the kernel built at `batch` (see
    `vmem_timeline`); the first point of the peak."""
    peak, where, at_peak = -1, "", []
    for e, total, live in vmem_timeline(s, events, batch):
        if total > peak:
            peak, where, at_peak = total, e.where if e else "kernel start", live
    return peak, where, at_peak


def check_vmem(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    budget = vmem_budget_bytes(s)
    peak, where, live = vmem_budget(s, events)
    if peak <= budget:
        return []
    biggest = sorted(live, key=lambda b: -b.vmem_bytes)
    notes = [f"{b.name:<16} {b.cls:<11} {str(b.shape):<24} {b.dtype:<5} "
             f"{b.vmem_bytes / 2**20:8.2f} MiB" for b in biggest]
    shrink = next(b for b in biggest if b.cls not in ("compiler", "input"))
    span = _buffer_span(s, shrink)
    largest = f"the largest buffer ({shrink.name}, {shrink.vmem_bytes / 2**20:.2f} MiB)"
    hint = (f"shrink {largest}: fewer ring slots, a smaller tile or batch, or scope it more "
            "tightly")
    if s.rows_max > s.batch_max and vmem_budget(s, events, s.batch_max)[0] <= budget:
        # Decoding fits: the verify step's rows are what overflow.
        rows = _largest_batch_that_fits(s, events, budget, s.batch_max, s.rows_max)
        span = s.setting_spans.get("verify", span)
        sequences, per_sequence = s.verify_sequences[1], rows // s.verify_sequences[1]
        fix = (f"verify at most {per_sequence} rows for {sequences} sequences"
               if per_sequence >= 2 else
               f"verify {s.verify_rows} rows for at most {max(1, rows // s.verify_rows)} sequences")
        hint = f"a kernel of up to {rows} rows fits: {fix}; or shrink {largest}"
    elif (fits_up_to := _largest_batch_that_fits(s, events, budget, s.batch_min, s.batch_max)) is not None:
        # The batch range is what overflows: point at it.
        span = s.setting_spans.get("batch", span)
        hint = (f"the kernel fits up to batch {fits_up_to}: write `batch {s.batch_min} to "
                f"{fits_up_to}`; for larger batches shrink {largest}")
    if (limit_to := _limit_that_fits(s, peak)) is not None:   # the limit is the cap
        hint = (f"raise the limit: `vmem limit {limit_to} MiB` fits (the chip has "
                f"{usable_vmem_bytes(s) / 2**20:.2f} MiB usable); or {hint}")
        span = s.setting_spans.get("vmem", span)
    return [Diagnostic(
        "E-VMEM-CAPACITY",
        f"VMEM needs {peak / 2**20:.2f} MiB at {where} ({_width(s)}), over the budget "
        f"of {_budget_words(s)}", span, hint=hint,
        notes=["live at the peak (as Mosaic allocates them, compiler scratch modelled):"]
        + notes)]


def check_each_buffer_fits(s: ir.ScheduleIR) -> list[Diagnostic]:
    """Every buffer alone within the budget at the widest kernel: checked on the IR before the
    trace, whose size is bounded only for schedules that pass it (KV slots, say)."""
    budget = vmem_budget_bytes(s)
    diags = []
    for b in s.buffers:
        b = b.at_batch(s.rows_max)
        if b.vmem_bytes > budget:
            hint = "fewer slots, smaller tiles or a smaller batch"
            if (limit_to := _limit_that_fits(s, b.vmem_bytes)) is not None:
                hint = (f"raise the limit (the chip has {usable_vmem_bytes(s) / 2**20:.2f} MiB "
                        f"usable): this buffer alone needs `vmem limit {limit_to} MiB`, the "
                        f"whole kernel more; or {hint}")
            diags.append(Diagnostic(
                "E-VMEM-CAPACITY", f"{b.name} alone needs {b.vmem_bytes / 2**20:.2f} MiB of VMEM "
                f"at {_width(s)}, over the budget of {_budget_words(s)}",
                _buffer_span(s, b), hint=hint,
                notes=[f"{b.name}: {b.cls} {list(b.shape)} {b.dtype}"]))
    return diags


def _budget_words(s: ir.ScheduleIR) -> str:
    """The budget and how it is reached: the spec's limit (or the chip's usable VMEM, when
    that is smaller) minus the reserve."""
    usable = usable_vmem_bytes(s)
    bound = (f"the spec's limit {s.vmem_limit / 2**20:.2f} MiB" if s.vmem_limit < usable
             else f"{usable / 2**20:.2f} MiB usable")
    return (f"{vmem_budget_bytes(s) / 2**20:.2f} MiB ({bound} minus reserve "
            f"{s.vmem_reserve / 2**20:.2f} MiB)")


def _limit_that_fits(s: ir.ScheduleIR, need: int) -> int | None:
    """The `vmem limit` (whole MiB) that fits `need` bytes, when the spec's limit is below the
    chip's usable VMEM and the chip has the room; else None."""
    usable = usable_vmem_bytes(s)
    if s.vmem_limit < usable and need <= usable - s.vmem_reserve:
        return -(-(need + s.vmem_reserve) // 2**20)
    return None


def _buffer_span(s: ir.ScheduleIR, b: ir.Buffer):
    """Where the spec made the buffer; a buffer mkc adds itself points at the vmem line."""
    return b.span if b.span.file == s.source else s.setting_spans.get("vmem", b.span)


def _width(s: ir.ScheduleIR) -> str:
    if s.rows_max > s.batch_max:
        return f"the verify step's {s.rows_max} rows"
    return f"batch {s.batch_max}"


def _largest_batch_that_fits(s: ir.ScheduleIR, events: list[Event], budget: int, lo: int,
                             hi: int) -> int | None:
    """The largest row count in lo..hi whose kernel fits, if lo does (VMEM grows with the
    rows, so a bisection needs a handful of budget evaluations)."""
    if vmem_budget(s, events, lo)[0] > budget:
        return None
    while hi - lo > 1:                         # lo fits, hi does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if vmem_budget(s, events, mid)[0] <= budget else (lo, mid)
    return lo


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
