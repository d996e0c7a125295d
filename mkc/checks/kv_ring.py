"""Capacity of a window's KV ring (`kv ring N slots`, `mkc.resolve.kv_ring`): the ring must
hold, at the moment a row attends, every position of that row's window.

A kernel writes a sequence's R new rows (consecutive positions p .. p + R - 1; R = 1 when
decoding, the verify step's rows otherwise) into the ring before any of them attends, position
q into slot q % N. Row p's window is p - W + 1 .. p, and the write of p + R - 1 lands on the
slot of p + R - 1 - N, so the window survives exactly when p + R - 1 - N < p - W + 1, that is
N >= W + R - 1. Checked over every kernel the spec builds (decode, and verify when declared).
The ring also holds the tiles that stream it (`kv tiles S slots of T tokens`): N >= S x T, or
the first tiles started ahead would copy from past its end."""
from __future__ import annotations

from mkc import ir
from mkc.diagnostics import Diagnostic


def ring_needs(window: int, rows: int) -> int:
    """Slots a ring needs to keep each of a sequence's `rows` consecutive new rows' window of
    `window` positions after all of them are written."""
    return window + rows - 1


def check_kv_rings(s: ir.ScheduleIR) -> list[Diagnostic]:
    diags = []
    rows = max(1, s.verify_rows)
    for kname in sorted(s.kinds):
        kv = s.kinds[kname].kv
        if kv is None or not kv.ring:
            continue
        need = ring_needs(kv.window, rows)
        span = kv.slots * kv.tokens
        if kv.ring < need:
            step = (f", plus {rows - 1} for the verify step's {rows} rows a sequence (each row's "
                    "window must survive the later rows' writes)") if rows > 1 else ""
            fit = -(-max(need, span) // kv.tokens) * kv.tokens
            diags.append(Diagnostic(
                "E-KV-RING", f"a KV ring of {kv.ring} slots cannot hold layer kind {kname}'s "
                f"window of {kv.window} positions{step}: it needs {need} slots", kv.ring_span,
                notes=[f"a row at position p reads positions p - {kv.window - 1} .. p; the write "
                       f"of position p + {rows - 1} lands in the slot of p + {rows - 1} - {kv.ring}"],
                hint=f"write `kv ring {fit} slots` (whole {kv.tokens}-token KV tiles)"))
        elif kv.ring < span:
            # The tiles stream the ring's tiles through `slots` VMEM slots, the first `ahead`
            # started at once: slots past the ring's tiles would copy from past its end.
            tiles = kv.ring // kv.tokens
            diags.append(Diagnostic(
                "E-KV-RING", f"a KV ring of {kv.ring} slots is shorter than layer kind {kname}'s "
                f"KV tiles: {kv.slots} slots of {kv.tokens} tokens span {span} positions, the "
                f"ring holds {tiles} tile{'s' * (tiles != 1)}", kv.ring_span,
                notes=[f"the tiles are declared at {kv.span.file}:{kv.span.line}" if kv.span.line
                       else "the KV tiles stream the ring tile by tile"],
                hint=f"write `kv ring {span} slots`, or `kv tiles {tiles} slots of {kv.tokens} "
                     f"tokens ahead {min(kv.ahead, max(1, tiles - 1))}` (or smaller tiles)"))
    return diags
