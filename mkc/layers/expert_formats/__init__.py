"""How a routed expert's matrices are stored and multiplied: the one home of the expert
formats every family with routed experts shares (the library `MoE`, Kimi K3, GPT-OSS).

A class of expert matrices (`expert.gate_up`, `expert.down`) is stored as the spec's `format`
line says, K-major (`[in, out]`, input rows down the slot):

* `bf16`: values, multiplied as they are (a bf16 checkpoint's own);
* `mxfp4`: an MXFP4 checkpoint's e2m1 codes, two input rows a byte in the kernel layout of
  `MXFP4_LAYOUT`, with the checkpoint's E8M0 scale per 32 rows; decoded on the VPU;
* `fp8`: e4m3 codes, one row a byte, with an E8M0 scale per `block` rows: 32 (from MXFP4:
  exact, every e2m1 value is an e4m3 value; converted and scaled value by value) or whole pack
  groups (fed to the MXU as they are where it takes FP8, the block's scale multiplying the
  group's partial product: `feeds_codes`);
* `fp4`: e2m1 codes, two rows a byte in the checkpoint's nibble order, a scale per `block`
  rows of whole pack groups, always fed to the MXU as they are;
* `fp8 block R x C` (`WeightFormat.cols`): an FP8 checkpoint's own e4m3 codes under its own
  f32 scale per R input rows x C output columns (DeepSeek-V3's `weight_scale_inv`, one per
  128 x 128 block of `[out, in]`), both held as they are: the codes fed to the MXU one mixed
  bf16 x fp8 dot per group of a rank's input rows under one block row (`block_groups`), the
  group's scales, one per column, multiplying its partial product. Exact: the dots see the
  checkpoint's codes and scales, not values rounded from them;
* `int4 block N` (Muse Spark's int4 g128, N = 128): signed int4 codes, two rows a byte (row 2a
  in the low nibble), one bf16 scale per N input rows per column, requantized from a bf16
  checkpoint by symmetric round to nearest (`weights.int4_from_bf16`: lossy, so `rounded`
  unless every value fits); one bf16 dot per N rows of the codes' integers, its partial
  product times the block's scale (exact factorisation: q x scale is not a bf16 value);
* `nvfp4` (block 16): an NVFP4 checkpoint's e2m1 codes, two rows a byte as it packs them,
  its e4m3 scale per 16 rows and its f32 global scale (`weight_scale_2`, one per checkpoint
  matrix, stored per output column so gate and up keep their own): decoded to bf16 a pack
  group at a time (e2m1 x e4m3 has at most 6 significant bits: exact), the matrix's f32
  product times the global scale. Exact: the dots see the checkpoint's values.

The kernel multiplies an expert matrix a pack group of input rows at a time (`pack_groups`,
`dividing_pack_groups`). Here, importing no jax (checking a spec must not load it): the
formats' rules (`resolve`), the tensors a slot holds (`tensors`) and the layout's facts. The
kernel math is `ops` (decodes and group matmuls) and `lowering` (`expert_matmul`, what a
routed-experts body calls), the numpy packers `weights`, the reference's emulation `reference`.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from mkc.ir import MatrixFacts, WeightFormat
from mkc.model.family import FormatError
from mkc.model.graph import Tensor

MX_BLOCK = 32          # rows per E8M0 scale of MXFP4 (and of FP8 scaled value by value)
SCALE_NAN = 255        # the E8M0 byte that encodes NaN
TWO_ROWS = ("mxfp4", "fp4", "int4", "nvfp4")        # formats holding two input rows a byte
INT4_BLOCK = 128       # Muse Spark's int4 group: input rows per bf16 scale
NVFP4_BLOCK = 16       # input rows per e4m3 scale of NVFP4
# nvfp4: after a slot's e4m3 scale rows, the f32 global scale of each output column as its
# four little-endian bytes, one byte row each (`ops.nvfp4_global_scale` joins them).
GLOBAL_SCALE_ROWS = 4
# nvfp4 at up to this many rows feeds its codes to the MXU (a block-diagonal input, one dot a
# pack group) rather than decoding them: tpu7x bundles of a 512-row group, 256 columns, at 1 /
# 2 / 4 / 8 rows 85 / 107 / 150 / 239 against 149 / 147 / 145 / 148 (docs/formats.md); the
# routed experts' whole op, compiled alone, is cheaper with the codes up to 6 rows (Muse
# Spark's step 0.10 / 0.08 / 0.04 / 0.02 ms shorter at 3 / 4 / 5 / 6 rows) and dearer from 7
NVFP4_CODES_ROWS = 6
# int4 codes are sliced per block in the kernel: a block's byte rows whole uint8 tiles (32)
INT4_BLOCK_MULTIPLE = 64
# How a stored matrix's bytes count as values: codes are multiplied, scales only decoded.
_FACTS = {"mxfp4": MatrixFacts(values_per_byte=2.0), "fp4": MatrixFacts(values_per_byte=2.0),
          "int4": MatrixFacts(values_per_byte=2.0), "nvfp4": MatrixFacts(values_per_byte=2.0),
          "fp8": MatrixFacts(values_per_byte=1.0)}
_SCALES = MatrixFacts(values_per_byte=0.0)
# Pack group caps: gate|up's input rows are multiplied 512 at a time, down's 128 (Kimi K3's).
PACK_GROUP = {"gate_up": 512, "down": 128}
# `fp8 block R x C`: a slot's f32 scales are stored as their little-endian bytes, one scale row
# as 4 byte rows (`pltpu.bitcast` to uint32 joins them back), in whole (32, 128) uint8 tiles:
# scale rows padded to a multiple of SCALE_ROWS. `scale bf16` stores its G scale rows as 2G
# byte rows, every scale's low byte, then every high byte (`weights.pack_bf16_scales`): stacked
# like E8M0's, unpadded, so a bf16 scale costs its two bytes and no more.
SCALE_ROWS = 8

# The kernel layout of MXFP4 codes (`weights.pack_mxfp4_for_kernel`): a pack group of G input
# rows is G/8 little-endian uint32 words a column, 8 codes a word. Its rows are four quarters
# of G/4; row 2a + h of quarter q sits in word a, at the bits MXFP4_LAYOUT[q] gives (sign, then
# the three magnitude bits high to low) plus 16 h. Each quarter comes out of the word with one
# mask after a shift (q 0..2) or a shift, mask and multiply (q 3: one copy of its bits per
# term of the multiplier, no two overlapping), already where a bf16 keeps them: the sign at
# bit 15 (31), the magnitude at bits 8..6 (24..22), the bottom of the exponent and the top of
# the mantissa. The magnitude is stored re-coded so that adding the block's exponent bias
# makes the value: c = 0 is 0.5, c = 1 zero, c = 2..7 are 1, 1.5, 2, 3, 4, 6 (the e2m1 code).
MXFP4_LAYOUT = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (11, 10, 14, 13))


def rows_per_byte(fmt: WeightFormat) -> int:
    return 2 if fmt.name in TWO_ROWS else 1


def block_groups(fmt: WeightFormat, rows: int, width: int) -> tuple[int, int]:
    """`fp8 block R x C` on a rank's slice of `rows` input rows whose output columns run in
    contiguous runs of `width` (gate|up: its gate and its up columns; down: all): the (input
    rows, output columns) under one scale in it, a block's or the slice's where smaller.
    `resolve` checks that they cut whole blocks."""
    return min(fmt.block, rows), min(fmt.cols, width)


def block_index(fmt: WeightFormat, out_index: Sequence[int], in_index: Sequence[int], width: int
                ) -> tuple[list[int], list[int]]:
    """A rank's slice of an FP8 checkpoint matrix `[out, in]` in `fp8 block R x C` (its output
    rows `out_index` in the slot's column order, its input columns `in_index` in row order,
    output columns in runs of `width`): the checkpoint scale row (`weight_scale_inv`'s second
    index, input blocks) of each of its row groups, and the scale column (the first index,
    output blocks) of each of its columns. The packer and the reference's emulation read the
    scales through it."""
    group, _ = block_groups(fmt, len(in_index), width)
    return [i // fmt.block for i in in_index[::group]], [o // fmt.cols for o in out_index]


def feeds_codes(fmt: WeightFormat) -> bool:
    """Whether a matrix stored in `fmt` reaches the MXU as FP8 codes: FP8 with one scale per
    pack group's partial product (a block past 32 rows) on a target whose MXU takes FP8
    operands. The lowering and the reference's emulation both ask."""
    return fmt.name == "fp8" and fmt.block > MX_BLOCK and fmt.fp8_operand


