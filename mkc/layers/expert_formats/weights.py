"""Host-side packing of expert matrices into their stored formats (numpy, at weight-load
time): MXFP4 into the kernel layout (`MXFP4_LAYOUT`) and back, MXFP4 into FP8 codes, an FP8
checkpoint's codes and block scales into a slot (`fp8 block R x C`) and back, bf16 block
scales (`scale bf16`) into a slot and back, and a checkpoint's MXFP4 requantized to FP4 under
one scale per block of rows (`fp4_from_mxfp4`, as a checkpoint holds it:
`fp4_checkpoint_tensors`, read back by `held_fp4`)."""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from mkc.ir import WeightFormat
from mkc.model.family import FormatError
from mkc.model.fp8_blocks import checked_scales
from mkc.model.mxfp4 import SCALE_BIAS, Requantized, relative_rms, requantize_blocks
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
    import ml_dtypes
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
    import ml_dtypes

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
