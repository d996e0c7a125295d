"""`stream RING ahead N { KIND: classes ... then classes }`: one DMA stream through a ring."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// One DMA stream through a ring, in consumption order, across layer boundaries.
stream_stmt: "stream" NAME "ahead" INT "{" stream_item* "}"
stream_item: NAME ":" name_list    -> stream_kind
           | "then" name_list      -> stream_tail
''')


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
class _Tail:
    names: list[Name]


@SYNTAX.rule("stream_kind")
def stream_kind(b: Builder, meta: Meta, items: list) -> StreamKind:
    return StreamKind(b.name(items[0]), items[1])


@SYNTAX.rule("stream_tail")
def stream_tail(b: Builder, meta: Meta, items: list) -> _Tail:
    return _Tail(items[0])


@SYNTAX.statement("stream_stmt", "schedule", "streams", block=True)
def stream_stmt(b: Builder, meta: Meta, items: list) -> Stream:
    ring, ahead, *rest = items
    per_kind = [r for r in rest if isinstance(r, StreamKind)]
    tail = [n for r in rest if isinstance(r, _Tail) for n in r.names]
    return Stream(b.name(ring), int(ahead), per_kind, tail, b.span(meta))
