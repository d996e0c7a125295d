"""The collectives a layer runs: `allreduce`, `allgather`, `exchange`."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Group, Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// `direct`: every rank sends to every peer. `two_level chip|host`: reduce within each chip
// (or host) first, then across chips (hosts) among ranks with the same local index.
allreduce_item: "allreduce" name_list NAME NAME? "wire" NAME scatter? overlap?
// `scatter`: the first group reduce-scatters (member j sums column chunk j), the other stages
// reduce the chunk, and the first group all-gathers the chunk sums in f32. `nested`: every
// stage reduce-scatters its group's chunk, and the sums are gathered back stage by stage in
// reverse. `gather bf16`: the sums travel back in bf16 (the result rounded once), not f32.
// `from N rows`: kernels of fewer rows keep the one-shot stages.
scatter: SCATTER NESTED? scatter_gather? ("from" INT "rows")?
scatter_gather: "gather" NAME
SCATTER: "scatter"
NESTED: "nested"
// `overlap`: the collective starts after its op and finishes before the first op that reads
// its result, its stages advancing after each op between, while those ops compute.
overlap: OVERLAP
OVERLAP: "overlap"
// Column shards of an op's output gathered over the group its weight is split over.
allgather_item: "allgather" name_list "over" shard_group overlap?
// Each core of a chip computes a share; `with sibling` swaps the shares over the on-chip link.
exchange_item:  "exchange" name_list "with" NAME "wire" NAME
''')


@dataclass(frozen=True)
class Scatter:
    """`scatter [from N rows]` after an all-reduce's wire dtype."""

    word: Name                  # the `scatter` keyword
    rows: int | None            # N: kernels of fewer rows keep the one-shot stages
    span: Span                  # the whole clause
    nested: Name | None = None  # the `nested` keyword: every stage reduce-scatters
    gather: Name | None = None  # `gather DTYPE`: the dtype the sums are gathered back in


@dataclass(frozen=True)
class Overlap:
    """`overlap` after a collective."""

    word: Name


@dataclass(frozen=True)
class AllReduce:
    ops: list[Name]
    algorithm: Name
    level: Name | None          # the grouping of a two_level all-reduce: chip or host
    wire_dtype: Name
    span: Span
    scatter: Scatter | None = None
    overlap: Name | None = None  # the `overlap` keyword


@dataclass(frozen=True)
class AllGather:
    ops: list[Name]
    group: Group
    span: Span
    overlap: Name | None = None  # the `overlap` keyword


@dataclass(frozen=True)
class Exchange:
    ops: list[Name]
    peer: Name                  # `sibling`: the other core of the chip
    wire_dtype: Name
    span: Span


def scatter_text(rows: int | None, nested: bool = False, gather: str | None = None) -> str:
    """An all-reduce's scatter clause: at every kernel width (`rows` None or 1), or from
    `rows` rows; `nested` at every stage; the sums gathered back in `gather` (None: f32)."""
    words = ["scatter"] + (["nested"] if nested else []) + ([f"gather {gather}"] if gather else [])
    return " ".join(words + ([] if rows in (None, 1) else [f"from {rows} rows"]))


def written_scatter(sc: Scatter | None, stages: int = 2) -> str:
    """The scatter clause `sc` as written, with its leading space ("" for none); for an
    algorithm of one stage (`direct`) without `nested`, which needs two."""
    if sc is None:
        return ""
    return " " + scatter_text(sc.rows, sc.nested is not None and stages > 1,
                              sc.gather.text if sc.gather else None)


def sibling_swap_text(wire: str) -> str:
    """The text of the statement that swaps shares with the sibling core, `{}` for its op list
    (what resolve's hints suggest and `mkc retarget` writes)."""
    return "exchange {} with sibling wire " + wire


@SYNTAX.rule("scatter_gather")
def scatter_gather(b: Builder, meta: Meta, items: list) -> Name:
    return b.name(items[0])


@SYNTAX.rule("scatter")
def scatter(b: Builder, meta: Meta, items: list) -> Scatter:
    word, rest = b.name(items[0]), items[1:]
    nested = b.name(rest.pop(0)) if rest and getattr(rest[0], "type", None) == "NESTED" else None
    gather = rest.pop(0) if rest and isinstance(rest[0], Name) else None
    return Scatter(word, rest[0] if rest else None, b.span(meta), nested, gather)


@SYNTAX.rule("overlap")
def overlap(b: Builder, meta: Meta, items: list) -> Overlap:
    return Overlap(b.name(items[0]))


@SYNTAX.statement("allreduce_item", "phase", "allreduces")
def allreduce_item(b: Builder, meta: Meta, items: list) -> AllReduce:
    overlapped = items[-1].word if isinstance(items[-1], Overlap) else None
    items = items[:-1] if overlapped else items
    scattered = items[-1] if isinstance(items[-1], Scatter) else None
    items = items[:-1] if scattered else items
    level = b.name(items[2]) if len(items) == 4 else None
    return AllReduce(items[0], b.name(items[1]), level, b.name(items[-1]), b.span(meta), scattered,
                     overlapped)


@SYNTAX.statement("allgather_item", "phase", "allgathers")
def allgather_item(b: Builder, meta: Meta, items: list) -> AllGather:
    overlapped = items[-1].word if isinstance(items[-1], Overlap) else None
    return AllGather(items[0], items[1], b.span(meta), overlapped)


@SYNTAX.statement("exchange_item", "phase", "exchanges")
def exchange_item(b: Builder, meta: Meta, items: list) -> Exchange:
    return Exchange(items[0], b.name(items[1]), b.name(items[2]), b.span(meta))
