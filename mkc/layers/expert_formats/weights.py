"""Host-side packing of expert matrices into their stored formats (numpy, at weight-load
time): MXFP4 into the kernel layout (`MXFP4_LAYOUT`) and back, MXFP4 into FP8 codes, an FP8
checkpoint's codes and block scales into a slot (`fp8 block R x C`) and back, bf16 block
scales (`scale bf16`) into a slot and back, and a checkpoint's MXFP4 requantized to FP4 under
one scale per block of rows (`fp4_from_mxfp4`, as a checkpoint holds it:
`fp4_checkpoint_tensors`, read back by `held_fp4`), bf16 values requantized to int4 blocks
(`int4_from_bf16`) and packed (`pack_int4_for_kernel`), and an NVFP4 checkpoint's codes and
scales into a slot (`pack_nvfp4_for_kernel`), each with its inverse and a numpy decode."""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import ml_dtypes
import numpy as np

from mkc.ir import WeightFormat
from mkc.model import nvfp4
from mkc.model.family import FormatError
from mkc.model.fp8_blocks import checked_scales
from mkc.model.mxfp4 import SCALE_BIAS, Requantized, relative_rms, requantize_blocks
from mkc.model.scales import ScaleRange
from mkc.layers.expert_formats import (MX_BLOCK, MXFP4_LAYOUT, SCALE_NAN, SCALE_ROWS, block_groups,
                                       block_index)


def fp8_checkpoint_blocks(codes: np.ndarray, scales: np.ndarray, out_index: Sequence[int],
                          in_index: Sequence[int], fmt: WeightFormat, width: int
                          ) -> tuple[np.ndarray, np.ndarray]:
    """A rank's slice of an FP8 checkpoint matrix (`codes` float8_e4m3fn or their bytes
    `[out, in]`, `scales` f32 `weight_scale_inv [out / C, in / R]`) as its slot holds it in
    `fp8 block R x C`: the codes' bytes K-major (uint8 `[len(in_index), len(out_index)]`) and,
    per group of rows and columns (`block_groups`), the checkpoint's scale of the block it
    lies in, as `pack_block_scales` stores them. Byte for byte the checkpoint's codes and
    scales (`unpack_block_scales` reads them back)."""
    out_index, in_index = list(out_index), list(in_index)
    raw = np.asarray(codes)
    raw = raw if raw.dtype == np.uint8 else raw.view(np.uint8)
    kernel_codes = np.ascontiguousarray(raw[np.ix_(out_index, in_index)].T)
    _, per = block_groups(fmt, len(in_index), width)
    block_rows, block_cols = block_index(fmt, out_index, in_index, width)
    scales = checked_scales(scales, "an FP8 expert matrix")
    grid = scales[np.ix_(block_cols[::per], block_rows)].T   # [groups, n]
    return kernel_codes, pack_block_scales(grid)


