"""The resolve driver: one flat list of passes, each run once, in order.

A pass takes the state the passes before it produced and returns a new one (`ResolveState`);
none calls another. The order is the order diagnostics are found in: a spec's first problem in
this order is the one reported. Each pass declares the state fields it reads and writes; the
list is checked when it is built (a pass reads only what an earlier pass writes, and each
field has one writer), and each run of a pass is checked to change only the fields it
declares, setting each. After each pass the state is verified (`invariants.py`): what the
passes so far established still holds.
"""
from __future__ import annotations

import dataclasses
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
from mkc.resolve.invariants import ResolveInvariantError, verify_state
from mkc.resolve.kinds import resolve_kinds
from mkc.resolve.kv_ring import resolve_kv_ring
from mkc.resolve.model import resolve_model
from mkc.resolve.parity import resolve_parity
from mkc.resolve.phases import resolve_layer_kinds, resolve_phases
from mkc.resolve.pools import resolve_pools
from mkc.resolve.refills import resolve_refills
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
    reads: tuple[str, ...]       # the `ResolveState` fields it reads
    writes: tuple[str, ...]      # the fields it sets: it is their one writer


class PassOrderError(ValueError):
    """A list of passes whose declarations do not fit its order: a bug in mkc."""


# What the driver sets: the parsed spec and a `--model` override (inputs), and the passes run.
DRIVER_FIELDS = ("sched", "model_override", "passes")
_PASS_FIELDS = tuple(f.name for f in dataclasses.fields(ResolveState) if f.name not in DRIVER_FIELDS)


def checked(passes: tuple[Pass, ...]) -> tuple[Pass, ...]:
    """`passes` if each reads only fields the driver or an earlier pass writes, each field of
    the state has exactly one writer, and every declared name is a field; else PassOrderError."""
    writer = {f: "the driver" for f in DRIVER_FIELDS}
    for p in passes:
        unknown = [f for f in (*p.reads, *p.writes) if f not in writer and f not in _PASS_FIELDS]
        if unknown:
            raise PassOrderError(f"resolve pass {p.name!r} declares {unknown[0]!r}, which is no "
                                 "field of ResolveState")
        for f in p.reads:
            if f not in writer:
                later = next((q.name for q in passes if f in q.writes), None)
                raise PassOrderError(
                    f"resolve pass {p.name!r} reads {f}, which no pass before it writes"
                    + ("" if later is None else " (it writes it itself)" if later == p.name
                       else f" (pass {later!r} writes it, and runs after it)"))
        for f in p.writes:
            if f in writer:
                raise PassOrderError(f"{f} is written by {writer[f]} and by resolve pass "
                                     f"{p.name!r}: each field of the state has one writer")
            writer[f] = f"resolve pass {p.name!r}"
    unwritten = [f for f in _PASS_FIELDS if f not in writer]
    if unwritten:
        raise PassOrderError(f"no resolve pass writes {', '.join(unwritten)}")
    return passes


