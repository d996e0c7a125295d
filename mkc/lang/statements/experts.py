"""`fetch experts` and `prefetch next`: when routed experts and the next layer's weight view
are copied into a pool."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name, Point
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// Routed experts are copied into a slot view as soon as routing picks them.
fetch_item:     "fetch" "experts" "->" dotted point
// The next layer's weight view is copied while this layer still computes.
prefetch_item:  "prefetch" "next" dotted point
''')


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


@SYNTAX.statement("fetch_item", "phase", "fetches")
def fetch_item(b: Builder, meta: Meta, items: list) -> Fetch:
    return Fetch(items[0], items[1], b.span(meta))


@SYNTAX.statement("prefetch_item", "phase", "prefetches")
def prefetch_item(b: Builder, meta: Meta, items: list) -> Prefetch:
    return Prefetch(items[0], items[1], b.span(meta))