def pack_block_scales(scales: np.ndarray) -> np.ndarray:
    """f32 scales `[G, n]` -> the uint8 `[4 G', n]` a slot holds (`SCALE_ROWS`): row 4a + i
    is byte i (little endian) of scale row a, rows past G zero."""
    s = np.asarray(scales, "<f4")
    rows = -(-s.shape[0] // SCALE_ROWS) * SCALE_ROWS
    s = np.ascontiguousarray(np.pad(s, [(0, rows - s.shape[0]), (0, 0)]))
    return np.ascontiguousarray(s.view(np.uint8).reshape(rows, s.shape[1], 4)
                                .transpose(0, 2, 1).reshape(4 * rows, s.shape[1]))


def unpack_block_scales(stored: np.ndarray, groups: int) -> np.ndarray:
    """Inverse of ``pack_block_scales``: the first `groups` f32 scale rows."""
    stored = np.asarray(stored, np.uint8)
    rows, n = stored.shape[0] // 4, stored.shape[1]
    words = np.ascontiguousarray(stored.reshape(rows, 4, n).transpose(0, 2, 1))
    return words.view("<f4").reshape(rows, n)[:groups].astype(np.float32)


def pack_bf16_scales(scales: np.ndarray) -> np.ndarray:
    """bf16 block scales `[G, n]` (values, any float dtype) -> the uint8 `[2 G, n]` a slot holds:
    row a the low byte of scale row a, row G + a its high byte."""
    bits = np.asarray(scales, np.float32).astype(ml_dtypes.bfloat16).view(np.uint16)
    return np.ascontiguousarray(np.concatenate([bits & 0xFF, bits >> 8]).astype(np.uint8))


def unpack_bf16_scales(stored: np.ndarray) -> np.ndarray:
    """Inverse of ``pack_bf16_scales``: the scales, f32 `[G, n]`."""
    stored = np.asarray(stored, np.uint32)
    g = stored.shape[0] // 2
    return ((stored[g:] << 24) | (stored[:g] << 16)).view(np.float32)


def _check_group(n_in: int, group: int) -> None:
    if group <= 0 or group % (2 * MX_BLOCK) or n_in % group:
        raise ValueError(f"pack group {group} must be a positive multiple of {2 * MX_BLOCK} "
                         f"dividing the input width {n_in}")


def pack_mxfp4_for_kernel(codes: np.ndarray, scales: np.ndarray,
                          group: int) -> tuple[np.ndarray, np.ndarray]:
    """Checkpoint MXFP4 (``mkc.model.mxfp4``: codes [out, in/2] with element 2j low / 2j+1 high,
    scales [out, in/32]) -> kernel layout (codes [in/2, out], scales [in/32, out]).

    Rows are input rows (K-major), cut into pack groups of ``group``; each group's codes are
    G/8 little-endian uint32 words a column (four byte rows each) laid out as
    ``MXFP4_LAYOUT`` says, so ``mxfp4_dequantize_tile`` places every value with a shift and a
    mask. The values are kept except where the kernel cannot: a block of scale 0 is zero
    (its codes become zero), -0 becomes +0, and a scale of 255 (NaN) or one under which a
    value overflows bf16 (past 252) is refused with a ValueError saying where."""
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    n_out, n_in = codes.shape[0], 2 * codes.shape[1]
    _check_group(n_in, group)
    if scales.shape != (n_out, n_in // MX_BLOCK):
        raise ValueError(f"scales {scales.shape} do not match codes {codes.shape}")
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(n_out, n_in)
    per_value = np.repeat(scales, MX_BLOCK, axis=1)
    _refuse_unrepresentable(nibbles, per_value)
    nibbles = np.where(per_value == 0, 0, nibbles).astype(np.uint8)
    return _kernel_words(nibbles.T, group), np.ascontiguousarray(scales.T)


def _refuse_unrepresentable(nibbles: np.ndarray, scales: np.ndarray) -> None:
    """Scales (one a value, [out, in]) the kernel's decode cannot represent -> ValueError."""
    nan = scales == SCALE_NAN
    # A nonzero code's bf16 exponent is s - 1 + mag // 2 (mag 1..7: 0.5, 1, 1.5, 2, 3, 4, 6).
    mag = (nibbles & 7).astype(np.int32)
    over = (mag > 0) & (scales.astype(np.int32) - 1 + mag // 2 >= 0xFF)
    for bad, what in ((nan, "a scale of 255 (NaN)"), (over & ~nan, "a value past bf16's range")):
        if bad.any():
            out, col = (int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"MXFP4 weight row {out}, input {col} (block {col // MX_BLOCK}, "
                             f"scale {int(scales[out, col])}): {what}; the kernel decodes scales "
                             "up to 252 (the checkpoint's weights there are not finite)")


def _kernel_words(nibbles: np.ndarray, group: int) -> np.ndarray:
    """Codes ``s e e m`` [in, out] (no -0) -> kernel-layout bytes [in/2, out] (MXFP4_LAYOUT)."""
    n_in, n_out = nibbles.shape
    mag = nibbles & 7
    recoded = np.where(mag < 2, mag ^ 1, mag).astype(np.uint32)
    sign = ((nibbles >> 3) & (mag > 0)).astype(np.uint32)
    quarters = recoded.reshape(n_in // group, 4, group // 8, 2, n_out)   # [g, q, a, h, out]
    signs = sign.reshape(quarters.shape)
    words = np.zeros((n_in // group, group // 8, n_out), np.uint32)
    for q, (s_bit, *m_bits) in enumerate(MXFP4_LAYOUT):
        for h in (0, 1):
            c, lift = quarters[:, q, :, h], 16 * h
            words |= signs[:, q, :, h] << (s_bit + lift)
            for i, bit in enumerate(m_bits):
                words |= ((c >> (2 - i)) & 1) << (bit + lift)
    # little-endian: word a of a column is byte rows 4a .. 4a + 3
    as_bytes = words.astype("<u4").view(np.uint8).reshape(n_in // group, group // 8, n_out, 4)
    return np.ascontiguousarray(as_bytes.transpose(0, 1, 3, 2).reshape(n_in // 2, n_out))


def _kernel_nibbles(codes: np.ndarray, group: int) -> np.ndarray:
    """Inverse of ``_kernel_words``: kernel-layout bytes [in/2, out] -> codes [in, out]."""
    n_in, n_out = 2 * codes.shape[0], codes.shape[1]
    _check_group(n_in, group)
    as_bytes = codes.reshape(n_in // group, group // 8, 4, n_out).transpose(0, 1, 3, 2)
    words = np.ascontiguousarray(as_bytes).view("<u4")[..., 0].astype(np.uint32)   # [g, a, out]
    out = np.zeros((n_in // group, 4, group // 8, 2, n_out), np.uint8)
    for q, (s_bit, *m_bits) in enumerate(MXFP4_LAYOUT):
        for h in (0, 1):
            lift = 16 * h
            c = sum(((words >> (bit + lift)) & 1) << (2 - i) for i, bit in enumerate(m_bits))
            mag = np.where(c < 2, c ^ 1, c)
            out[:, q, :, h] = mag | (((words >> (s_bit + lift)) & 1) << 3)
    return out.reshape(n_in, n_out)


def fp8_codes_from_kernel_mxfp4(codes: np.ndarray, scales: np.ndarray, group: int,
                                block: int = MX_BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """Kernel-layout MXFP4 (codes [in/2, out] and E8M0 scales [in/32, out],
    ``pack_mxfp4_for_kernel`` with ``group``) -> FP8 codes [in, out], the bytes of
    float8_e4m3fn values one input row per row, and E8M0 scales [in/block, out].

    With ``block`` 32 the values are the e2m1 values and the scales the checkpoint's: exact,
    every e2m1 value being an e4m3 value. With a larger block each block of rows takes its
    largest 32-row scale S and a value v of a 32-row block of scale s becomes v * 2**(s - S):
    exact while s - S >= -8 for every value (e4m3 reaches 2**-9), else a ValueError says
    where. A 32-row scale of 0 reads as zero, as the kernel's MXFP4 decode reads it; 255 (NaN)
    is refused for a larger block."""
    from mkc.model.mxfp4 import E2M1_VALUES
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    n_in, n_out = 2 * codes.shape[0], codes.shape[1]
    nibbles = _kernel_nibbles(codes, group)
    values = E2M1_VALUES[nibbles]
    fp8 = ml_dtypes.float8_e4m3fn
    if block == MX_BLOCK:
        return values.astype(fp8).view(np.uint8), scales
    if block % MX_BLOCK or n_in % block:
        raise ValueError(f"a block of {block} rows does not tile {n_in} input rows in {MX_BLOCK}s")
    if (scales == SCALE_NAN).any():
        raise ValueError("a scale of 255 (NaN) cannot be folded into a larger block")
    per_block = scales.reshape(n_in // block, block // MX_BLOCK, n_out).astype(np.int32)
    top = per_block.max(axis=1)                                        # [in/block, out]
    shift = np.repeat(per_block - top[:, None, :], MX_BLOCK, axis=1).reshape(n_in, n_out)
    exact = np.where(np.repeat(scales, MX_BLOCK, axis=0) == 0, 0.0, values * np.exp2(shift))
    out = exact.astype(fp8)
    wrong = out.astype(np.float64) != exact
    if wrong.any():
        r, c = np.argwhere(wrong)[0]
        raise ValueError(f"{int(wrong.sum())} values fall below FP8's range: the 32-row scales "
                         f"of a {block}-row block span {int(-shift.min())} octaves (at most 8 "
                         f"keep every value), first at input row {r}, column {c}")
    return out.view(np.uint8), top.astype(np.uint8)


def unpack_mxfp4_from_kernel(codes: np.ndarray, scales: np.ndarray,
                             group: int) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``pack_mxfp4_for_kernel``: back to checkpoint (codes [out, in/2], scales)."""
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    nibbles = _kernel_nibbles(codes, group).T
    packed = (nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)).astype(np.uint8)
    return packed, np.ascontiguousarray(scales.T)


# ---- FP4 from MXFP4: a checkpoint's MXFP4 matrix under one scale per block of rows ----------
def fp4_from_mxfp4(codes: np.ndarray, scales: np.ndarray, fmt: WeightFormat, cls: str, what: str,
                   out0: int = 0, in0: int = 0) -> Requantized:
    """MXFP4 ``[out, in/2]`` codes and ``[out, in/32]`` scales of expert matrix `what` (its
    class `cls`; `out0`, `in0`: where this part starts in the whole matrix, for the message)
    requantized to `fmt`'s fp4 blocks of input rows (`mkc.model.mxfp4.requantize_blocks`).
    Where a block's values do not fit one scale and the spec did not say `rounded`, a
    FormatError names the block and its scales' spread."""
    r = requantize_blocks(codes, scales, fmt.block, fmt.scale)
    if r.exact or fmt.rounded:
        return r
    out, blk = r.first
    lo, hi = r.first_scales
    first = in0 + blk * fmt.block
    raise FormatError(
        cls, f"{fmt.where + ': ' if fmt.where else ''}`format {cls} fp4 block {fmt.block}` "
        f"cannot hold {what} exactly: output {out0 + out}, input rows {first}-{first + fmt.block - 1} "
        f"take 32-row scales spanning {hi - lo} octave{'s' * (hi - lo != 1)} (E8M0 {lo}..{hi}), "
        f"and under one scale {r.changed} of {r.values} values in {r.inexact_blocks} of "
        f"{r.blocks} blocks have no e2m1 code (max error {r.max_abs:.3g}, relative RMS "
        f"{relative_rms(r.sq_err, r.sq_ref):.3g})",
        f"write `format {cls} fp4 block {fmt.block} rounded` to round them to the nearest "
        f"(the error is reported per matrix class), or store {cls} as `fp8 block "
        f"{fmt.block}` (exact while a block's 32-row scales span at most 8 octaves)")


def fp4_checkpoint_tensors(r: Requantized) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A requantized matrix as a checkpoint holds it: its codes, 32-row E8M0 scales equal within
    a block (so a reader decodes the kernel's values exactly), and none; or (`scale bf16`) the
    codes under 32-row scales of 1 (E8M0 127) and its bf16 block scales beside them (f32
    ``[out, in/block]``)."""
    if r.scale == "bf16":
        unit = (*r.codes.shape[:-1], 2 * r.codes.shape[-1] // MX_BLOCK)
        return r.codes, np.full(unit, SCALE_BIAS, np.uint8), r.scales
    return r.codes, r.scales_per_32(), None


def held_fp4(codes: np.ndarray, scales: np.ndarray, block_scales: np.ndarray, fmt: WeightFormat,
             first: int, width: int, columns: bool, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A part of a matrix `name` a requantized checkpoint holds (`fp4_checkpoint_tensors` with
    `scale bf16`: codes ``[out, in/2]``, unit 32-row `scales`, `block_scales` ``[out,
    in/block]``): `first` .. `first + width` of its output rows, or of its input columns if
    `columns`, as its codes and f32 block scales, taken as they are; ValueError where `fmt`
    cannot take them so."""
    codes, block_scales = np.asarray(codes), np.asarray(block_scales)
    block = 2 * codes.shape[1] // block_scales.shape[1]
    if fmt.scale != "bf16" or block != fmt.block or not (np.asarray(scales) == SCALE_BIAS).all():
        raise ValueError(f"{name} holds codes under bf16 scales per {block} rows (a requantized "
                         f"checkpoint), which `{fmt.spelled}` cannot take as they are: pack the "
                         "checkpoint itself")
    if columns:
        codes = codes[:, first // 2:(first + width) // 2]
        block_scales = block_scales[:, first // block:(first + width) // block]
    else:
        codes, block_scales = codes[first:first + width], block_scales[first:first + width]
    return codes, block_scales.astype(np.float32)


# ---- int4 block N: a bf16 checkpoint's values requantized (Muse Spark's int4 g128) ----------
INT4_MIN, INT4_MAX = -8, 7
INT4_LEVELS = 7        # the scale maps a block's largest magnitude to 7
# A block's scale is a positive bf16 normal under which every code's value stays finite (-8 x
# the scale within bf16): 0 or a negative scale is no symmetric quantizer's, a subnormal one
# the TPU flushes to zero.
INT4_SCALES = ScaleRange("int4 block scale(s)", float(ml_dtypes.finfo(ml_dtypes.bfloat16).tiny),
                         float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) / -INT4_MIN,
                         "a positive bf16 normal under which the code -8 stays finite")


@dataclasses.dataclass(frozen=True)
class Int4:
    """A matrix `[out, in]` requantized to int4 blocks: its codes (int8 values -8..7), its
    bf16-valued scales (f32 `[out, in / block]`) and how far the held values q x scale are from
    the checkpoint's (values moved, max abs error, squared error and squared values summed)."""

    codes: np.ndarray
    scales: np.ndarray
    changed: int
    values: int
    max_abs: float
    sq_err: float
    sq_ref: float
    blocks: int = 0
    inexact_blocks: int = 0

    @property
    def exact(self) -> bool:
        return self.changed == 0

    def held(self) -> np.ndarray:
        """The values the kernel multiplies, f32 `[out, in]` (q x scale: exact in f32)."""
        block = self.codes.shape[1] // self.scales.shape[1]
        return self.codes.astype(np.float32) * np.repeat(self.scales, block, axis=1)


def int4_quantize(w: np.ndarray, block: int) -> Int4:
    """`[out, in]` values -> int4 blocks of `block` input rows: symmetric round to nearest, each
    block's scale its largest magnitude over 7 rounded to bf16 (1 for an all-zero block; kept in
    `INT4_SCALES`, a value past what it holds moved), each code the value over the scale rounded
    to the nearest integer (ties to even), clipped to -8..7. ValueError when `block` does not
    tile the inputs."""
    w = np.asarray(w, np.float32)
    out, n_in = w.shape
    if block <= 0 or n_in % block:
        raise ValueError(f"an int4 block of {block} rows does not tile {n_in} input rows")
    g = w.reshape(out, n_in // block, block)
    top = np.max(np.abs(g), axis=-1)
    scale = (top / np.float32(INT4_LEVELS)).astype(ml_dtypes.bfloat16).astype(np.float32)
    scale = np.where(scale == 0, np.float32(1), np.clip(scale, INT4_SCALES.low, INT4_SCALES.high))
    q = np.clip(np.rint(g / scale[..., None]), INT4_MIN, INT4_MAX).astype(np.int8)
    held = (q.astype(np.float32) * scale[..., None]).reshape(out, n_in)
    err = held.astype(np.float64) - w
    return Int4(q.reshape(out, n_in), scale, int(np.count_nonzero(err)), int(w.size),
                float(np.max(np.abs(err), initial=0.0)), float(np.sum(err * err)),
                float(np.sum(w.astype(np.float64) ** 2)), int(scale.size),
                int((err != 0).reshape(out, n_in // block, block).any(axis=-1).sum()))


def int4_from_bf16(w: np.ndarray, fmt: WeightFormat, cls: str, what: str) -> Int4:
    """Expert matrix `what` (class `cls`, bf16 values `[out, in]`) requantized to `fmt`'s int4
    blocks; a FormatError where a value moves and the spec did not say `rounded`."""
    r = int4_quantize(w, fmt.block)
    if r.exact or fmt.rounded:
        return r
    raise FormatError(
        cls, f"{fmt.where + ': ' if fmt.where else ''}`format {cls} {fmt.spelled}` cannot hold "
        f"{what} exactly: {r.changed} of {r.values} values have no int4 code under their "
        f"block's scale (max error {r.max_abs:.3g}, relative RMS "
        f"{relative_rms(r.sq_err, r.sq_ref):.3g})",
        f"write `format {cls} int4 block {fmt.block} rounded` to round them to the nearest "
        "(the error is reported per matrix class), or keep it bf16 (drop the `format` line)")


def _two_rows_a_byte(nibbles: np.ndarray) -> np.ndarray:
    """4-bit values `[in, out]` (low 4 bits) -> uint8 `[in/2, out]`, row 2a low, 2a + 1 high."""
    n = np.asarray(nibbles).astype(np.uint8) & 0xF
    if n.shape[0] % 2:
        raise ValueError(f"{n.shape[0]} input rows cannot be packed two a byte")
    return np.ascontiguousarray(n[0::2] | (n[1::2] << 4))


def _rows_of_bytes(codes: np.ndarray) -> np.ndarray:
    """Inverse of ``_two_rows_a_byte``: the nibbles uint8 `[in, out]`."""
    c = np.asarray(codes, np.uint8)
    return np.stack([c & 0xF, c >> 4], axis=1).reshape(2 * c.shape[0], c.shape[1])


def pack_int4_for_kernel(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """int4 codes `[out, in]` (int8 values -8..7) and scales `[out, in/block]` (bf16 values) ->
    the slot's codes uint8 `[in/2, out]` (K-major, two rows a byte, `ops.int4_dot`) and its
    scales (`pack_bf16_scales` of `[in/block, out]`). ValueError for codes outside -8..7,
    scales outside `INT4_SCALES` or not bf16 values, or shapes that do not match."""
    codes, scales = np.asarray(codes), np.asarray(scales, np.float32)
    if codes.ndim != 2 or scales.ndim != 2 or scales.shape[0] != codes.shape[0] or \
            not scales.shape[1] or codes.shape[1] % scales.shape[1]:
        raise ValueError(f"int4 scales {scales.shape} do not give whole blocks of codes {codes.shape}")
    if codes.min(initial=0) < INT4_MIN or codes.max(initial=0) > INT4_MAX:
        raise ValueError("int4 codes must lie in -8..7")
    INT4_SCALES.checked(scales, "int4 scales [out, in/block]")
    if (scales.astype(ml_dtypes.bfloat16).astype(np.float32) != scales).any():
        raise ValueError("int4 scales must be bf16 values")
    return _two_rows_a_byte(codes.T), pack_bf16_scales(scales.T)


def unpack_int4_from_kernel(codes: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``pack_int4_for_kernel``: codes int8 `[out, in]`, scales f32 `[out, in/block]`."""
    nibbles = _rows_of_bytes(codes).astype(np.int8)
    signed = np.where(nibbles > INT4_MAX, nibbles - 16, nibbles).astype(np.int8)
    return np.ascontiguousarray(signed.T), np.ascontiguousarray(unpack_bf16_scales(scales).T)


def int4_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A slot's int4 codes and scales (``pack_int4_for_kernel``) -> f64 values `[in, out]`."""
    q, s = unpack_int4_from_kernel(codes, scales)
    return (q.astype(np.float64) * np.repeat(s, q.shape[1] // s.shape[1], axis=1)).T


# ---- nvfp4: an NVFP4 checkpoint's codes and scales held as they are --------------------------
def pack_nvfp4_for_kernel(codes: np.ndarray, block_scales: np.ndarray, global_scale
                          ) -> tuple[np.ndarray, np.ndarray]:
    """An NVFP4 checkpoint matrix (codes uint8 `[out, in/2]`, two e2m1 values a byte, input
    2j in the low nibble; `weight_scale` e4m3 `[out, in/16]` as float8_e4m3fn or its bytes;
    `weight_scale_2`, the f32 global scale: one, or one per output row) -> the slot's codes
    uint8 `[in/2, out]` (the checkpoint's bytes transposed: its nibble order is the kernel's)
    and scales uint8 `[in/16 + GLOBAL_SCALE_ROWS, out]` (the e4m3 bytes K-major, then each
    column's global scale as its little-endian bytes). Byte for byte the checkpoint's;
    ValueError for shapes that do not match or a scale outside its range (`nvfp4.BLOCK_SCALES`,
    `GLOBAL_SCALES`: the checkpoint loader refuses such a checkpoint first)."""
    from mkc.layers.expert_formats import GLOBAL_SCALE_ROWS, NVFP4_BLOCK
    codes = np.asarray(codes, np.uint8)
    values = nvfp4.block_scale_values(block_scales)
    out, half = codes.shape
    if values.shape != (out, 2 * half // NVFP4_BLOCK) or (2 * half) % NVFP4_BLOCK:
        raise ValueError(f"NVFP4 scales {values.shape} do not match codes {codes.shape}: one e4m3 "
                         f"scale per {NVFP4_BLOCK} inputs, {out} x {2 * half // NVFP4_BLOCK}")
    raw = nvfp4.BLOCK_SCALES.checked(values, "NVFP4 weight_scale [out, in/16]").view(np.uint8)
    g = np.broadcast_to(np.asarray(global_scale, np.float32).reshape(-1), (out,))
    nvfp4.GLOBAL_SCALES.checked(g, "NVFP4 weight_scale_2 [out]")
    words = np.ascontiguousarray(g.astype("<f4")).view(np.uint8).reshape(out, GLOBAL_SCALE_ROWS)
    return (np.ascontiguousarray(codes.T),
            np.ascontiguousarray(np.concatenate([raw.T, words.T]).astype(np.uint8)))


def unpack_nvfp4_from_kernel(codes: np.ndarray, scales: np.ndarray
                             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Inverse of ``pack_nvfp4_for_kernel``: codes `[out, in/2]`, e4m3 scale bytes `[out,
    in/16]`, the global scales f32 `[out]`."""
    from mkc.layers.expert_formats import GLOBAL_SCALE_ROWS
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    blocks = scales.shape[0] - GLOBAL_SCALE_ROWS
    g = np.ascontiguousarray(scales[blocks:].T).view("<f4").reshape(-1).astype(np.float32)
    return np.ascontiguousarray(codes.T), np.ascontiguousarray(scales[:blocks].T), g


def nvfp4_dequantize(codes: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """A slot's NVFP4 (``pack_nvfp4_for_kernel``) -> f64 values `[in, out]`: e2m1 x e4m3 x the
    global scale, NVIDIA's dequantization."""
    from mkc.layers.expert_formats import NVFP4_BLOCK
    from mkc.model.mxfp4 import E2M1_VALUES
    c, s, g = unpack_nvfp4_from_kernel(codes, scales)
    values = E2M1_VALUES[_rows_of_bytes(c.T)].astype(np.float64)             # [in, out]
    block = s.T.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    return values * np.repeat(block, NVFP4_BLOCK, axis=0) * g.astype(np.float64)[None, :]


# ---- a rank's slice of a checkpoint expert matrix, as its slot holds it ----------------------
def _whole_blocks(index: list[int], block: int) -> bool:
    """Whether `index` is whole runs of `block` consecutive indices, each starting on a block."""
    runs = [index[k:k + block] for k in range(0, len(index), block)]
    return not len(index) % block and all(r[0] % block == 0 and r == list(range(r[0], r[0] + block))
                                          for r in runs)


def int4_expert_slice(values: np.ndarray, out_index: Sequence[int], in_index: Sequence[int],
                      fmt: WeightFormat, cls: str, what: str) -> tuple[np.ndarray, np.ndarray, Int4]:
    """A rank's slice of a bf16 checkpoint expert matrix `values` `[out, in]` (its output rows
    `out_index` in the slot's column order, its input columns `in_index`, whole runs of
    `fmt.block` starting on a block: `resolve` makes a rank's rows whole blocks) requantized to
    `fmt`'s int4 blocks (`int4_from_bf16`, which refuses moved values unless `rounded`) and
    packed: the slot's codes and scales, and the requantization with its error."""
    in_index = list(in_index)
    if not _whole_blocks(in_index, fmt.block):
        raise ValueError(f"the input columns of {what} do not start whole {fmt.block}-row blocks")
    part = np.asarray(values, np.float32)[np.ix_(list(out_index), in_index)]
    r = int4_from_bf16(part, fmt, cls, what)
    codes, scales = pack_int4_for_kernel(r.codes, r.scales)
    return codes, scales, r


def nvfp4_expert_slice(codes: np.ndarray, block_scales: np.ndarray, global_scale,
                       out_index: Sequence[int], in_index: Sequence[int]
                       ) -> tuple[np.ndarray, np.ndarray]:
    """A rank's slice of an NVFP4 checkpoint expert matrix (codes `[out, in/2]`, e4m3
    `weight_scale` `[out, in/16]`, `weight_scale_2`: one, or one per output row, e.g. gate's
    and up's beside each other) as its slot holds it (`pack_nvfp4_for_kernel`): its output
    rows `out_index` in the slot's column order and its input columns `in_index`, whole runs of
    16 starting on a block (ValueError otherwise). Byte for byte the checkpoint's."""
    from mkc.layers.expert_formats import NVFP4_BLOCK
    in_index, out_index = list(in_index), list(out_index)
    if not _whole_blocks(in_index, NVFP4_BLOCK):
        raise ValueError(f"NVFP4 input columns must be whole runs of {NVFP4_BLOCK} starting on a block")
    raw = np.asarray(block_scales)
    raw = raw if raw.dtype == np.uint8 else raw.view(np.uint8)
    glob = np.broadcast_to(np.asarray(global_scale, np.float32).reshape(-1), (np.asarray(codes).shape[0],))
    nibbles = _rows_of_bytes(np.asarray(codes, np.uint8).T)[in_index][:, out_index]      # [in, out]
    scales = raw[np.ix_(out_index, [i // NVFP4_BLOCK for i in in_index[::NVFP4_BLOCK]])]
    packed = _two_rows_a_byte(nibbles).T
    return pack_nvfp4_for_kernel(packed, scales, glob[out_index])


# ---- NVFP4 from bf16: an NVFP4 checkpoint's excluded layers, quantized as the quantizer does -
@dataclasses.dataclass(frozen=True)
class NVFP4:
    """A matrix `[out, in]` quantized to NVFP4 as a checkpoint holds it: codes uint8 `[out,
    in/2]` (input 2j in the low nibble), e4m3 `weight_scale` (float8_e4m3fn `[out, in/16]`),
    the f32 global scale `weight_scale_2`; and how far its values are from the source's (the
    fields of `mkc.model.mxfp4.Requantized`'s error, which `RequantizationError` sums)."""

    codes: np.ndarray
    block_scales: np.ndarray
    global_scale: np.float32
    values: int
    changed: int
    blocks: int
    inexact_blocks: int
    max_abs: float
    sq_err: float
    sq_ref: float

    @property
    def exact(self) -> bool:
        return self.changed == 0

    def held(self) -> np.ndarray:
        """The values it holds, f64 `[out, in]` (e2m1 x e4m3 x global)."""
        codes, scales = pack_nvfp4_for_kernel(self.codes, self.block_scales, self.global_scale)
        return nvfp4_dequantize(codes, scales).T


def nvfp4_global_scale(w: np.ndarray) -> np.float32:
    """NVIDIA's global scale of a matrix's values: its largest magnitude over 6 x 448, f32
    (1 for an all-zero matrix), kept in `nvfp4.GLOBAL_SCALES` (past it the values round down
    to what the range holds, a moved value the requantization counts)."""
    amax = float(np.max(np.abs(np.asarray(w, np.float32)), initial=0.0))
    if not amax:
        return np.float32(1.0)
    limits = nvfp4.GLOBAL_SCALES
    return np.float32(min(max(amax / (nvfp4.E2M1_MAX * nvfp4.E4M3_MAX), limits.low), limits.high))


def nvfp4_from_bf16(w: np.ndarray, global_scale: np.float32 | None = None) -> NVFP4:
    """Values `[out, in]` quantized to NVFP4 by NVIDIA's recipe (ModelOpt's weight
    quantizer): the global scale `nvfp4_global_scale` (or `global_scale`: the whole matrix's,
    `w` a slice of whole blocks of it), each 16-input block's e4m3 scale its largest magnitude
    over 6 x the global scale, rounded to e4m3 (at most 448; a block of zeros 1, as ModelOpt
    writes it; at least e4m3's smallest normal, `nvfp4.BLOCK_SCALES`, so a tiny block's values
    round under it, moved values the error counts), each value the nearest e2m1 value (ties to
    the even code) of itself over its block's scale times the global scale, at most 6 in
    magnitude. ValueError for values that are not finite or inputs that are not whole blocks."""
    from mkc.layers.expert_formats import NVFP4_BLOCK
    from mkc.model.mxfp4 import E2M1_MAGNITUDES, E2M1_MAX, nearest_e2m1
    w = np.asarray(w, np.float32)
    out, n_in = w.shape
    if n_in % NVFP4_BLOCK or not np.isfinite(w).all():
        raise ValueError(f"NVFP4 takes finite values in whole blocks of {NVFP4_BLOCK} inputs, not {w.shape}")
    glob = (nvfp4_global_scale(w) if global_scale is None
            else np.float32(nvfp4.GLOBAL_SCALES.checked(np.float32(global_scale), "NVFP4 global scale")))
    blocks = w.reshape(out, n_in // NVFP4_BLOCK, NVFP4_BLOCK).astype(np.float64)
    wanted = np.max(np.abs(blocks), axis=-1) / (E2M1_MAX * np.float64(glob))
    limits = nvfp4.BLOCK_SCALES
    scales = np.where(wanted == 0, 1.0, np.clip(wanted, limits.low, limits.high))
    scales = scales.astype(ml_dtypes.float8_e4m3fn)
    unit = scales.astype(np.float64) * np.float64(glob)
    y = np.minimum(np.abs(blocks) / unit[..., None], E2M1_MAX)
    magnitude = nearest_e2m1(y)
    signed = np.where(blocks < 0, -1.0, 1.0) * E2M1_MAGNITUDES[magnitude]
    nibbles = (magnitude + np.where((blocks < 0) & (magnitude > 0), 8, 0)).reshape(out, n_in)
    err = ((signed * unit[..., None]) - blocks).reshape(out, n_in)       # exact in f64
    moved = (err != 0).reshape(out, n_in // NVFP4_BLOCK, NVFP4_BLOCK).any(axis=-1)
    return NVFP4(_two_rows_a_byte(nibbles.T).T.copy(), scales, glob, values=int(w.size),
                 changed=int(np.count_nonzero(err)), blocks=int(moved.size),
                 inexact_blocks=int(moved.sum()), max_abs=float(np.max(np.abs(err), initial=0.0)),
                 sq_err=float(np.sum(err * err)), sq_ref=float(np.sum(blocks * blocks)))


def nvfp4_draw(rng: np.random.Generator, shape: Sequence[int], std: float
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random NVFP4 expert matrices as a checkpoint holds them, for `shape` `[E, out, in/2]`
    (codes): uniform code bytes, e4m3 block scales uniform over the e4m3 values in 1..8
    (positive, finite), and each matrix's global scale making its values' RMS `std`:
    (codes uint8, `weight_scale` float8_e4m3fn `[E, out, in/16]`, `weight_scale_2` f32 `[E]`)."""
    from mkc.layers.expert_formats import NVFP4_BLOCK
    from mkc.model.mxfp4 import E2M1_VALUES
    experts, out, half = shape
    codes = rng.integers(0, 256, shape, dtype=np.uint8)
    one, eight = (np.array(v, ml_dtypes.float8_e4m3fn).view(np.uint8) for v in (1.0, 8.0))
    scales = rng.integers(int(one), int(eight) + 1, (experts, out, 2 * half // NVFP4_BLOCK),
                          dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    values = E2M1_VALUES[np.stack([codes & 0xF, codes >> 4], axis=-1)].reshape(experts, out, 2 * half)
    values = values * np.repeat(scales.astype(np.float32), NVFP4_BLOCK, axis=-1)
    rms = np.sqrt(np.mean(values.astype(np.float64) ** 2, axis=(1, 2)))
    return codes, scales, (std / np.where(rms > 0, rms, 1.0)).astype(np.float32)
