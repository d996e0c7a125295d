"""Pass `verify`: `verify R sequences S1 to S2`, the speculative-decoding verify step."""
from __future__ import annotations

from dataclasses import replace

from mkc import ir
from mkc.diagnostics import fail
from mkc.resolve.state import ResolveState


def resolve_verify(s: ResolveState) -> ResolveState:
    """(R, (S1, S2)); (0, (0, 0)) without a verify step. The sequences must lie in the batch
    range: a commit hands the decode step their state."""
    setting = s.sched.settings.get("verify")
    if setting is None:
        return replace(s, verify_rows=0, verify_sequences=(0, 0))
    (b_lo, b_hi), context = s.batch, s.context
    rows, (s_lo, s_hi) = setting.value
    if rows < 2:
        raise fail("E-VERIFY", f"verify {rows} checks no drafts: a verify step takes an anchor "
                   "and at least one draft per sequence", setting.span,
                   hint="write `verify 8` (1 anchor + 7 drafts), or drop the line to decode only")
    window = ir.kv_window_tiles(rows) * ir.SUBLANE_TILE["bf16"]
    if rows >= context or window > context:
        # A sequence's new K/V rows are written through a window of aligned 16-token tiles.
        raise fail("E-VERIFY", f"verify {rows} rows do not fit the context of {context} tokens"
                   + (f" (their K/V rows are written through a {window}-token window)"
                      if rows < context else ""),
                   setting.span, hint=_rows_hint(context, window))
    if not 1 <= s_lo <= s_hi:
        raise fail("E-VERIFY", f"verify sequences {s_lo} to {s_hi} is empty or starts below 1",
                   setting.span, hint=f"write `verify {rows} sequences 1`")
    if not (b_lo <= s_lo and s_hi <= b_hi):
        raise fail("E-VERIFY", f"verify sequences {s_lo} to {s_hi} leave the batch range "
                   f"{b_lo} to {b_hi}: the decode step continues from a verify step's state",
                   setting.span, hint=f"use sequences within {b_lo} to {b_hi}, or widen `batch`")
    return replace(s, verify_rows=rows, verify_sequences=(s_lo, s_hi))


def _rows_hint(context: int, window: int) -> str:
    tile = ir.SUBLANE_TILE["bf16"]
    most = min(context - 1, tile * (context // tile - 1) + 1)    # the widest window that fits
    if most >= 2:
        return f"verify at most {most} rows, e.g. `verify {min(most, 8)}`"
    return f"a verify step needs a context of at least {window} tokens"
