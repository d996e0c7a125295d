"""`format CLASS FORMAT [block N [x M] | channel] [rounded [scale S]]`: how a matrix class is
stored and fed to the MXU."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// How a matrix class sits in HBM and VMEM and reaches the MXU: `format expert.gate_up fp8`,
// optionally with the input rows one scale covers (`block 512`), or the input rows and output
// columns (`block 128 x 128`: an FP8 checkpoint's f32 scale per 128 x 128 block), or one scale
// per output column (`channel`: `format attention int8 channel rounded`). The family says which
// classes offer which formats (the checkpoint's is the default). `rounded` lets packing round
// values a format cannot hold exactly to its nearest (`fp4 block 512 rounded`: e2m1 codes
// under one scale per block, from the checkpoint's scale per 32 rows); without it such a
// checkpoint is refused, and packing reports the error either way. `scale bf16` after `rounded`
// stores a rounded block's scale as a bf16 value searched for the least error rather than a
// power of two (`scale e8m0`, the default).
format_stmt: "format" dotted NAME ("block" INT ("x" INT)?)? CHANNEL? ROUNDED? block_scale?
block_scale: "scale" NAME
CHANNEL: "channel"
ROUNDED: "rounded"
''')


@dataclass(frozen=True)
class Format:
    matrix: Name         # e.g. expert.gate_up
    format: Name
    span: Span
    block: int | None = None     # input rows one scale covers, if the spec says
    cols: int | None = None      # and output columns (`block R x C`), if it says
    rounded: Name | None = None  # `rounded`: packing may round to the format's nearest values
    channel: Name | None = None  # `channel`: one scale per output column
    scale: Name | None = None    # `scale S`: how a rounded block's scale is stored


@dataclass(frozen=True)
class BlockScale:
    """`scale S` after `rounded`."""

    name: Name


@SYNTAX.rule("block_scale")
def block_scale(b: Builder, meta: Meta, items: list) -> BlockScale:
    return BlockScale(b.name(items[0]))


@SYNTAX.statement("format_stmt", "schedule", "formats")
def format_stmt(b: Builder, meta: Meta, items: list) -> Format:
    scale = next((t.name for t in items if isinstance(t, BlockScale)), None)
    items = [t for t in items if not isinstance(t, BlockScale)]
    words = {getattr(t, "type", ""): b.name(t) for t in items if getattr(t, "type", "") in
             ("ROUNDED", "CHANNEL")}
    rest = [t for t in items if getattr(t, "type", "") not in ("ROUNDED", "CHANNEL")]
    return Format(rest[0], b.name(rest[1]), b.span(meta),
                  block=int(rest[2]) if len(rest) > 2 else None,
                  cols=int(rest[3]) if len(rest) > 3 else None, rounded=words.get("ROUNDED"),
                  channel=words.get("CHANNEL"), scale=scale)
