"""`load` and `store`: a copy between HBM state and a VMEM buffer, its start point and the
points it is waited at."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name, Point
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
load_item:      "load" binding_list point ";" wait_list
store_item:     "store" binding_list point ";" wait_list
binding_list:   binding ("," binding)*
binding:        dotted "->" dotted
wait_list:      "wait" point ("," "wait" point)*
''')


@dataclass(frozen=True)
class Binding:
    """`src -> dst` in a load or store; one side names HBM state, the other a VMEM buffer."""

    src: Name
    dst: Name


@dataclass(frozen=True)
class Transfer:
    """A load (HBM->VMEM) or store (VMEM->HBM) with its start point and wait points."""

    direction: str      # "load" | "store"
    bindings: list[Binding]
    start: Point
    waits: list[Point]
    span: Span


@SYNTAX.rule("binding")
def binding(b: Builder, meta: Meta, items: list) -> Binding:
    return Binding(items[0], items[1])


@SYNTAX.rule("binding_list")
def binding_list(b: Builder, meta: Meta, items: list) -> list[Binding]:
    return list(items)


@SYNTAX.rule("wait_list")
def wait_list(b: Builder, meta: Meta, items: list) -> list[Point]:
    return list(items)


@SYNTAX.statement("load_item", "phase", "transfers")
def load_item(b: Builder, meta: Meta, items: list) -> Transfer:
    return Transfer("load", items[0], items[1], items[2], b.span(meta))


@SYNTAX.statement("store_item", "phase", "transfers")
def store_item(b: Builder, meta: Meta, items: list) -> Transfer:
    return Transfer("store", items[0], items[1], items[2], b.span(meta))
