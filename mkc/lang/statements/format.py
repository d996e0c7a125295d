"""`format CLASS FORMAT [block N]`: how a matrix class is stored and fed to the MXU."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// How a matrix class sits in HBM and VMEM and reaches the MXU: `format expert.gate_up fp8`,
// optionally with the input rows one scale covers (`block 512`). The family says which
// classes offer which formats (the checkpoint's is the default).
format_stmt: "format" dotted NAME ("block" INT)?
''')


@dataclass(frozen=True)
class Format:
    matrix: Name         # e.g. expert.gate_up
    format: Name
    span: Span
    block: int | None = None     # input rows one scale covers, if the spec says


@SYNTAX.statement("format_stmt", "schedule", "formats")
def format_stmt(b: Builder, meta: Meta, items: list) -> Format:
    return Format(items[0], b.name(items[1]), b.span(meta),
                  block=int(items[2]) if len(items) > 2 else None)