PASSES: tuple[Pass, ...] = checked((
    # the schedule's name; config, dims, family, and the checkpoint it is in
    Pass("model", resolve_model, reads=("sched", "model_override"),
         writes=("model_config", "dims", "family", "checkpoint")),
    # the slice and the mesh over its ranks
    Pass("target", resolve_target, reads=("sched",), writes=("topology", "mesh_axis")),
    # batch range and context
    Pass("batch", resolve_batch, reads=("sched",), writes=("batch", "context")),
    # the verify step's rows and sequences
    Pass("verify", resolve_verify, reads=("sched", "batch", "context"),
         writes=("verify_rows", "verify_sequences")),
    # VMEM limit and reserve
    Pass("vmem", resolve_vmem, reads=("sched", "topology"), writes=("vmem_limit", "vmem_reserve")),
    # shard rules: class -> rank group
    Pass("sharding", resolve_sharding, reads=("sched", "dims", "family", "topology", "mesh_axis"),
         writes=("shards",)),
    # weight formats per matrix class
    Pass("formats", resolve_formats, reads=("sched", "dims", "family", "topology"),
         writes=("formats", "dense_formats")),
    # the family's graph under rules and formats
    Pass("graph", resolve_graph, reads=("sched", "dims", "family", "topology", "mesh_axis",
                                        "shards", "formats", "dense_formats"),
         writes=("graph",)),
    # a phase block per layer kind
    Pass("layer_kinds", resolve_layer_kinds, reads=("sched", "dims", "family", "graph"), writes=("phases",)),
    # pools and the matrices their views hold
    Pass("pools", resolve_pools, reads=("sched", "family", "graph", "phases"), writes=("pools", "pooled")),
    # the weight ring and the stream through it
    Pass("stream", resolve_stream, reads=("sched", "family", "graph", "pooled"), writes=("stream",)),
    # the per-layer vector block
    Pass("parity", resolve_parity, reads=("sched", "graph"), writes=("parity",)),
    # state copies, scoped ranges, KV tiles
    Pass("phases", resolve_phases, reads=("dims", "batch", "context", "graph", "phases", "pooled"),
         writes=("phase_schedules", "kind_buffers")),
    # windows' KV rings; layer kinds' context limits
    Pass("kv_ring", resolve_kv_ring, reads=("sched", "dims", "context", "graph", "phases",
                                            "phase_schedules"),
         writes=("kv_rings", "context_limits")),
    # all-reduces, gathers, the embedding's reduce
    Pass("collectives", resolve_collectives,
         reads=("dims", "topology", "mesh_axis", "batch", "verify_rows", "verify_sequences",
                "shards", "graph", "phases", "phase_schedules", "kind_buffers"),
         writes=("collectives", "embed_reduce", "reduce_buffers")),
    # copies into pool views
    Pass("views", resolve_views, reads=("dims", "graph", "phases", "pools", "phase_schedules"),
         writes=("view_copies",)),
    # ring refills held back to a later point
    Pass("refills", resolve_refills, reads=("sched", "batch", "verify_rows", "verify_sequences",
                                            "phases", "phase_schedules", "stream"),
         writes=("refills",)),
    # each layer kind's schedule, assembled
    Pass("kinds", resolve_kinds, reads=("phase_schedules", "kv_rings", "collectives",
                                        "view_copies", "refills"),
         writes=("kinds",)),
    # every VMEM buffer, names unique
    Pass("buffers", resolve_buffers,
         reads=("sched", "dims", "batch", "graph", "pools", "stream", "parity", "kinds",
                "kind_buffers", "collectives", "reduce_buffers"),
         writes=("buffers",)),
    # HBM bytes per rank
    Pass("hbm", resolve_hbm, reads=("batch", "context", "verify_rows", "verify_sequences", "graph",
                                    "pools", "stream", "parity", "kinds"),
         writes=("hbm_bytes_per_rank",)),
    # the headroom the spec promises to leave
    Pass("expect", resolve_expect, reads=("sched",), writes=("expectations",)),
    # the schedule IR
    Pass("ir", resolve_ir, reads=("sched", "model_config", "dims", "family", "checkpoint",
                                  "topology", "mesh_axis", "batch", "context", "verify_rows",
                                  "verify_sequences", "vmem_limit", "vmem_reserve", "shards",
                                  "graph", "pools", "stream", "parity", "kinds", "embed_reduce",
                                  "buffers", "hbm_bytes_per_rank", "expectations"),
         writes=("schedule_ir",)),
))
PASS_NAMES: tuple[str, ...] = tuple(p.name for p in PASSES)


def run(sched: ast.Schedule, model_override: str | None = None, *,
        after: str | None = None) -> ResolveState:
    """The state after every pass, or after pass `after` (one of PASS_NAMES)."""
    if after is not None and after not in PASS_NAMES:
        raise ValueError(f"no resolve pass {after!r}: the passes are {', '.join(PASS_NAMES)}")
    state = ResolveState(sched, model_override)
    for p in PASSES:
        new = p.run(state)
        _check_writes(p, state, new)
        state = replace(new, passes=state.passes + (p.name,))
        verify_state(state, p.name)
        if p.name == after:
            break
    return state


def _check_writes(p: Pass, before: ResolveState, after: ResolveState) -> None:
    """A pass changed only the fields it declares, and set each (`replace` keeps every other
    field's object, so a comparison by identity is exact and costs one per field)."""
    changed = [f for f in _PASS_FIELDS if getattr(after, f) is not getattr(before, f)]
    undeclared = [f for f in changed if f not in p.writes]
    unset = [f for f in p.writes if getattr(after, f) is None]
    if undeclared or unset or after.sched is not before.sched:
        what = (f"changed {undeclared[0]}, which it does not declare" if undeclared else
                f"left {unset[0]} unset, which it declares" if unset else "changed the spec")
        raise ResolveInvariantError(f"mkc internal error: resolve pass {p.name!r} {what} "
                                    "(`Pass.writes`). This is a bug in mkc, not in the spec")
