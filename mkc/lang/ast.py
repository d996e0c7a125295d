"""Typed AST of a .sched file; every node keeps the span it was parsed from."""
from __future__ import annotations

from dataclasses import dataclass, field

from mkc.diagnostics import Span


@dataclass(frozen=True)
class Name:
    text: str
    span: Span


@dataclass(frozen=True)
class Point:
    """A program point inside a phase: `at start|end`, `before OP`, `after OP`."""

    where: str          # "at" | "before" | "after" | "before next"
    anchor: Name

    def __str__(self) -> str:
        return f"{self.where} {self.anchor.text}"


@dataclass(frozen=True)
class Binding:
    """`src -> dst` in a load or store; one side names HBM state, the other a VMEM buffer."""

    src: Name
    dst: Name


@dataclass(frozen=True)
class Scoped:
    buffers: list[Name]
    first: Name         # an op name or "start"
    last: Name          # an op name or "end"
    span: Span


@dataclass(frozen=True)
class Transfer:
    """A load (HBM->VMEM) or store (VMEM->HBM) with its start point and wait points."""

    direction: str      # "load" | "store"
    bindings: list[Binding]
    start: Point
    waits: list[Point]
    span: Span


@dataclass(frozen=True)
class KvTiles:
    slots: int
    tokens: int
    ahead: int
    span: Span


@dataclass(frozen=True)
class AllReduce:
    ops: list[Name]
    algorithm: Name
    level: Name | None          # the grouping of a two_level all-reduce: chip or host
    wire_dtype: Name
    span: Span


@dataclass(frozen=True)
class Group:
    """A set of ranks: `tp` (the mesh axis), `tp / N`, `host`, `chip`, or N consecutive ranks."""

    name: Name | None           # None for a bare count
    divisor: int | None = None  # `tp / N`
    ways: int | None = None     # a bare count
    span: Span = field(default_factory=Span.unknown)


@dataclass(frozen=True)
class AllGather:
    ops: list[Name]
    group: Group
    span: Span


@dataclass(frozen=True)
class Exchange:
    ops: list[Name]
    peer: Name                  # `sibling`: the other core of the chip
    wire_dtype: Name
    span: Span


@dataclass(frozen=True)
class Fetch:
    """`fetch experts -> POOL.VIEW after OP`: expert copies start as routing picks them."""

    view: Name                  # dotted pool.view
    start: Point
    span: Span


@dataclass(frozen=True)
class Prefetch:
    """`prefetch next POOL.VIEW at|after P`: the next layer's view is copied from point P."""

    view: Name
    start: Point
    span: Span


@dataclass
class Phase:
    kind: Name
    scoped: list[Scoped] = field(default_factory=list)
    transfers: list[Transfer] = field(default_factory=list)
    kv_tiles: list[KvTiles] = field(default_factory=list)
    allreduces: list[AllReduce] = field(default_factory=list)
    allgathers: list[AllGather] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    fetches: list[Fetch] = field(default_factory=list)
    prefetches: list[Prefetch] = field(default_factory=list)
    span: Span = field(default_factory=Span.unknown)


@dataclass(frozen=True)
class ViewKind:
    kind: Name
    families: list[Name]


@dataclass(frozen=True)
class PoolView:
    name: Name
    kinds: list[ViewKind]       # a weight view: whole matrices per layer kind
    slots: int = 0              # a slot view: N routed experts
    slot_of: Name | None = None
    span: Span = field(default_factory=Span.unknown)


@dataclass(frozen=True)
class Pool:
    name: Name
    views: list[PoolView]
    span: Span


@dataclass(frozen=True)
class Ring:
    name: Name
    slots: int
    dtype: Name
    max_rows: int
    max_cols: int
    span: Span


@dataclass(frozen=True)
class StreamKind:
    kind: Name
    families: list[Name]


@dataclass(frozen=True)
class Stream:
    ring: Name
    ahead: int
    per_kind: list[StreamKind]
    tail: list[Name]
    span: Span


@dataclass(frozen=True)
class Parity:
    name: Name
    ahead: int
    span: Span


@dataclass(frozen=True)
class Shard:
    dim: Name
    group: Group
    span: Span


@dataclass(frozen=True)
class Format:
    """`format <matrix class> <format>`: how a matrix class is stored and fed to the MXU."""

    matrix: Name         # e.g. expert.gate_up
    format: Name
    span: Span
    block: int | None = None     # input rows one scale covers, if the spec says


@dataclass(frozen=True)
class Setting:
    """A header value with its span, so resolution errors can point at it."""

    value: object
    span: Span


@dataclass
class Schedule:
    name: Name
    source_file: str
    settings: dict[str, Setting] = field(default_factory=dict)   # model, target, mesh, ...
    shards: list[Shard] = field(default_factory=list)
    formats: list[Format] = field(default_factory=list)
    rings: list[Ring] = field(default_factory=list)
    streams: list[Stream] = field(default_factory=list)
    parities: list[Parity] = field(default_factory=list)
    pools: list[Pool] = field(default_factory=list)
    phases: list[Phase] = field(default_factory=list)