def pack_groups(rows: Mapping[str, int]) -> dict[str, int]:
    """Input rows an expert matrix is multiplied in at a time, by matrix (`rows`: its input
    rows per rank): `PACK_GROUP`'s, or the whole matrix when smaller."""
    return {name: min(n, PACK_GROUP[name]) for name, n in rows.items()}


def dividing_pack_groups(rows: Mapping[str, int], cap: int = PACK_GROUP["gate_up"]) -> dict[str, int]:
    """Pack groups for MXFP4 rows that `PACK_GROUP`'s do not tile: the largest multiple of 64
    (two 32-row blocks, one a nibble each) dividing a matrix's rows, at most `cap`.
    FormatError if none does."""
    out = {}
    for name, n in rows.items():
        group = max((g for g in range(2 * MX_BLOCK, min(n, cap) + 1, 2 * MX_BLOCK) if n % g == 0),
                    default=0)
        if not group:
            raise FormatError(f"expert.{name}", f"expert.{name}'s {n} input rows are not a "
                              f"multiple of {2 * MX_BLOCK}: the kernel decodes MXFP4 two 32-row "
                              "blocks at a time", "use a model whose hidden size is a multiple of 64")
        out[name] = group
    return out


def check_block(cls: str, block: int, rows: int, group: int, other: str = "") -> None:
    """A block of `block` input rows under one scale must be whole pack groups of `group` that
    tile the matrix's `rows` (per rank): the kernel multiplies a pack group's partial product
    by its block's scale. FormatError otherwise, its hint naming `other` (a block also taken,
    "32, or ") and the multiples that fit."""
    if block % group or rows % block:
        raise FormatError(cls, f"a block of {block} rows does not tile {cls}: its {rows} input "
                          f"rows (per rank) run as pack groups of {group}",
                          f"use {other}a multiple of {group} that divides {rows} (e.g. {group})")


