"""Capacity: VMEM live bytes at every program point, as Mosaic allocates them, and HBM per chip.

The VMEM model follows what libtpu does with a generated kernel (learned from libtpu
compile-only: benchmarks/vmem_probe.py for per-buffer rules, benchmarks/vmem_sweep.py for
whole kernels; data in benchmarks/data/):

- every scratch buffer at its tiled size (`ir.padded_bytes`: lanes to 128, rows to a tile
  height that depends on dtype and row count), `pl.run_scoped` buffers only while their scope
  is open (scopes that never overlap share memory);
- kernel inputs and outputs held in VMEM (their windows, `ir.window_bytes`);
- compiler scratch: the register allocator's spill slots and Mosaic's internal scratch, which
  grow with the rows (the kernel unrolls its per-row loops), with the per-rank shapes and with
  how a body carries state (GPT-OSS 20b's attention, 32 heads' online-softmax state a core,
  spills 1.1 MiB at 8 rows when a KV head's query heads go through each tile together, 9.5 MiB
  one head at a time). Measured by libtpu for each geometry a family ships (`scratch_key`:
  chip, ranks, model dims, weight formats), kernel kind (decode or verify step) and width
  (benchmarks/compiler_scratch.py, data in each family's compiler_scratch.json), interpolated
  between measured widths; anywhere else a stated bound, labelled so (`compiler_scratch`).
  Measured at the chip's whole VMEM, where libtpu spills most: under a tighter limit it
  rematerialises instead (the VMEM sweep's margins at mkc's peak as the limit), so the
  measure bounds it. libtpu gives spill slots region by region, in memory the `run_scoped`
  buffers of regions not open share, so a measure (libtpu's use less mkc's peak) is the spill
  beside the measured kernel's scoped peak, and spill elsewhere may hide behind its KV tiles:
  a kernel whose tiles hold fewer entries (a verify step of as many rows for fewer sequences)
  takes the measure plus the tile bytes it no longer has (`_hidden_by_tiles`);
- semaphores live in their own memory (sflag, 16 KiB) and SMEM scratch in SMEM: neither is
  VMEM.

Every kernel the spec builds is judged on its own (`kernels`): the decode step at each
bounding batch and every verify step, whose KV tiles hold one entry a sequence. A kernel fits
when all of it is at most the compiler's limit: the spec's `vmem limit`
(emitted as `vmem_limit_bytes`), but never more than the VMEM XLA can hand out, 64 KiB less
than the chip's (63.94 MiB of 64 on TPU7x). The spec's `reserve` is the user's headroom on
top of this model (the compiler's own scratch is modelled, not reserved):
budget = min(limit, usable VMEM) - reserve.
"""
from __future__ import annotations

import bisect
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Callable

from mkc import ir
from mkc.diagnostics import Diagnostic, Span
from mkc.trace import (Alloc, Collective, CopyStart, CopyWait, EpilogueBegin, Event, EventHandlers,
                       Exit, Free, LayerBegin, OpBegin, Read, ViewClose, ViewOpen, Write)

# XLA keeps 64 KiB of each TensorCore's VMEM for itself: its VMEM memory space is 67043328
# bytes on TPU7x (the "of 63.94M" in libtpu's out-of-memory error, and the scoped memory it
# grants a kernel asked for 64 MiB).
XLA_RESERVED_VMEM = 64 << 10

COMPILER_SCRATCH_MARGIN = 64 << 10
# A geometry the family has not measured (another model, chip, mesh or format): this many times
# the largest scratch measured for the family at that width. The family's own measures are the
# only evidence; the factor covers a geometry up to half again as heavy in registers.
UNMEASURED_SCRATCH_FACTOR = 1.5
# Past the widest width a geometry measured, its scratch grows by at most this much a row: the
# steepest rise a row past a measure in the data is 0.17 MiB (GPT-OSS 20b's verify step from 8
# to 16 rows; its decode step from batch 8 to 16 0.15, Llama 8B's verify step from 16 to 32
# rows 0.16, DeepSeek-V3's decode step from 16 to 32 0.12; `tests/checks/test_capacity.py`
# holds every measured pair to it).
SCRATCH_BOUND_A_ROW = 1 << 18


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


