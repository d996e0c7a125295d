"""`pool NAME { view ... }`: one VMEM region time-shared by views."""
from __future__ import annotations

from dataclasses import dataclass, field

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// One VMEM region time-shared by views; the checker proves views are never live together.
// A weight view holds whole matrices of the kinds listed; a slot view holds N routed experts.
pool_stmt: "pool" NAME "{" pool_view+ "}"
pool_view: "view" NAME ":" view_kind ("," view_kind)*   -> view_weights
         | "view" NAME ":" INT ("slots" | "slot") "of" NAME   -> view_slots
view_kind: NAME "(" name_list ")"
''')


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


@SYNTAX.rule("view_kind")
def view_kind(b: Builder, meta: Meta, items: list) -> ViewKind:
    return ViewKind(b.name(items[0]), items[1])


@SYNTAX.rule("view_weights")
def view_weights(b: Builder, meta: Meta, items: list) -> PoolView:
    return PoolView(b.name(items[0]), list(items[1:]), span=b.span(meta))


@SYNTAX.rule("view_slots")
def view_slots(b: Builder, meta: Meta, items: list) -> PoolView:
    return PoolView(b.name(items[0]), [], slots=int(items[1]), slot_of=b.name(items[2]),
                    span=b.span(meta))


@SYNTAX.statement("pool_stmt", "schedule", "pools", block=True)
def pool_stmt(b: Builder, meta: Meta, items: list) -> Pool:
    return Pool(b.name(items[0]), list(items[1:]), b.span(meta))