def resolve(classes: Sequence[tuple[str, Sequence[str]]], rows: Mapping[str, int],
            groups: Mapping[str, int], formats: Mapping[str, WeightFormat] | None = None,
            blocks: tuple[int, int] | None = None, widths: Mapping[str, int] | None = None
            ) -> dict[str, WeightFormat]:
    """Each expert class's format (`classes`: class -> the formats it takes, the checkpoint's
    first; unset classes keep the checkpoint's), its block resolved to input rows (a block past
    the matrix's `rows` is the whole matrix). FormatError for a block the kernel cannot use:
    MXFP4 keeps 32; FP4, and FP8 from a bf16 checkpoint, take whole pack `groups` (FP8 from
    MXFP4 also 32, its default); FP8 requantized from bf16 must say `rounded`. A checkpoint
    whose classes are `fp8` is an FP8 checkpoint with an f32 scale per `blocks` (input rows,
    output columns) block, held as it is (`checkpoint_blocks`; `widths`: each class's runs of
    output columns a rank holds). `int4 block N` and `nvfp4`: `four_bit`'s rules."""
    stored = {cls: names[0] for cls, names in classes}
    out = {}
    for cls, fmt in ({c: WeightFormat(f) for c, f in stored.items()} | dict(formats or {})).items():
        name = cls.split(".")[1]
        if fmt.name == "bf16":
            out[cls] = fmt
            continue
        if fmt.name in FOUR_BIT or stored[cls] == "nvfp4":
            out[cls] = four_bit(cls, fmt, stored[cls], rows[name], groups[name])
            continue
        if fmt.cols or stored[cls] == "fp8":
            out[cls] = checkpoint_blocks(cls, fmt, stored[cls], rows[name],
                                         (widths or {}).get(name, 0), blocks)
            continue
        from_mx = stored[cls] == "mxfp4"
        if fmt.name == "mxfp4" and fmt.block not in (0, MX_BLOCK):
            raise FormatError(cls, f"MXFP4 keeps the checkpoint's scale per {MX_BLOCK} rows, not "
                              f"{fmt.block}", f"drop the block, or store it as FP8 (`format {cls} fp8 "
                              "block N`, N whole pack groups)")
        if not fmt.block and (fmt.name == "fp4" or not from_mx):
            example = f"`format {cls} {fmt.name} block {groups[name]}{'' if from_mx else ' rounded'}`"
            raise FormatError(cls, f"{fmt.name.upper()} takes one scale per block of whole pack "
                              "groups (its codes reach the MXU as they are, the scale multiplying "
                              "a pack group's partial product)", f"write {example} (a multiple of "
                              f"{groups[name]} rows dividing {rows[name]})")
        block = min(fmt.block or MX_BLOCK, rows[name])
        if block != MX_BLOCK or fmt.name == "fp4" or not from_mx:
            check_block(cls, block, rows[name], groups[name],
                        f"{MX_BLOCK}, or " if from_mx and fmt.name == "fp8" else "")
        if not from_mx and not fmt.rounded:
            raise FormatError(cls, f"the checkpoint's {cls} is bf16 (8 significant bits), "
                              "and e4m3 keeps 4: requantizing it to FP8 rounds almost every "
                              "value, so the spec must accept the rounding", f"write `format "
                              f"{cls} fp8 block {block} rounded` (the error is reported per "
                              "matrix class), or keep it bf16 (drop the `format` line)")
        out[cls] = dataclasses.replace(fmt, block=block)
    return out