def scratch_key(s: ir.ScheduleIR) -> tuple[tuple[str, str], ...]:
    """What libtpu's spill slots and internal scratch depend on besides the rows: the chip, the
    mesh, the model's dims (its per-rank shapes) and the weight formats (their decode). Ring
    depth, tile bounds and limits change buffers mkc counts, not the compiler's scratch."""
    dims = {k: v for k, v in s.dims.items() if k != "name"}
    digest = hashlib.sha256(json.dumps(dims, sort_keys=True).encode()).hexdigest()[:16]
    def spelled(formats: dict) -> str:
        return ",".join(f"{c}={f.name}" + (f"/{f.block}" if f.block else "")
                        + (f"x{f.cols}" if f.cols else "") for c, f in sorted(formats.items()))
    formats = ";".join([spelled(s.weight_formats)]
                       + [f"{k}:{spelled(f)}" for k, f in sorted(s.kind_weight_formats.items())])
    return (("chip", s.chip), ("ranks", str(s.ranks)), ("dims", digest), ("formats", formats))


def _interpolate(points: list[tuple[int, int]], rows: int) -> int:
    """The upper envelope of (rows, bytes) points (never falling as rows grow), linear between
    them; below the narrowest the narrowest's, past the widest the widest's (`_at_width`
    bounds what lies past it)."""
    env: list[tuple[int, int]] = []
    for r, n in sorted(points):
        n = max([n] + [m for _, m in env])
        if env and env[-1][0] == r:
            env[-1] = (r, n)
        else:
            env.append((r, n))
    xs = [r for r, _ in env]
    i = bisect.bisect_left(xs, rows)
    if i < len(env) and env[i][0] == rows:
        return env[i][1]
    if i == 0:
        return env[0][1]
    if i == len(env):
        return env[-1][1]
    (r0, y0), (r1, y1) = env[i - 1], env[i]
    return round(y0 + (y1 - y0) * (rows - r0) / (r1 - r0))


def _rise_per_row(points: list[tuple[int, int]]) -> float:
    """The steepest rise a row between two widths of the upper envelope of (rows, bytes)."""
    xs = sorted({r for r, _ in points})
    ys = [_interpolate(points, r) for r in xs]
    return max([0.0] + [(y1 - y0) / (x1 - x0) for x0, x1, y0, y1 in zip(xs, xs[1:], ys, ys[1:])])


@dataclass(frozen=True)
class CompilerScratch:
    bytes: int
    # libtpu's measure of this geometry and kernel kind at this width or between two measured
    # widths; False: a bound (a width, kind, geometry or KV tile length never measured)
    measured: bool
    source: str             # how the figure was reached, for the budget table


def _is_verify(m: ir.ScratchMeasure) -> bool:
    return m.kernel.startswith("verify")


def _tile_entries(m: ir.ScratchMeasure) -> int:
    """Entries the measured kernel's KV tiles held: one a sequence in a verify step ("verify R
    x S": S), one a row in a decode step."""
    return int(m.kernel.split(" x ")[1]) if _is_verify(m) else m.rows


def kv_tile_bytes(s: ir.ScheduleIR, entries: int) -> int:
    """VMEM of the spec's KV tile buffers holding `entries` entries (sequences or rows)."""
    tiles = {n for kind in s.kinds.values() if kind.kv for n in kind.kv.tile_buffers}
    return sum(b.at_batch(entries).vmem_bytes for b in s.buffers if b.name in tiles)


