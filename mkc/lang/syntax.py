"""How a statement declares its syntax, so a statement's grammar, AST node and builder live in
one module (`mkc/lang/statements/<name>.py`) and the parser, `mkc fmt` and the language server
find it there.

A statement module defines `SYNTAX = Syntax(grammar)` with its lark rules (their comments are
the language's documentation), registers the builder of each statement rule with
`@SYNTAX.statement(rule, scope, joins)` and of each helper rule with `@SYNTAX.rule(name)`.
A builder takes (Builder, meta, children) and returns the rule's AST node. The parser adds
every module in `mkc.lang.statements` (in name order) to the base grammar (`sched.lark`):
each statement rule becomes an alternative of `schedule { ... }` or of `phase KIND { ... }`,
and its nodes join the container's list named `joins` (`sched.formats`, `phase.transfers`),
or its settings under that key.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Literal

import lark
from lark.tree import Meta

from mkc.diagnostics import Span
from mkc.lang.ast import Name

__all__ = ["Builder", "Meta", "Placed", "Statement", "Syntax", "empty_lists", "grammar"]

Scope = Literal["schedule", "phase"]


@dataclass(frozen=True)
class Builder:
    """What a builder needs besides the parse tree: the file, for spans."""

    file: str

    def span(self, meta: Any) -> Span:
        if getattr(meta, "empty", False) or getattr(meta, "line", None) is None:
            return Span.unknown(self.file)
        return Span(self.file, meta.line, meta.column, meta.end_line, meta.end_column)

    def name(self, tok: lark.Token) -> Name:
        return Name(str(tok), self.span(tok))


Build = Callable[[Builder, Any, list], Any]


@dataclass(frozen=True)
class Statement:
    rule: str
    scope: Scope          # stands inside `schedule { }` or inside `phase KIND { }`
    joins: str            # the container's list its nodes join, or its settings key
    setting: bool         # a header value (`sched.settings[joins]`, set at most once)
    block: bool           # holds statements in braces (`mkc fmt` lays out its body)
    keyword: str          # the word that starts it


@dataclass(frozen=True)
class Placed:
    """A statement's node on its way to its container, with the statement that says where."""

    statement: Statement
    node: Any


@dataclass
class Syntax:
    grammar: str
    module: str = ""                 # set when found: the module's name, for `mkc grammar`
    statements: list[Statement] = field(default_factory=list)
    builders: dict[str, Build] = field(default_factory=dict)

    def statement(self, rule: str, scope: Scope, joins: str, *, setting: bool = False,
                  block: bool = False) -> Callable[[Build], Build]:
        keyword = _first_keyword(self.grammar, rule)

        def register(build: Build) -> Build:
            self.statements.append(Statement(rule, scope, joins, setting, block, keyword))
            self.builders[rule] = build
            return build
        return register

    def rule(self, name: str) -> Callable[[Build], Build]:
        def register(build: Build) -> Build:
            self.builders[name] = build
            return build
        return register


def _first_keyword(grammar: str, rule: str) -> str:
    for line in grammar.splitlines():
        head, _, body = line.partition(":")
        if head.strip() == rule:
            return body.split('"')[1]
    raise ValueError(f"the grammar does not define the statement rule {rule!r}")


@lru_cache(maxsize=1)
def modules() -> tuple[Syntax, ...]:
    """Every statement module's syntax, in module-name order (so the grammar's text, and lark's
    cached tables keyed by its digest, are the same on every run)."""
    import mkc.lang.statements as package
    found = []
    for name in sorted(m.name for m in pkgutil.iter_modules(package.__path__)):
        module = importlib.import_module(f"{package.__name__}.{name}")
        module.SYNTAX.module = module.__name__
        found.append(module.SYNTAX)
    return tuple(found)


def statements(scope: Scope | None = None) -> list[Statement]:
    return [s for m in modules() for s in m.statements if scope in (None, s.scope)]


def empty_lists(scope: Scope) -> dict[str, list]:
    """A container's statement lists, every one empty."""
    return {s.joins: [] for s in statements(scope) if not s.setting}


def builders() -> dict[str, Build]:
    return {rule: build for m in modules() for rule, build in m.builders.items()}


def grammar() -> str:
    """The whole language: the base grammar, each statement module's rules, and the two lists
    of alternatives naming every statement where it may stand."""
    base = Path(__file__).with_name("sched.lark").read_text()
    parts = [base] + [f"// {m.module}\n{m.grammar.strip()}\n" for m in modules()]
    for scope, rule in (("schedule", "_stmt"), ("phase", "_phase_item")):
        parts.append(f"{rule}: " + "\n     | ".join(s.rule for s in statements(scope)) + "\n")
    return "\n".join(parts)