FOUR_BIT = ("int4", "nvfp4")


def four_bit(cls: str, fmt: WeightFormat, stored: str, rows: int, group: int) -> WeightFormat:
    """`int4 block N` or `nvfp4` of class `cls` (`rows` input rows a rank holds, multiplied in
    pack groups of `group`), resolved: int4 from a bf16 checkpoint, N (default 128) a multiple
    of 64 dividing the rows that divides the pack group or is whole ones; nvfp4 only from an
    NVFP4 checkpoint, its 16-row block, nothing rounded. FormatError otherwise."""
    if fmt.name == "nvfp4" or stored == "nvfp4":
        if stored != "nvfp4" or fmt.name != "nvfp4":
            raise FormatError(cls, f"`nvfp4` holds an NVFP4 checkpoint's e2m1 codes and e4m3 scales "
                              f"as they are, and the checkpoint's {cls} is {stored}" if stored != "nvfp4"
                              else f"the checkpoint's {cls} is NVFP4, which `{fmt.spelled}` would requantize",
                              f"serve an NVFP4 checkpoint, or write `format {cls} int4 block "
                              f"{INT4_BLOCK} rounded` (requantized from bf16)" if stored != "nvfp4"
                              else f"write `format {cls} nvfp4` (the checkpoint's)")
        if fmt.block not in (0, NVFP4_BLOCK) or fmt.rounded:
            raise FormatError(cls, f"NVFP4 keeps the checkpoint's e4m3 scale per {NVFP4_BLOCK} rows "
                              "and its codes as they are: no other block, nothing to round",
                              f"write `format {cls} nvfp4`")
        if rows % group or group % (2 * MX_BLOCK):
            raise FormatError(cls, f"{cls}'s {rows} input rows (per rank) do not run as whole pack "
                              f"groups of {group}, multiples of {2 * MX_BLOCK} rows",
                              f"split the expert's width (`shard expert_mlp over N`) so a rank's "
                              f"rows are a multiple of {2 * MX_BLOCK}")
        return dataclasses.replace(fmt, block=NVFP4_BLOCK)
    if stored != "bf16":
        raise FormatError(cls, f"`int4` requantizes a bf16 checkpoint's values, and the checkpoint's "
                          f"{cls} is {stored}", f"keep {cls} as `{stored}` (drop the `format` line)")
    block = min(fmt.block or INT4_BLOCK, rows)
    if block % INT4_BLOCK_MULTIPLE or rows % block or (group % block and block % group):
        raise FormatError(cls, f"an int4 block of {block} rows does not tile {cls}: its {rows} "
                          f"input rows (per rank) run as pack groups of {group}, and a block's "
                          f"codes must be whole {INT4_BLOCK_MULTIPLE}-row tiles",
                          f"use a multiple of {INT4_BLOCK_MULTIPLE} dividing {group} (e.g. "
                          f"`format {cls} int4 block {INT4_BLOCK} rounded`)")
    return dataclasses.replace(fmt, block=block)