def _hidden_by_tiles(m: ir.ScratchMeasure, k: Kernel, tiles: Callable[[int], int] | None) -> int:
    """Spill of measure `m` that kernel `k` may show beyond it: libtpu's spill slots share
    memory with the `run_scoped` buffers of regions not open (a region's own, plus the largest
    of its sub-regions'), so its use is the largest of (spill + scoped buffers open) over its
    regions, and the measure, libtpu's use less mkc's peak (which holds the scoped KV tiles),
    hides up to the tiles' bytes of spill in regions where they are not open. A kernel whose
    tiles hold fewer entries than the measured kernel's no longer hides it: Qwen3-235B's verify
    step of 16 rows for 1 sequence against the measured 8 rows for 2 (libtpu 0.0.50.1, 16
    ranks): mkc counts 128 KiB less KV tiles, libtpu's use is 60 KiB less, set by the spill of
    a region with no tile open (0.676 MiB, one vreg more than the 8x2 kernel's), not by the
    attention's tiles and spill (0.734 MiB at 8x2). Taken only for a verify step from verify
    steps' measures, whose tiles differ at as many rows (a decode step's hold one entry a row:
    its measures at other widths are interpolated over the rows, tiles and all). The spec's
    own tiles stand for the measured kernel's (`tiles(entries)`, `kv_tile_bytes`: the same
    tiles when the spec keeps the measured ones); None: nothing added."""
    if tiles is None or not (k.verify and _is_verify(m)):
        return 0
    return max(0, tiles(_tile_entries(m)) - tiles(k.sequences))


def _at_width(measures, k: Kernel, tiles: Callable[[int], int] | None = None
              ) -> tuple[int, bool, str]:
    """(bytes, measured, how) for kernel `k` from one geometry's measures at one KV tile
    length, each with the spill it hides behind KV tiles `k` does not have
    (`_hidden_by_tiles`, from `tiles`). Between the narrowest and widest measure of its kind
    (decode or verify): the upper envelope, linear between them. Past the widest measured
    width, or for a kind never measured (from the other kind's): a bound, the envelope at the
    widest plus `SCRATCH_BOUND_A_ROW` (or the envelope's steepest rise a row, when steeper)
    for each row past it."""
    same = [m for m in measures if _is_verify(m) == k.verify]
    kind = "verify" if k.verify else "decode"
    pts = [(m.rows, m.bytes + _hidden_by_tiles(m, k, tiles)) for m in (same or measures)]
    widest = max(r for r, _ in pts)
    widths = ", ".join(map(str, sorted({r for r, _ in pts})))
    if same and k.rows <= widest:
        return _interpolate(pts, k.rows), True, f"{kind} steps measured at {widths} rows"
    per_row = max(SCRATCH_BOUND_A_ROW, _rise_per_row(pts))
    if same:
        past = k.rows - widest
        how = (f"bound: {kind} steps measured at {widths} rows, plus {per_row / 2**20:.2f} MiB "
               "a row past the widest")
    else:
        # The other kind's scratch is no bound at the same rows (a verify step of 8 rows
        # spills more than the decode step of 8: GPT-OSS 20b 1.40 MiB against 1.10, K3 on 64
        # ranks 2.15 against 0.77): every row counts as unmeasured.
        past = k.rows
        other = "decode" if k.verify else "verify"
        how = (f"bound: no {kind} step measured; {other} steps measured at {widths} rows, plus "
               f"{per_row / 2**20:.2f} MiB a row")
    return _interpolate(pts, min(k.rows, widest)) + round(per_row * max(0, past)), False, how


