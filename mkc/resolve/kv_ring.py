"""Pass `kv_ring`: a phase's `kv ring N slots` (the window's KV ring of a layer kind that
attends to its last W positions only) on its KV stream, and the context each layer kind
computes correctly: a kind's `ContextLimit` (`mkc.model.graph`) holds unless its phase
declares the ring that lifts it.

What the ring must hold (its window, plus a verify step's extra rows) is proved by the checks
(`mkc.checks.kv_ring`); here: the ring belongs to a windowed kind with a KV stream, and its
slots are whole KV tiles."""
from __future__ import annotations

import dataclasses

from mkc import ir
from mkc.diagnostics import fail
from mkc.resolve.state import ResolveState


def resolve_kv_ring(s: ResolveState) -> ResolveState:
    rings: dict[str, ir.KvStream] = {}
    for kname in sorted(s.phase_schedules):
        phase, kind = s.phases[kname], s.graph.kinds[kname]
        declared = phase.kv_rings
        if len(declared) > 1:
            raise fail("E-DUPLICATE", "kv ring declared twice", declared[1].span,
                       hint="keep one `kv ring` line")
        if not declared:
            continue
        ring, kv = declared[0], s.phase_schedules[kname].kv
        if not kind.window or kv is None:
            raise fail("E-KV", f"layer kind {kname} attends to its whole context: its KV cache "
                       "has no window to keep as a ring", ring.span,
                       hint="remove the `kv ring` line (a ring holds a sliding window's last "
                            "positions)")
        if ring.slots < 1 or ring.slots % kv.tokens:
            raise fail("E-ALIGN", f"a KV ring of {ring.slots} slots is not a whole number of "
                       f"the phase's {kv.tokens}-token KV tiles", ring.span,
                       hint=f"use a multiple of {kv.tokens} slots, at least the window's "
                            f"{kind.window}: e.g. {-(-kind.window // kv.tokens) * kv.tokens}")
        rings[kname] = dataclasses.replace(kv, ring=ring.slots, window=kind.window,
                                           ring_span=ring.span)
    return dataclasses.replace(s, kv_rings=rings, context_limits=_check_context_limits(s, rings))


def _check_context_limits(s: ResolveState, rings: dict[str, ir.KvStream]) -> dict[str, int]:
    """The longest context each layer kind computes correctly (0: any): its `ContextLimit`
    (`mkc.model.graph`: a mechanism it needs is not declared) unless the phase keeps its KV
    cache as a ring of its window. E-CONTEXT at the spec's `context` line past one."""
    limits = {}
    for name in dict.fromkeys(s.graph.layer_kinds):
        limit = s.graph.kinds[name].context_limit
        limits[name] = 0 if limit is None or name in rings else limit.tokens
        if limits[name] and s.context > limits[name]:
            setting = s.sched.settings["context"]
            raise fail("E-CONTEXT", f"context {s.context} is longer than layer kind {name} of "
                       f"{s.dims.name} computes correctly ({limit.tokens} tokens): {limit.reason}",
                       setting.span, hint=limit.hint)
    return limits
