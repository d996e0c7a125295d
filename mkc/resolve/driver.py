"""The resolve driver: one flat list of passes, each run once, in order.

A pass takes the state the passes before it produced and returns a new one (`ResolveState`);
none calls another. The order is the order diagnostics are found in: a spec's first problem in
this order is the one reported. After each pass the state is verified (`invariants.py`): what
the passes so far established still holds.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from mkc.lang import ast
from mkc.resolve.assemble import resolve_ir
from mkc.resolve.buffers import resolve_buffers
from mkc.resolve.collectives import resolve_collectives
from mkc.resolve.expect import resolve_expect
from mkc.resolve.formats import resolve_formats
from mkc.resolve.graph import resolve_graph
from mkc.resolve.hbm import resolve_hbm
from mkc.resolve.invariants import verify_state
from mkc.resolve.kv_ring import resolve_kv_ring
from mkc.resolve.model import resolve_model
from mkc.resolve.parity import resolve_parity
from mkc.resolve.phases import resolve_layer_kinds, resolve_phases
from mkc.resolve.pools import resolve_pools
from mkc.resolve.settings import resolve_batch, resolve_vmem
from mkc.resolve.sharding import resolve_sharding
from mkc.resolve.state import ResolveState
from mkc.resolve.stream import resolve_stream
from mkc.resolve.target import resolve_target
from mkc.resolve.verify import resolve_verify
from mkc.resolve.views import resolve_views


@dataclass(frozen=True)
class Pass:
    name: str                    # as `mkc ir --after NAME` spells it
    run: Callable[[ResolveState], ResolveState]


PASSES: tuple[Pass, ...] = (
    Pass("model", resolve_model),              # the schedule's name; config, dims, family
    Pass("target", resolve_target),            # the slice and the mesh over its ranks
    Pass("batch", resolve_batch),              # batch range and context
    Pass("verify", resolve_verify),            # the verify step's rows and sequences
    Pass("vmem", resolve_vmem),                # VMEM limit and reserve
    Pass("sharding", resolve_sharding),        # shard rules: class -> rank group
    Pass("formats", resolve_formats),          # weight formats per matrix class
    Pass("graph", resolve_graph),              # the family's graph under rules and formats
    Pass("layer_kinds", resolve_layer_kinds),  # a phase block per layer kind
    Pass("pools", resolve_pools),              # pools and the matrices their views hold
    Pass("stream", resolve_stream),            # the weight ring and the stream through it
    Pass("parity", resolve_parity),            # the per-layer vector block
    Pass("phases", resolve_phases),            # state copies, scoped ranges, KV tiles
    Pass("kv_ring", resolve_kv_ring),          # windows' KV rings; layer kinds' context limits
    Pass("collectives", resolve_collectives),  # all-reduces, gathers, the embedding's reduce
    Pass("views", resolve_views),              # copies into pool views
    Pass("buffers", resolve_buffers),          # every VMEM buffer, names unique
    Pass("hbm", resolve_hbm),                  # HBM bytes per rank
    Pass("expect", resolve_expect),            # the headroom the spec promises to leave
    Pass("ir", resolve_ir),                    # the schedule IR
)
PASS_NAMES: tuple[str, ...] = tuple(p.name for p in PASSES)


def run(sched: ast.Schedule, model_override: str | None = None, *,
        after: str | None = None) -> ResolveState:
    """The state after every pass, or after pass `after` (one of PASS_NAMES)."""
    if after is not None and after not in PASS_NAMES:
        raise ValueError(f"no resolve pass {after!r}: the passes are {', '.join(PASS_NAMES)}")
    state = ResolveState(sched, model_override)
    for p in PASSES:
        state = replace(p.run(state), passes=state.passes + (p.name,))
        verify_state(state, p.name)
        if p.name == after:
            break
    return state