def compiler_scratch(s: ir.ScheduleIR, batch: "Kernel | int | None" = None) -> CompilerScratch:
    """Modelled compiler scratch of `batch`'s kernel (`as_kernel`; default: the widest):
    libtpu's measure for this geometry and kernel kind at its shortest measured KV tiles over
    rows (`_at_width`: between measured widths measured, past them a bound), plus the family's
    steepest measured bytes a KV-tile token (`kv_token_bytes`) up to the spec's tiles, as long
    as they are no longer than a measured one (spill grows faster than linearly past that:
    GPT-OSS 20b at 512-token tiles). A geometry the family has not measured, or KV tiles
    longer than it measured, gets `UNMEASURED_SCRATCH_FACTOR` times the family's largest
    figure at that width. A family with no measure at all gets 0 and `check_compiler_scratch`
    refuses the spec."""
    k = as_kernel(s, batch)
    if not s.compiler_scratch:
        return CompilerScratch(0, False, f"family {s.family} has no measured compiler scratch")
    key = scratch_key(s)
    tiles = lambda entries: kv_tile_bytes(s, entries)  # noqa: E731
    tokens = max((kind.kv.tokens for kind in s.kinds.values() if kind.kv), default=0)
    own = [m for m in s.compiler_scratch if m.key == key]
    kind = [m for m in own if _is_verify(m) == k.verify] or own
    # the shortest tiles this kernel kind was measured at (the other kind's, if never); tiles
    # longer than those only where this kind was measured at as long tiles and as many rows
    # (Llama 8B's 16-row verify step spills 1,260 bytes more a token past its measured 256,
    # its decode step at 8 rows 192)
    base = min((m.kv_tokens for m in kind), default=0)
    if own and (tokens <= base or any(m.kv_tokens >= tokens and m.rows >= k.rows for m in kind)):
        at = [m for m in own if m.kv_tokens == base]
        past, per_token = max(0, tokens - base), kv_token_bytes(own)
        n, measured, how = _at_width(at, k, tiles)
        n += round(per_token * past)
        source = (f"{'measured by libtpu' if measured else 'not measured at this width'} for "
                  f"this geometry ({how}), KV tiles of {base} tokens"
                  + (f" (+{per_token:.0f} bytes a token past them, measured "
                     f"up to {max(m.kv_tokens for m in own)})" if past else "")
                  + f" ({at[0].libtpu})"
                  + ("" if measured else f"; measure it with benchmarks/compiler_scratch.py "
                                         f"--spec {s.source}"))
        return _with_margin(n, measured, source)
    by_key: dict = {}
    for m in s.compiler_scratch:
        by_key.setdefault(m.key, []).append(m)
    n = max(round(UNMEASURED_SCRATCH_FACTOR * _at_width(ms, k, tiles)[0])
            for ms in by_key.values())
    what = (f"KV tiles of {tokens} tokens, longer than measured at this width" if own
            else _key_words(key))
    source = (f"bound, not measured for this geometry ({what}): {UNMEASURED_SCRATCH_FACTOR}x the "
              f"largest of family {s.family}'s {len(by_key)} measured geometries at this width; "
              f"measure it with benchmarks/compiler_scratch.py --spec {s.source}")
    return _with_margin(n, False, source)