def checkpoint_blocks(cls: str, fmt: WeightFormat, stored: str, rows: int, width: int,
                      blocks: tuple[int, int] | None) -> WeightFormat:
    """`fmt` of class `cls` where the format or the checkpoint is FP8 in blocks of input rows
    and output columns (`fp8 block R x C`), resolved to the checkpoint's blocks (`fp8` alone:
    the checkpoint's). FormatError unless the checkpoint (`stored`) is FP8 with `blocks` of
    those sizes, the spec does not ask to round (the codes and scales are held as they are),
    and a rank's `rows` and runs of `width` output columns cut whole groups out of them."""
    if stored != "fp8":
        other = (f"`format {cls} fp8 block N rounded` (its values requantized, an E8M0 scale per "
                 "N rows)" if stored == "bf16" else f"`format {cls} fp8 block N` (an E8M0 scale "
                 "per N rows)")
        raise FormatError(cls, f"`{fmt.spelled}` holds an FP8 checkpoint's codes under its f32 "
                          f"scale per {fmt.block} x {fmt.cols} block as they are, and the "
                          f"checkpoint's {cls} is {stored}",
                          f"serve an FP8 checkpoint with those blocks (a quantization_config "
                          f"with weight_block_size [{fmt.cols}, {fmt.block}]), or write {other}")
    spelled = f"fp8 block {blocks[0]} x {blocks[1]}"
    if fmt.rounded:
        raise FormatError(cls, f"`{spelled}` holds the checkpoint's FP8 codes and scales as they "
                          "are: nothing is rounded", f"write `format {cls} {spelled}` (no `rounded`)")
    if fmt.block and (fmt.block, fmt.cols) != blocks:
        raise FormatError(cls, f"the checkpoint's {cls} is FP8 with one f32 scale per "
                          f"{blocks[0]} x {blocks[1]} block (input rows x output columns), which "
                          f"`{fmt.spelled}` would requantize",
                          f"write `format {cls} {spelled}` (the checkpoint's), or drop the line")
    fmt = dataclasses.replace(fmt, block=blocks[0], cols=blocks[1])
    group, cols = block_groups(fmt, rows, width)
    if blocks[0] % group or rows % group or blocks[1] % cols or width % cols:
        raise FormatError(cls, f"a rank's {rows} input rows and runs of {width} output columns "
                          f"of {cls} cut the checkpoint's {blocks[0]} x {blocks[1]} blocks "
                          "unevenly: each scale must cover whole groups of them",
                          f"split each expert's width (`shard expert_mlp over N`) into parts "
                          f"that divide {blocks[1]} or are multiples of it")
    return fmt


def tensors(name: str, rows: int, cols: int, fmt: WeightFormat, width: int | None = None
            ) -> dict[str, Tensor]:
    """Expert matrix `name` [rows (in), cols (out)] as its slot holds it in `fmt`: bf16 values
    by its name, or codes (`rows_per_byte` input rows a byte) and an E8M0 scale per
    `fmt.block` input rows (`scale bf16` and int4: a bf16 one, two byte rows a scale row;
    nvfp4: e4m3 ones, then the f32 global scale's `GLOBAL_SCALE_ROWS`),
    stacked in the slot: a few rows over many panels, which whole-tile
    panels would pad to 32 rows each (K3's FP8 scales: 160 KB an expert copy for 32 KB of
    scales). `fp8 block R x C`: e4m3 codes and the f32 scale of each group of rows and columns
    (`block_groups`, `width`: the runs of output columns), as their bytes (`SCALE_ROWS`)."""
    if fmt.name == "bf16":
        return {name: Tensor(name, "matrix", (rows, cols), "bf16")}
    scale_rows = rows // fmt.block, cols
    if fmt.name == "nvfp4":
        scale_rows = rows // fmt.block + GLOBAL_SCALE_ROWS, cols
    if fmt.scale == "bf16" or fmt.name == "int4":
        scale_rows = 2 * (rows // fmt.block), cols
    if fmt.cols:
        group, per = block_groups(fmt, rows, width or cols)
        scale_rows = 4 * -(-(rows // group) // SCALE_ROWS) * SCALE_ROWS, cols // per
    return {f"{name}_codes": Tensor(f"{name}_codes", "matrix", (rows // rows_per_byte(fmt), cols),
                                    "u8", mxu=_FACTS[fmt.name]),
            f"{name}_scales": Tensor(f"{name}_scales", "matrix", scale_rows, "u8",
                                     mxu=_SCALES, stacked=True)}
