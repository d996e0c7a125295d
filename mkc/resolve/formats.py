"""Pass `formats`: `format CLASS FORMAT [block ROWS]`, how each matrix class with a choice of
format is stored."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from mkc import ir, target
from mkc.diagnostics import MkcError, Span, fail
from mkc.lang import ast
from mkc.layers import dense_formats
from mkc.model.family import FormatError
from mkc.resolve.names import unknown
from mkc.resolve.state import ResolveState


# Formats whose values reach the MXU as they are, each with the `mkc.target.Generation` fact
# (measured) that says whether the target's MXU takes them. nvfp4's decode converts its e2m1
# codes as Mosaic's f4E2M1FN vectors, which libtpu has exactly where the MXU takes FP4 (v4 to
# v6e: "Unsupported type 'vector<...xf4E2M1FN>'", tests/test_tpu_compile.py).
NATIVE = {"fp4": "fp4_operand", "nvfp4": "fp4_operand"}
# Formats that store codes under a scale per block of input rows: `block N` sizes those blocks.
# Any other (bf16) stores values as they are, so a block means nothing to it.
BLOCK_SCALED = ("fp8", "fp4", "mxfp4", "int4", "nvfp4")
# Formats whose scale may also cover a block of output columns (`block R x C`): FP8 holding an
# FP8 checkpoint's codes under its f32 scale per R x C block (DeepSeek-V3's 128 x 128).
BLOCK_SCALED_2D = ("fp8",)
# Where the target's MXU lacks a native format, the format that holds the same blocks on any
# target (exactly, where the checkpoint allows: `mkc retarget` rewrites to it). nvfp4 has
# none: it is an NVFP4 checkpoint's only format.
FALLBACK = {"fp4": "fp8"}


def resolve_formats(s: ResolveState) -> ResolveState:
    """Every matrix class with a choice of format -> the one the spec picks, else the
    checkpoint's; each with what the target's MXU takes."""
    family = s.family
    dense = {cls: dense_formats.FORMATS for cls in family.dense_classes}
    offered = dict(family.formats_for(s.dims)) | dense
    gen = target.generation(s.topology.chip.name)
    fp8_operand = gen.fp8_operand
    chosen = {cls: dataclasses.replace(f, fp8_operand=fp8_operand)
              for cls, f in family.default_formats(s.dims).items()}
    chosen_dense: dict[str, ir.WeightFormat] = {}
    seen: dict[str, Span] = {}
    for f in s.sched.formats:
        cls = f.matrix.text
        if cls not in offered:
            if not offered:
                raise fail("E-FORMAT", f"the {family.name} family stores every matrix one way: "
                           f"{cls} has no other format", f.matrix.span,
                           hint="remove the `format` line")
            raise unknown(f"matrix class with a choice of format in {family.name}", f.matrix,
                          list(offered))
        if cls in seen:
            raise fail("E-DUPLICATE", f"the format of {cls} is set twice", f.span,
                       hint=f"keep one `format {cls}` line (the first is at line "
                            f"{seen[cls].line})")
        if f.format.text not in offered[cls]:
            raise fail("E-FORMAT", f"{cls} cannot be stored as {f.format.text!r}", f.format.span,
                       hint=f"{cls} takes {', '.join(offered[cls])} (the first is the "
                            "checkpoint's)")
        seen[cls] = f.span
        if cls in dense:
            chosen_dense[cls] = _dense_format(f, cls, fp8_operand)
        else:
            chosen[cls] = _block_format(f, cls, offered[cls], family, list(dense), gen)
    return dataclasses.replace(s, formats=chosen, dense_formats=chosen_dense)


def _block_format(f, cls: str, offered: tuple[str, ...], family, dense: list[str],
                  gen: target.Generation) -> ir.WeightFormat:
    """A `format` line of a class with its scales per block of input rows (`block N`, or
    `block R x C` for FP8 held as a checkpoint stores it), checked at the line: a format the
    target's MXU takes, a block the format has, `rounded` where the family lets it round."""
    if f.channel is not None:
        raise fail("E-FORMAT", f"{cls} takes its scales per block of input rows: `channel` "
                   f"(one scale per output column) is for {family.name}'s dense classes"
                   f" ({', '.join(dense) or 'none'})", f.channel.span,
                   hint="remove `channel`")
    if f.format.text in NATIVE and not getattr(gen, NATIVE[f.format.text]):
        accepted = [x for x in offered if x not in NATIVE or getattr(gen, NATIVE[x])]
        takers = [g for g in target.known_chips()
                  if getattr(target.generation(g), NATIVE[f.format.text])]
        raise fail("E-FORMAT", f"{gen.name}'s matrix units take no {f.format.text} operand "
                   f"(measured with libtpu: benchmarks/format_probe.py), so {cls} cannot "
                   f"be stored as {f.format.text!r} on {gen.name}", f.format.span,
                   hint=f"on {gen.name} {cls} takes {', '.join(accepted)}; "
                        f"{f.format.text} needs a target whose MXU takes it "
                        f"({', '.join(takers)})")
    if f.block is not None and f.format.text not in BLOCK_SCALED:
        scaled = [x for x in offered if x in BLOCK_SCALED]
        raise fail("E-FORMAT", f"{f.format.text} stores values unscaled: `block {f.block}` "
                   "means nothing for it", f.span,
                   hint=f"remove `block {f.block}`" + (f", or store {cls} in a block-scaled "
                                                      f"format: {', '.join(scaled)}"
                                                      if scaled else ""))
    if f.block is not None and f.block < 1 or f.cols is not None and f.cols < 1:
        size = f"{f.block} x {f.cols}" if f.cols is not None else f"{f.block} rows"
        raise fail("E-FORMAT", f"a block of {size} holds nothing", f.span,
                   hint="a block is the input rows one scale covers: e.g. `block 512`")
    if f.cols is not None and f.format.text not in BLOCK_SCALED_2D:
        raise fail("E-FORMAT", f"{f.format.text} takes one scale per block of input rows: "
                   f"`x {f.cols}` (output columns a scale covers) means nothing for it", f.span,
                   hint=f"write `block {f.block}`" + (
                       ", or store an FP8 checkpoint's blocks as they are (`fp8 block 128 x 128`)"
                       if "fp8" in offered else ""))
    # Which formats may round is the family's (`Family.rounding_formats`): K3's fp4 blocks
    # may not hold its MXFP4 values, Qwen3.5 MoE's fp8 cannot hold its bf16 ones.
    rounds = family.rounding_formats
    if f.rounded is not None and f.format.text not in rounds:
        raise fail("E-FORMAT", f"{f.format.text} needs no rounding: `rounded` applies to "
                   f"{', '.join(rounds) or 'no format of ' + family.name}, whose blocks "
                   "may not hold the checkpoint's values",
                   f.rounded.span, hint="remove `rounded`")
    if f.scale is not None:
        _check_block_scale(f, cls, f.format.text in rounds)
    return ir.WeightFormat(f.format.text, f.block or 0, gen.fp8_operand,
                           rounded=f.rounded is not None,
                           where=f"{Path(f.span.file).name}:{f.span.line}", cols=f.cols or 0,
                           scale=f.scale.text if f.scale is not None else "e8m0")