def _with_margin(n: int, measured: bool, source: str) -> CompilerScratch:
    n = max(0, n) + COMPILER_SCRATCH_MARGIN
    return CompilerScratch(-(-n // 1024) * 1024, measured, source)


def kv_token_bytes(measures) -> float:
    """Scratch per KV-tile token: the steepest rise between two measures of one geometry,
    kernel and width at two tile lengths (0 when none was measured at two)."""
    groups: dict = {}
    for m in measures:
        groups.setdefault((m.key, m.kernel, m.rows), {})[m.kv_tokens] = m.bytes
    slopes = [(by[t1] - by[t0]) / (t1 - t0) for by in groups.values()
              for t0, t1 in zip(sorted(by), sorted(by)[1:])]
    return max([0.0, *slopes])


def _key_words(key: tuple[tuple[str, str], ...]) -> str:
    k = dict(key)
    return f"{k['chip']}, {k['ranks']} ranks, formats {k['formats'] or 'as checkpointed'}"


def compiler_overhead_bytes(s: ir.ScheduleIR, batch: "Kernel | int | None" = None) -> int:
    """Modelled compiler scratch of `batch`'s kernel (`as_kernel`; default: the widest)."""
    return compiler_scratch(s, batch).bytes


def check_compiler_scratch(s: ir.ScheduleIR) -> list[Diagnostic]:
    """A family that has never measured what libtpu allocates beyond its buffers cannot
    promise a fit: refused at the spec's `model` line."""
    if s.compiler_scratch:
        return []
    return [Diagnostic(
        "E-VMEM-SCRATCH", f"family {s.family} has no measured compiler scratch: mkc cannot "
        "say whether its kernels fit in VMEM (libtpu's spill slots are not modelled for it)",
        s.setting_spans.get("model", Span.unknown()),
        hint=f"measure it: `.venv/bin/python benchmarks/compiler_scratch.py --spec {s.source}` "
             "writes the family's compiler_scratch.json (docs/extending.md, 'Compiler scratch')")]


def vmem_inputs(s: ir.ScheduleIR, batch: "Kernel | int") -> list[ir.Buffer]:
    """Kernel inputs the family's module passes in VMEM (outputs are IR buffers, class
    "output"), one a row."""
    rows = as_kernel(s, batch).rows
    return [b.at_batch(rows) for b in s.vmem_inputs]


def _compiler_buffer(nbytes: int) -> ir.Buffer:
    return ir.Buffer("compiler_scratch", "compiler", (nbytes,), "u8")


@dataclass(frozen=True)
class Kernel:
    """One kernel a spec builds: the decode step of `rows` rows, one a sequence, or the verify
    step of `rows` rows, `rows // sequences` consecutive rows for each of `sequences`
    sequences. The two differ at one width: a verify step's KV tiles hold one entry a
    sequence, and libtpu's scratch is each kernel's own."""

    rows: int
    sequences: int
    verify: bool = False

    def __str__(self) -> str:
        if not self.verify:
            return f"decode step, batch {self.rows}"
        per, n = self.rows // self.sequences, self.sequences
        return f"verify step, {self.rows} rows ({n} sequence{'s' if n > 1 else ''} of {per})"


def as_kernel(s: ir.ScheduleIR, batch: "Kernel | int | None" = None) -> Kernel:
    """A kernel from a row count, as callers that ask by rows mean it: up to the largest decode
    batch the decode step, past it the verify step (its rows for as many sequences as they
    make); None: the widest kernel the spec builds (`ScheduleIR.rows_max`)."""
    if isinstance(batch, Kernel):
        return batch
    rows = batch or s.rows_max
    if rows > s.batch_max and s.verify_rows:
        return Kernel(rows, -(-rows // s.verify_rows), True)
    return Kernel(rows, rows)


def _width_cuts(s: ir.ScheduleIR) -> set[int]:
    """The widths (rows) past which a buffer's own widths (`Buffer.rows`) begin or end."""
    return {w for b in s.buffers if b.rows is not None for w in (b.rows[0] - 1, b.rows[1])}


def kernels(s: ir.ScheduleIR) -> list[Kernel]:
    """The kernels whose VMEM bounds every kernel's the spec builds, each judged on its own:
    the decode step at its largest batch and at the widest batch on either side of where a
    buffer's own widths begin or end (among decode steps holding the same buffers VMEM grows
    with the rows); the verify step for each number of sequences, and with fewer rows a
    sequence (a verify step may take fewer than `verify R`) the most on either side of such a
    cut."""
    cuts = _width_cuts(s)
    decode = {s.batch_max} | {w for w in cuts if s.batch_min <= w < s.batch_max}
    out = [Kernel(w, w) for w in sorted(decode)]
    if s.verify_rows:
        R, (lo, hi) = s.verify_rows, s.verify_sequences
        verify = {(R, n) for n in range(lo, hi + 1)}
        for c in cuts:
            for n in range(lo, hi + 1):             # fewer rows a sequence within the cut
                if 1 <= c // n < R:
                    verify.add((c // n, n))
        out += [Kernel(r * n, n, True) for r, n in sorted(verify, key=lambda rn: (rn[0] * rn[1], rn[1]))]
    return out


def kernel_buffers(s: ir.ScheduleIR, batch: "Kernel | int") -> list[ir.Buffer]:
    """The IR's buffers as `batch`'s kernel (`as_kernel`) allocates them. A verify step's KV
    tiles hold one entry a sequence (it streams each sequence's cache once), every other
    buffer one a row."""
    k = as_kernel(s, batch)
    tiles = {n for kind in s.kinds.values() if kind.kv for n in kind.kv.tile_buffers}
    return [b.at_batch(k.sequences if b.name in tiles else k.rows) for b in s.buffers
            if b.exists_at(k.rows)]


def bounding_widths(s: ir.ScheduleIR) -> list[int]:
    """The kernel widths (rows) whose VMEM bounds every kernel's the spec builds, for callers
    that ask by rows (`as_kernel`): the widest, and the widest on either side of where a
    buffer's own widths (`Buffer.rows`, an all-reduce's form by rows) begin or end. The VMEM
    verdict judges `kernels`."""
    widths = {s.rows_max} | _width_cuts(s)
    return sorted(w for w in widths if s.rows_min <= w <= s.rows_max)


def vmem_timeline(s: ir.ScheduleIR, events: list[Event], batch: "Kernel | int | None" = None
                  ) -> Iterator[tuple[Event | None, int, list[ir.Buffer]]]:
    """(event, bytes, buffers live) at kernel start (event None) and after each scoped
    allocation or free, for `batch`'s kernel (`as_kernel`; default: the widest): resident
    buffers, VMEM inputs and compiler scratch, plus the scoped buffers open."""
    batch = as_kernel(s, batch)
    buffers = kernel_buffers(s, batch)
    resident = ([b for b in buffers if b.scope is None] + vmem_inputs(s, batch)
                + [_compiler_buffer(compiler_overhead_bytes(s, batch))])
    by_name = {b.name: b for b in buffers}
    base = sum(b.vmem_bytes for b in resident)
    live: dict[str, ir.Buffer] = {}

    def allocated(e: Alloc) -> None:
        live[e.buffer] = by_name[e.buffer]

    def freed(e: Free) -> None:
        live.pop(e.buffer, None)

    # pool views share their pool's bytes, resident all step: they change nothing here
    changes = EventHandlers("the VMEM timeline", {
        Alloc: allocated, Free: freed,
        CopyStart: None, CopyWait: None, Read: None, Write: None, ViewOpen: None, ViewClose: None,
        OpBegin: None, Collective: None, LayerBegin: None, EpilogueBegin: None, Exit: None})
    yield None, base, list(resident)
    for e in events:
        change = changes.handler(e)
        if change is None:
            continue
        change(e)
        yield e, base + sum(b.vmem_bytes for b in live.values()), resident + list(live.values())


def vmem_budget(s: ir.ScheduleIR, events: list[Event], batch: "Kernel | int | None" = None
                ) -> tuple[int, str, list[ir.Buffer]]:
    """(peak bytes, where, buffers live there) for `batch`'s kernel (see `vmem_timeline`); the
    first point of the peak."""
    peak, where, at_peak = -1, "", []
    for e, total, live in vmem_timeline(s, events, batch):
        if total > peak:
            peak, where, at_peak = total, e.where if e else "kernel start", live
    return peak, where, at_peak


def judged_kernels(s: ir.ScheduleIR, events: list[Event]
                   ) -> list[tuple[Kernel, tuple[int, str, list[ir.Buffer]]]]:
    """Every kernel the VMEM verdict judges (`kernels`) with its peak (`vmem_budget`)."""
    return [(k, vmem_budget(s, events, k)) for k in kernels(s)]


def check_vmem(s: ir.ScheduleIR, events: list[Event]) -> list[Diagnostic]:
    """Every kernel the spec builds (`kernels`) within the budget. Over it, the diagnostic
    names the kernel with the largest peak and its caret is at the statement that makes the
    largest buffer live there (what to shrink); the settings that would also fit it (`verify`,
    `batch`, `vmem limit`) are notes at their own lines, with what to write; every other kernel
    over the budget is a note."""
    budget = vmem_budget_bytes(s)
    judged = judged_kernels(s, events)
    over = [(k, p) for k, p in judged if p[0] > budget]
    if not over:
        return []
    kernel, (peak, where, live) = max(over, key=lambda kp: (kp[1][0], kp[0].rows))
    biggest = sorted(live, key=lambda b: -b.vmem_bytes)
    listing = [f"{b.label:<16} {b.cls:<11} {str(b.shape):<24} {b.dtype:<5} "
               f"{b.vmem_bytes / 2**20:8.2f} MiB" for b in biggest]
    shrink = _largest_the_spec_makes(s, biggest)
    span = _buffer_span(s, shrink)
    largest = f"the largest buffer ({shrink.label}, {shrink.vmem_bytes / 2**20:.2f} MiB)"
    hint = (f"shrink {largest}: fewer ring slots, a smaller tile or batch, or scope it more "
            "tightly")
    settings: list[str] = []
    widest_decode = max(k.rows for k, _ in judged if not k.verify)
    if kernel.verify and all(p[0] <= budget for k, p in judged if not k.verify):
        # Decoding fits: the verify step's rows are what overflow.
        fix = _verify_fix(s, events, budget)
        settings.append(_setting_note(s, "verify", fix))
        hint = f"{fix}; or shrink {largest}"
    elif not kernel.verify and kernel.rows == widest_decode and (
            fits_up_to := _largest_batch_that_fits(s, events, budget, s.batch_min,
                                                   s.batch_max)) is not None:
        # The batch range is what overflows.
        fix = f"the kernel fits up to batch {fits_up_to}: write `batch {s.batch_min} to {fits_up_to}`"
        settings.append(_setting_note(s, "batch", fix))
        hint = f"{fix}; for larger batches shrink {largest}"
    if (limit_to := _limit_that_fits(s, peak)) is not None:   # the limit is the cap
        raise_it = (f"raise the limit: `vmem limit {limit_to} MiB` fits (the chip has "
                    f"{usable_vmem_bytes(s) / 2**20:.2f} MiB usable)")
        settings.append(_setting_note(s, "vmem", raise_it))
        hint = f"{raise_it}; or {hint}"
    others = [f"also over the budget: the {k} ({p[0] / 2**20:.2f} MiB)" for k, p in over
              if k != kernel]
    return [Diagnostic(
        "E-VMEM-CAPACITY",
        f"VMEM needs {peak / 2**20:.2f} MiB at {where} in the {kernel}, over the budget "
        f"of {_budget_words(s)}", span, hint=hint,
        notes=[n for n in settings if n] + others
        + [f"live at the peak of the {kernel} (as Mosaic allocates them, compiler scratch "
           f"modelled: {compiler_scratch(s, kernel).source}):"] + listing)]


def _verify_fix(s: ir.ScheduleIR, events: list[Event], budget: int) -> str:
    """What `verify` line fits when decoding does: fewer rows a sequence for as many
    sequences, else as many rows for fewer sequences (each the largest that fits)."""
    R, (lo, hi) = s.verify_rows, s.verify_sequences

    def fits(rows: int, sequences: int) -> bool:
        return vmem_budget(s, events, Kernel(rows * sequences, sequences, True))[0] <= budget
    rows = _largest(2, R, lambda r: fits(r, hi))
    if rows is not None:
        return (f"the verify step fits at {rows} rows for {hi} sequences: write "
                f"`verify {rows}" + (f" sequences {lo} to {hi}`" if hi > 1 else "`"))
    sequences = _largest(lo, hi, lambda n: fits(R, n))
    if sequences is not None:
        return (f"the verify step fits at {R} rows for up to {sequences} sequences: write "
                f"`verify {R} sequences {lo} to {sequences}`")
    return f"no verify step of {R} rows fits: a verify step needs at least 2 rows a sequence"


def _largest(lo: int, hi: int, fits: Callable[[int], bool]) -> int | None:
    """The largest n in lo..hi with fits(n), if fits(lo) (fits holds up to a point)."""
    if lo > hi or not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def _largest_the_spec_makes(s: ir.ScheduleIR, biggest: list[ir.Buffer]) -> ir.Buffer:
    """The largest of `biggest` (largest first) a statement of the spec makes (a ring, KV
    tiles, a state buffer, a pool...); else the largest buffer mkc adds itself."""
    own = [b for b in biggest if b.cls not in ("compiler", "input")]
    return next((b for b in own if b.span.file == s.source), own[0])


def _setting_note(s: ir.ScheduleIR, key: str, fix: str) -> str:
    """A note at a header setting's line: what to write there instead."""
    span = s.setting_spans.get(key)
    written = {"vmem": "vmem limit"}.get(key, key)
    return f"line {span.line} (`{written}`): {fix}" if span is not None else ""


def check_each_buffer_fits(s: ir.ScheduleIR) -> list[Diagnostic]:
    """Every buffer alone within the budget in every kernel the spec builds (`kernels`):
    checked on the IR before the trace, whose size is bounded only for schedules that pass it
    (KV slots, say). The caret is at the statement that makes the buffer; a limit that would
    fit it is a note at its line."""
    budget = vmem_budget_bytes(s)
    diags = []
    largest: dict[str, tuple[Kernel, ir.Buffer]] = {}
    for k in kernels(s):
        for b in kernel_buffers(s, k):
            if b.name not in largest or b.vmem_bytes > largest[b.name][1].vmem_bytes:
                largest[b.name] = (k, b)
    for kernel, b in largest.values():
        if b.vmem_bytes > budget:
            hint = "fewer slots, smaller tiles or a smaller batch"
            notes = [f"{b.label}: {b.cls} {list(b.shape)} {b.dtype}"]
            if (limit_to := _limit_that_fits(s, b.vmem_bytes)) is not None:
                raise_it = (f"raise the limit (the chip has {usable_vmem_bytes(s) / 2**20:.2f} MiB "
                            f"usable): this buffer alone needs `vmem limit {limit_to} MiB`, the "
                            "whole kernel more")
                hint = f"{raise_it}; or {hint}"
                notes.append(_setting_note(s, "vmem", raise_it))
            diags.append(Diagnostic(
                "E-VMEM-CAPACITY", f"{b.label} alone needs {b.vmem_bytes / 2**20:.2f} MiB of VMEM "
                f"in the {kernel}, over the budget of {_budget_words(s)}",
                _buffer_span(s, b), hint=hint, notes=[n for n in notes if n]))
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


def _largest_batch_that_fits(s: ir.ScheduleIR, events: list[Event], budget: int, lo: int,
                             hi: int) -> int | None:
    """The largest decode batch in lo..hi whose kernel fits, if lo's does (VMEM grows with the
    rows, so a bisection needs a handful of budget evaluations)."""
    return _largest(lo, hi, lambda b: vmem_budget(s, events, Kernel(b, b))[0] <= budget)


def check_hbm(s: ir.ScheduleIR) -> list[Diagnostic]:
    if s.fits_hbm:
        return []
    per_chip, capacity = s.hbm_bytes_per_chip, s.hbm_capacity_per_chip
    parts = ", ".join(f"{k} {v * s.cores_per_chip / 1e9:.1f} GB"
                      for k, v in s.hbm_bytes_per_rank.items())
    return [Diagnostic(
        "E-HBM-CAPACITY", f"each chip needs {per_chip / 1e9:.1f} GB of HBM but has "
        f"{capacity / 1e9:.1f} GB", s.setting_spans.get("context", Span.unknown(s.source)),
        notes=[parts],
        hint="use a larger topology (more chips share the weights), a shorter context or a "
             "smaller batch")]
