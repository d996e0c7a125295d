"""A selected expert's matmul in its stored format, as a routed-experts body calls it."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers.expert_formats import (GLOBAL_SCALE_ROWS, MX_BLOCK, NVFP4_BLOCK, NVFP4_CODES_ROWS,
                                       feeds_codes, ops, rows_per_byte)
from mkc.runtime import experts as expert_slots
from mkc.runtime import pool
from mkc.runtime.context import Layer

F32 = jnp.float32
BF16 = jnp.bfloat16


def expert_matmul(c: Layer, k, x: jax.Array, name: str, group: int) -> jax.Array:
    """x @ selected expert k's matrix `name` in the spec's `format expert.<name>`: bf16 values
    from its slot; or codes and scales, one pack group of `group` input rows at a time: MXFP4
    codes (two rows a byte) decoded with their 32-row scales; FP8 codes (one) converted and
    scaled per 32 rows; or, with FP8 or FP4 blocks of whole pack groups, fed to the MXU as they
    are in a mixed bf16 x fp8 (fp4) dot, their block's scale multiplying the group's partial
    product. The dots see the same values times powers of two (FP4: the values packing
    requantized them to; `scale bf16`: times the searched bf16 scales); with an FP8
    checkpoint's blocks (`fp8 block R x C`), its codes and its f32 scales; `int4 block N`: a
    bf16 dot of the codes' integers per block times its bf16 scale; `nvfp4`: the checkpoint's
    values decoded to bf16 per pack group, the product times the f32 global scale."""
    fmt = c.weight_format(f"expert.{name}")
    if fmt.name == "bf16":
        return c.expert_matmul(k, name, x)
    slots, buf = c.experts, getattr(c.refs, c.experts.pool)
    c_row, c_rows, c_cols = expert_slots.matrix(slots, c.refs, k, name + "_codes")
    scales = expert_slots.read_u8(slots, c.refs, k, name + "_scales")
    if fmt.cols:
        return _checkpoint_blocks_matmul(fmt, x, buf, (c_row, c_rows, c_cols), scales)
    if fmt.name == "int4":
        return _int4_matmul(fmt, x, buf, (c_row, c_rows, c_cols), scales, group)
    if fmt.name == "nvfp4":
        return _nvfp4_matmul(x, buf, (c_row, c_rows, c_cols), scales, group)
    per_byte = rows_per_byte(fmt)
    bias = ops.mxfp4_scale_bias(scales) if fmt.name == "mxfp4" else None   # once a matrix
    # FP8 and FP4 blocks: every block's scale decoded at once (a row at a time costs as many
    # registers)
    decoded = None
    if fmt.scale == "bf16":
        decoded = ops.bf16_block_scales(scales)
    elif fmt.block != MX_BLOCK:
        decoded = ops.e8m0_scale(scales)
    out = None
    for g in range(x.shape[1] // group):
        xg = x[:, g * group:(g + 1) * group].astype(BF16)
        codes = pool.pooled_u8(buf, c_row, c_rows, c_cols, first=g * group // per_byte,
                               count=group // per_byte)
        if fmt.block == MX_BLOCK:                # a scale per 32 rows: scale every value
            blocks = slice(g * group // MX_BLOCK, (g + 1) * group // MX_BLOCK)
            w = (ops.mxfp4_dequantize_tile(codes, bias[blocks], BF16) if fmt.name == "mxfp4"
                 else ops.fp8_block_scaled_tile(codes, scales[blocks], BF16))
            part = jnp.dot(xg, w, preferred_element_type=F32)
        elif fmt.name == "fp4":                  # e2m1 codes as they are, one scale a block
            b = g * group // fmt.block
            part = ops.fp4_group_matmul(xg, codes, decoded[b:b + 1])
        else:                                    # one scale for the group's partial product
            b = g * group // fmt.block
            part = ops.fp8_group_matmul(xg, codes, decoded[b:b + 1], feeds_codes(fmt))
        out = part if out is None else out + part
    return out


def _checkpoint_blocks_matmul(fmt, x: jax.Array, buf, codes: tuple, scales: jax.Array) -> jax.Array:
    """`fp8 block R x C`: x @ an FP8 checkpoint's codes (`codes`: their slot row, rows, cols)
    one group of input rows under one block row at a time (`block_groups`), each a mixed
    bf16 x fp8 dot whose partial product is multiplied by the group's f32 scale per column
    (`ops.block_scales`, decoded once), added in order."""
    c_row, c_rows, c_cols = codes
    group = min(fmt.block, c_rows)
    groups = c_rows // group
    row_scales = ops.block_scales(scales, groups, c_cols // scales.shape[1])
    out = None
    for g in range(groups):
        xg = x[:, g * group:(g + 1) * group].astype(BF16)
        w = pool.pooled_u8(buf, c_row, c_rows, c_cols, first=g * group, count=group)
        part = ops.fp8_group_matmul(xg, w, row_scales[g:g + 1], feeds_codes(fmt))
        out = part if out is None else out + part
    return out


def _int4_matmul(fmt, x: jax.Array, buf, codes: tuple, scales: jax.Array, group: int) -> jax.Array:
    """`int4 block N`: x @ the codes one step of min(N, `group`) input rows at a time (a block,
    or a pack group inside one), each a bf16 dot of the codes' integers whose partial product
    is multiplied by its block's bf16 scale per column (decoded once), added in order: the
    expression of the emulation's `chunked_linear` with `scales`."""
    c_row, c_rows, c_cols = codes
    step = min(fmt.block, group)
    row_scales = ops.bf16_block_scales(scales)                    # [rows / block, N]
    out = None
    for r in range(0, x.shape[1], step):
        w = pool.pooled_u8(buf, c_row, c_rows, c_cols, first=r // 2, count=step // 2)
        part = ops.int4_dot(x[:, r:r + step].astype(BF16), w)
        b = r // fmt.block
        scaled = part * row_scales[b:b + 1]
        out = scaled if out is None else out + scaled
    return out


def _nvfp4_matmul(x: jax.Array, buf, codes: tuple, scales: jax.Array, group: int) -> jax.Array:
    """`nvfp4`: x @ the checkpoint's values a pack group at a time, added in order, the sum
    times each column's f32 global scale. Each group: the values decoded to bf16 (e2m1 x e4m3,
    exact) in one bf16 dot; at up to `NVFP4_CODES_ROWS` rows the codes fed as they are
    (`ops.nvfp4_codes_matmul`), which libtpu schedules in fewer bundles there."""
    c_row, c_rows, c_cols = codes
    blocks = x.shape[1] // NVFP4_BLOCK
    out = None
    for r in range(0, x.shape[1], group):
        w = pool.pooled_u8(buf, c_row, c_rows, c_cols, first=r // 2, count=group // 2)
        s = scales[r // NVFP4_BLOCK:(r + group) // NVFP4_BLOCK]
        xg = x[:, r:r + group].astype(BF16)
        if x.shape[0] <= NVFP4_CODES_ROWS:
            part = ops.nvfp4_codes_matmul(xg, w, s)
        else:
            part = jnp.dot(xg, ops.nvfp4_values(w, s), preferred_element_type=F32)
        out = part if out is None else out + part
    return out * ops.nvfp4_global_scale(scales[blocks:blocks + GLOBAL_SCALE_ROWS])
