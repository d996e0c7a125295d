"""`expect RESOURCE headroom at least SIZE`: a margin the spec's author relies on, checked with
the rest of the spec (VMEM left under the budget at every kernel width, HBM left per chip)."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name, Setting
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// The room a spec promises to leave: `expect vmem headroom at least 1 MiB` (under the VMEM
// budget, at every kernel width it builds), `expect hbm headroom at least 8 GiB` (per chip).
// `mkc check` refuses the spec when a change eats into it, and `mkc tune` never proposes one.
expect_stmt: "expect" NAME "headroom" "at" "least" size
''')


@dataclass(frozen=True)
class Expect:
    resource: Name
    at_least: Setting       # bytes
    span: Span


@SYNTAX.statement("expect_stmt", "schedule", "expectations")
def expect_stmt(b: Builder, meta: Meta, items: list) -> Expect:
    return Expect(b.name(items[0]), items[1], b.span(meta))