def _check_block_scale(f, cls: str, may_round: bool) -> None:
    """`scale S` on an expert class's `format` line: a known scale, on a rounded format that
    takes one scale per block of input rows (what packing chooses; an exact format keeps the
    checkpoint's scales). `may_round`: the family lets this format round."""
    if f.scale.text not in ir.BLOCK_SCALES:
        raise unknown("block scale", f.scale, list(ir.BLOCK_SCALES))
    if f.rounded is None:
        drop = f"remove `scale {f.scale.text}`"
        raise fail("E-FORMAT", f"`scale {f.scale.text}` chooses the scale packing rounds a block "
                   "to, and this format does not round: the checkpoint's scales are kept",
                   f.scale.span, hint=f"write `rounded scale {f.scale.text}`, or {drop}"
                   if may_round else f"{drop}: {f.format.text} holds the checkpoint's values")
    if f.block is None or f.cols is not None:
        raise fail("E-FORMAT", f"`scale {f.scale.text}` is a rounded block's scale: {cls} needs "
                   "`block N` (the input rows one scale covers)", f.scale.span,
                   hint=f"write `format {cls} {f.format.text} block N rounded scale "
                        f"{f.scale.text}`")


def _dense_format(f, cls: str, fp8_operand: bool) -> ir.WeightFormat:
    """A dense class's `format` line (`mkc.lang.statements.format.Format`,
    `mkc.layers.dense_formats`), checked at the line."""
    if f.scale is not None:
        raise fail("E-FORMAT", f"{cls}'s scale per output column is a bf16 value already: "
                   f"`scale {f.scale.text}` chooses a rounded expert block's scale",
                   f.scale.span, hint=f"remove `scale {f.scale.text}`")
    if f.cols is not None:
        raise fail("E-FORMAT", f"{cls} takes one scale per output column or per block of "
                   f"input rows: `x {f.cols}` means nothing for it", f.span,
                   hint=f"write `format {cls} {f.format.text} channel rounded`")
    fmt = ir.WeightFormat(f.format.text, f.block or 0, fp8_operand, rounded=f.rounded is not None,
                          where=f"{Path(f.span.file).name}:{f.span.line}",
                          channel=f.channel is not None)
    try:
        return dense_formats.resolve(cls, fmt)
    except FormatError as e:
        raise fail("E-FORMAT", str(e), f.span, hint=e.hint) from None


def format_span(sched: ast.Schedule, cls: str) -> Span:
    """The spec's `format` line of a matrix class (else its name)."""
    return next((f.span for f in sched.formats if f.matrix.text == cls), sched.name.span)


def format_error(e: FormatError, sched: ast.Schedule) -> MkcError:
    """A format the family's graph build refuses, at the spec's `format` line of its class."""
    return fail("E-FORMAT", str(e), format_span(sched, e.cls), hint=e.hint)
