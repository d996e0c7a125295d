"""What resolve passes hand each other: the parsed schedule and the parts resolved so far.

A pass reads the fields earlier passes set and returns a new state with its own fields set
(`dataclasses.replace`); a field is None until its pass has run. Each field has one writer,
and each pass declares what it reads and writes (`driver.Pass`). `to_json` prints what is set,
for `mkc ir --after PASS`: IR parts as they are, working objects (the family's graph, the
phases' AST) as a summary or not at all.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from mkc import ir, target
from mkc.lang import ast
from mkc.model.family import Family
from mkc.model.graph import DecodeGraph
from mkc.model.sharding import ShardTable


def _graph_summary(g: DecodeGraph) -> dict:
    return {"layer_kinds": list(g.layer_kinds), "per_rank": g.per_rank,
            "ops": {k: [o.name for o in kind.ops] for k, kind in g.kinds.items()},
            "activations": g.activations, "formats": g.formats}


HIDDEN = {"json": None}          # not printed: the input, or a working object with no summary


@dataclass(frozen=True)
class KindCollectives:
    """A layer kind's collectives, as its phase's lines resolve them."""
    allreduces: list[ir.AllReduce]
    allgathers: list[ir.AllGather]
    exchanges: list[ir.Exchange]
    buffers: tuple[ir.Buffer, ...]       # the all-gathers' and exchanges' receive buffers


@dataclass(frozen=True)
class ViewCopies:
    """A layer kind's copies into pool views: its routed experts, the next layer's weights."""
    fetch: ir.ViewCopy | None
    prefetch: ir.ViewCopy | None


@dataclass(frozen=True)
class ResolveState:
    sched: ast.Schedule = field(metadata=HIDDEN)
    model_override: str | None = field(default=None, metadata=HIDDEN)
    passes: tuple[str, ...] = ()                  # the passes run so far, in order
    # model: the config the spec names, the family's dims read from it, and the family
    model_config: dict | None = None
    dims: Any = None
    family: Family | None = field(default=None, metadata=HIDDEN)
    checkpoint: str | None = None        # the checkpoint directory the config is in ("": none)
    # target: the slice and the mesh over its ranks
    topology: target.Topology | None = None
    mesh_axis: str | None = None
    # batch, verify, vmem: the header's sizes
    batch: tuple[int, int] | None = None          # (fewest, most) rows of a decode step
    context: int | None = None
    verify_rows: int | None = None
    verify_sequences: tuple[int, int] | None = None
    vmem_limit: int | None = None
    vmem_reserve: int | None = None
    # sharding, formats, graph: the family's graph built under the shard rules and formats
    shards: ShardTable | None = None
    formats: dict[str, ir.WeightFormat] | None = None
    # the dense classes' formats (`mkc.layers.dense_formats`), applied to the graph once built
    dense_formats: dict[str, ir.WeightFormat] | None = None
    graph: DecodeGraph | None = field(default=None, metadata={"json": _graph_summary})
    # layer_kinds: the phase block of each layer kind the model runs
    phases: dict[str, ast.Phase] | None = field(
        default=None, metadata={"json": lambda ps: {k: p.kind.span for k, p in ps.items()}})
    pools: list[ir.Pool] | None = None
    pooled: dict[str, dict[str, str]] | None = None   # kind -> matrix family -> "pool.view"
    stream: ir.Stream | None = None
    parity: ir.Parity | None = None
    # phases: each layer kind's schedule as its phase block writes it (its ops, state copies
    # and KV tiles; the KV ring, collectives and view copies are the fields below, which pass
    # `kinds` assembles), and the VMEM buffers its state copies and KV tiles use
    phase_schedules: dict[str, ir.KindSchedule] | None = None
    kind_buffers: dict[str, tuple[ir.Buffer, ...]] | None = None
    # kv_ring: the KV stream of each layer kind whose phase keeps it as a window's ring, and the
    # longest context each layer kind computes correctly (0: any; a kind's `ContextLimit`
    # unless its phase keeps its KV cache as a window's ring)
    kv_rings: dict[str, ir.KvStream] | None = None
    context_limits: dict[str, int] | None = None
    # collectives: each layer kind's, the embedding's all-reduce, and the all-reduces' receive
    # buffers
    collectives: dict[str, KindCollectives] | None = None
    embed_reduce: ir.AllReduce | None = None
    reduce_buffers: tuple[ir.Buffer, ...] | None = None
    view_copies: dict[str, ViewCopies] | None = None    # views: each layer kind's pool copies
    refills: dict[str, ir.RingRefill | None] | None = None   # refills: each kind's held-back ring refills
    kinds: dict[str, ir.KindSchedule] | None = None     # kinds: each layer kind's schedule
    buffers: list[ir.Buffer] | None = None        # every VMEM buffer of the kernel
    hbm_bytes_per_rank: dict[str, int] | None = None
    expectations: tuple[ir.Expectation, ...] | None = None   # expect: headroom promised
    schedule_ir: ir.ScheduleIR | None = None      # the last pass's: everything above, assembled

    def to_json(self) -> str:
        """Deterministic JSON of the fields set so far (spans included)."""
        shown = {}
        for f in dataclasses.fields(self):
            value, summary = getattr(self, f.name), f.metadata.get("json", _plain)
            if value is not None and summary is not None:
                shown[f.name] = _plain(summary(value))
        return json.dumps(shown, indent=1, sort_keys=True)


def widest_rows(s: ResolveState) -> int:
    """Rows of the widest kernel, of the batch range (pass `batch`) and the verify step (pass
    `verify`): what a `from N rows` clause may name at most."""
    return max(s.batch[1], (s.verify_rows or 0) * (s.verify_sequences or (0, 0))[1])


def _plain(v: object) -> object:
    """A value as JSON holds it: dataclasses and dicts as objects, tuples as lists."""
    if dataclasses.is_dataclass(v) and not isinstance(v, type):
        return {f.name: _plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
    if isinstance(v, dict):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    return v
