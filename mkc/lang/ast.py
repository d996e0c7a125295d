"""Typed AST of a .sched file: the nodes statements share and the two containers (a schedule and
its phases). Each statement's own node lives with its syntax in `mkc/lang/statements/`; every
node keeps the span it was parsed from."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from mkc.diagnostics import Span

# Digits a number in a schedule (or given for one on the command line) may have: no size comes
# near it, and it keeps every conversion far below Python's 4300-digit limit.
MAX_DIGITS = 12


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
class Group:
    """A set of ranks: `tp` (the mesh axis), `tp / N`, `host`, `chip`, or N consecutive ranks."""

    name: Name | None           # None for a bare count
    divisor: int | None = None  # `tp / N`
    ways: int | None = None     # a bare count
    span: Span = field(default_factory=Span.unknown)


@dataclass(frozen=True)
class Setting:
    """A header value with its span, so resolution errors can point at it."""

    value: object
    span: Span


class _Statements:
    """A container's statements: each statement's nodes, in source order, under the list name
    its syntax declares (`mkc.lang.syntax`), read as attributes (`sched.formats`,
    `phase.transfers`); a list no statement of the spec filled is empty."""

    lists: dict[str, list]

    def __getattr__(self, name: str) -> list:
        lists = self.__dict__.get("lists")
        if lists is None or name not in lists:
            raise AttributeError(name)
        return lists[name]


@dataclass
class Phase(_Statements):
    kind: Name
    lists: dict[str, list]
    span: Span = field(default_factory=Span.unknown)


@dataclass
class Schedule(_Statements):
    name: Name
    source_file: str
    lists: dict[str, list]
    settings: dict[str, Setting] = field(default_factory=dict)   # model, target, mesh, ...



def meaning(node: object) -> object:
    """A node without its positions (spans and file names), as nested tuples: what two layouts
    of one spec share, so what `mkc fmt` must keep."""
    if isinstance(node, Span):
        return None
    if dataclasses.is_dataclass(node):
        return (type(node).__name__, tuple((f.name, meaning(getattr(node, f.name)))
                                           for f in dataclasses.fields(node) if f.name != "file"))
    if isinstance(node, (list, tuple)):
        return tuple(meaning(x) for x in node)
    if isinstance(node, dict):
        return tuple(sorted((k, meaning(v)) for k, v in node.items()))
    return node
