"""The kernel math of the expert formats (`mkc.layers.expert_formats`): decoding MXFP4 and
FP8 codes under E8M0 scales, and the mixed dots that feed FP8 or FP4 codes to the MXU as they
are, a pack group at a time. Functions over in-kernel values; `lowering.expert_matmul` calls
them on a slot's matrix."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mkc.layers.expert_formats import MX_BLOCK, NVFP4_BLOCK, SCALE_NAN

F32 = jnp.float32

# The bits of `MXFP4_LAYOUT` (the package docstring) a decode places with a shift and a mask.
MXFP4_BF16_BITS = 0x81C081C0          # sign and magnitude bits of both bf16 halves of a word
MXFP4_ZERO_BITS = 1 << 6              # c = 1 (zero) where a bf16 keeps it
_QUARTER_SHIFT = (0, 3, 6)            # quarters 0..2: word << shift, masked
_LAST_RIGHT_SHIFT, _LAST_BITS, _LAST_COPIES = 7, 0x00D800D8, 1 + (1 << 5) + (1 << 11)


def mxfp4_scale_bias(scales: jax.Array) -> jax.Array:
    """E8M0 scales uint8 [K/32, N] -> uint32 [K/32, N]: in each bf16 half, the exponent bits
    of 2**(s - 128) (the block's scale times the e2m1 bias), which added to a re-coded
    magnitude (c >= 2: exponent e and mantissa m) give 2**(e - 1 + s - 127) * (1 + m/2); c = 0
    alone is 2**(s - 128), the code 0.5 times the scale. Computed once per matrix."""
    half = (scales.astype(jnp.uint32) << 7) - jnp.uint32(1 << 7)
    return half * jnp.uint32(0x10001)


def mxfp4_dequantize_tile(codes: jax.Array, bias: jax.Array, dtype: jnp.dtype = F32) -> jax.Array:
    """Decode one pack group of kernel-layout MXFP4 codes -> [G, N] (``[in, out]`` rows).

    codes uint8 [G/2, N] (``pack_mxfp4_for_kernel``'s layout, read as G/8 uint32 words);
    bias uint32 [G/32, N], ``mxfp4_scale_bias`` of the group's E8M0 scales. Bit-equal to
    ``mxfp4_dequantize`` (transposed) for scales 2..252; packing zeroes the codes of a block
    of scale 0 (2**-127, itself subnormal) and refuses scales past 252 where a value
    overflows bf16, and 255 (NaN). With scale 1 the codes +-0.5 (2**-127) flush to zero, as
    TPUs flush subnormals. bf16 output is exact (two significant bits, f32's exponent range).

    Counted (`mkc.perf.work`): 9 operations on quarter-size uint32 words to place the bits,
    then a bias add, a zero test and a select on each quarter: 21 eighths of a VPU operation a
    value, 2.6 (it was about 7.6)."""
    from jax.experimental.pallas import tpu as pltpu
    words = pltpu.bitcast(codes, jnp.uint32)                               # [G/8, N]
    rows, cols = words.shape
    groups = rows * 8
    mask = jnp.uint32(MXFP4_BF16_BITS)
    placed = [(words << s) & mask if s else words & mask for s in _QUARTER_SHIFT]
    placed.append((((words >> _LAST_RIGHT_SHIFT) & jnp.uint32(_LAST_BITS))
                   * jnp.uint32(_LAST_COPIES)) & mask)
    quarters = []
    for q, bits in enumerate(placed):
        value = pltpu.bitcast(bits + _quarter_bias(bias, q, groups, cols), jnp.uint16)
        zero = pltpu.bitcast(bits, jnp.uint16) == jnp.uint16(MXFP4_ZERO_BITS)
        quarters.append(jnp.where(zero, jnp.uint16(0), value))
    out = lax.bitcast_convert_type(jnp.concatenate(quarters, axis=0), jnp.bfloat16)
    return out if dtype == jnp.bfloat16 else out.astype(dtype)


def _quarter_bias(bias: jax.Array, q: int, groups: int, cols: int) -> jax.Array:
    """Quarter q's bias words [G/8, N]: word a of the quarter holds input rows q G/4 + 2a and
    + 1, whose 32-row block's bias it takes (runs of whole blocks, broadcast down the rows)."""
    first, quarter = q * groups // 4, groups // 4
    runs, r = [], first
    while r < first + quarter:                      # blocks meet the quarter at 16-row steps
        end = min(first + quarter, (r // MX_BLOCK + 1) * MX_BLOCK)
        runs.append(jnp.broadcast_to(bias[r // MX_BLOCK][None, :], ((end - r) // 2, cols)))
        r = end
    return runs[0] if len(runs) == 1 else jnp.concatenate(runs, axis=0)


def e8m0_scale(scales: jax.Array) -> jax.Array:
    """E8M0 scales (uint8) -> f32 2**(s - 127) for s 1..254; 255 is NaN, and 0 (2**-127, itself
    subnormal, which TPUs flush) is zero, said here rather than left to the hardware."""
    s = scales.astype(jnp.int32)
    scale = lax.bitcast_convert_type(s << 23, F32)
    scale = jnp.where(s == 0, 0.0, scale)
    return jnp.where(s == SCALE_NAN, F32(jnp.nan), scale)


def fp8_block_scaled_tile(codes: jax.Array, scales: jax.Array, dtype: jnp.dtype = jnp.bfloat16
                          ) -> jax.Array:
    """Decode FP8 codes with E8M0 block scales -> [G, N] of ``dtype``.

    codes uint8 [G, N], the bytes of float8_e4m3fn values, one input row per row; scales uint8
    [G/32, N]. A reinterpretation, a conversion and one multiply a value: the values are e2m1
    values (``fp8_codes_from_kernel_mxfp4``), so the result is bit-equal to
    ``mxfp4_dequantize_tile`` of the MXFP4 codes they came from, with its edge cases (scale 0
    decodes to zero, 255 to NaN)."""
    values = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn).astype(dtype)
    scale = e8m0_scale(scales).astype(dtype)            # powers of two: exact in bf16
    rows, cols = values.shape
    blocked = values.reshape(rows // MX_BLOCK, MX_BLOCK, cols) * scale[:, None, :]
    return blocked.reshape(rows, cols)


def fp8_group_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, as_codes: bool = True
                     ) -> jax.Array:
    """x [B, G] bf16 @ FP8 codes (uint8 [G, N], float8_e4m3fn bytes) whose rows share the
    ``scale`` [1, N] (f32, ``e8m0_scale`` of the E8M0 byte: a matrix's scales are decoded once,
    a one-row decode costing whole vector registers) -> f32 [B, N]: one mixed bf16 x fp8 dot
    (the codes reach the MXU as they are; `as_codes` False: converted to bf16 first, where the
    MXU takes no FP8 operand), the power-of-two scale applied to the partial product rather
    than to every value.

    Measured from libtpu's output (benchmarks/fp8_feed_probe.py): TPU7x pushes the codes into
    its MXUs as f8e4m3 with no vector work on them; v6e and v5e convert them inside the push
    (bias-11 reinterpretation, the result multiplied by 16) with about three VPU operations a
    weight register, against about thirty for converting to bf16 first. On a CPU (interpret
    mode) XLA multiplies both operands as f32, which `mixed_fp8` in
    ``mkc.reference.rounding`` follows."""
    w = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    w = w if as_codes else w.astype(jnp.bfloat16)
    return jnp.dot(x, w, preferred_element_type=F32) * scale


def block_scales(scales: jax.Array, groups: int, width: int) -> jax.Array:
    """`fp8 block R x C` scales as a slot holds them (uint8 [4 * G', n]: the little-endian bytes
    of f32 scales [G', n], G' >= `groups` rounded up to whole tiles) -> f32 [groups, n * width]:
    each row group's scales, the one of output column group j repeated over its `width`
    columns, the row a group's partial product is multiplied by (`fp8_group_matmul`'s
    `scale`). Decoded once per matrix: the bytes joined into words and reinterpreted (exact),
    each scale broadcast across its columns' lanes."""
    from jax.experimental.pallas import tpu as pltpu
    words = pltpu.bitcast(scales, jnp.uint32)                              # [G', n]
    f32 = lax.bitcast_convert_type(words, F32)[:groups]
    cols = [jnp.broadcast_to(f32[:, j:j + 1], (groups, width)) for j in range(f32.shape[1])]
    return cols[0] if len(cols) == 1 else jnp.concatenate(cols, axis=1)


def bf16_block_scales(scales: jax.Array) -> jax.Array:
    """`scale bf16` scales as a slot holds them (uint8 [2 G, n]: every scale's low byte, then
    every high byte; ``weights.pack_bf16_scales``) -> f32 [G, n], the rows a pack group's partial
    product is multiplied by. Decoded once per matrix: each byte widened and moved to where an
    f32 keeps a bf16's bits (exact)."""
    g = scales.shape[0] // 2
    bits = (scales[g:].astype(jnp.uint32) << 24) | (scales[:g].astype(jnp.uint32) << 16)
    return lax.bitcast_convert_type(bits, F32)


def fp4_group_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array) -> jax.Array:
    """x [B, G] bf16 @ FP4 codes (uint8 [G/2, N]: byte row a holds input row 2a in its low
    nibble and 2a + 1 in its high one, the e2m1 bits of ``jnp.float4_e2m1fn``) whose rows share
    the ``scale`` [1, N] (f32, ``e8m0_scale`` of the E8M0 byte, as for ``fp8_group_matmul``)
    -> f32 [B, N]: one mixed bf16 x fp4 dot, the codes reinterpreted
    where they sit (``pltpu.bitcast`` unpacks the byte rows' nibbles into consecutive rows), the
    power-of-two scale applied to the partial product.

    Measured (benchmarks/format_probe.py): libtpu compiles it for tpu7x only, converting the
    codes to e4m3 and pushing them as FP8; v6e and older refuse an fp4 operand. On a CPU
    (interpret mode) XLA multiplies both operands as f32, which the reference's emulation
    follows (``mkc.reference.rounding``, operands "mixed_fp4")."""
    from jax.experimental.pallas import tpu as pltpu
    w = pltpu.bitcast(codes, jnp.float4_e2m1fn)
    return jnp.dot(x, w, preferred_element_type=F32) * scale


def int4_dot(x: jax.Array, codes: jax.Array) -> jax.Array:
    """x [B, R] bf16 @ int4 codes (uint8 [R/2, N]: byte row a holds input row 2a in its low
    nibble, 2a + 1 in its high one, two's complement) -> f32 [B, N]: the codes reinterpreted
    where they sit (``pltpu.bitcast`` unpacks the nibbles into consecutive rows), converted to
    bf16 (their integers -8..7, exact) and multiplied in one bf16 dot; the caller multiplies
    the partial product by the block's scale (``bf16_block_scales``)."""
    from jax.experimental.pallas import tpu as pltpu
    w = pltpu.bitcast(codes, jnp.int4).astype(jnp.bfloat16)
    return jnp.dot(x, w, preferred_element_type=F32)


def nvfp4_values(codes: jax.Array, scales: jax.Array) -> jax.Array:
    """One pack group of NVFP4 -> bf16 [G, N]: codes uint8 [G/2, N] (the checkpoint's e2m1
    nibbles, row 2a low, 2a + 1 high), scales uint8 [G/16, N] (e4m3 bytes, one per 16 rows).
    e2m1 x e4m3 holds at most 6 significant bits in bf16's exponent range: exact."""
    from jax.experimental.pallas import tpu as pltpu
    values = pltpu.bitcast(codes, jnp.float4_e2m1fn).astype(jnp.bfloat16)
    scale = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(jnp.bfloat16)
    rows, cols = values.shape
    blocked = values.reshape(rows // NVFP4_BLOCK, NVFP4_BLOCK, cols) * scale[:, None, :]
    return blocked.reshape(rows, cols)


def nvfp4_global_scale(stored: jax.Array) -> jax.Array:
    """An nvfp4 slot's `GLOBAL_SCALE_ROWS` byte rows (uint8 [4, N], the little-endian bytes of
    each column's f32 global scale) -> f32 [1, N], joined by shifts (exact)."""
    b = stored.astype(jnp.uint32)
    bits = (b[3:4] << 24) | (b[2:3] << 16) | (b[1:2] << 8) | b[0:1]
    return lax.bitcast_convert_type(bits, F32)


def block_diagonal(x: jax.Array, block: int) -> jax.Array:
    """x [B, G] -> bf16 [B * G/block, G]: row b * (G/block) + j is x's row b masked to its
    inputs j * block .. (j + 1) * block - 1 (one dot of it gives every block's partial product
    of every row). Built by row broadcasts and a mask (no reshape across sublanes)."""
    rows, width = x.shape
    nb = width // block
    r = lax.broadcasted_iota(jnp.int32, (nb, width), 0)
    c = lax.broadcasted_iota(jnp.int32, (nb, width), 1) // block
    xf = x.astype(F32)
    return jnp.concatenate([jnp.where(r == c, jnp.broadcast_to(xf[b:b + 1], (nb, width)), 0.0)
                            for b in range(rows)], axis=0).astype(jnp.bfloat16)


def nvfp4_codes_matmul(x: jax.Array, codes: jax.Array, scales: jax.Array) -> jax.Array:
    """x [B, G] bf16 @ one pack group of NVFP4 -> f32 [B, N], the e2m1 codes (uint8 [G/2, N])
    fed to the MXU as they are: one dot of the block-diagonal input (`block_diagonal`, 16-row
    blocks) gives each block's partial product of each row, which is multiplied by the block's
    e4m3 scale (uint8 [G/16, N]) and summed over the blocks. Cheaper than decoding the values
    at up to `NVFP4_CODES_ROWS` rows (measured: its comment)."""
    from jax.experimental.pallas import tpu as pltpu
    scale = lax.bitcast_convert_type(scales, jnp.float8_e4m3fn).astype(F32)       # [nb, N]
    nb = scale.shape[0]
    w = pltpu.bitcast(codes, jnp.float4_e2m1fn)
    res = jnp.dot(block_diagonal(x, NVFP4_BLOCK), w, preferred_element_type=F32)     # [B * nb, N]
    return jnp.concatenate([jnp.sum(res[b * nb:(b + 1) * nb] * scale, axis=0, keepdims=True)
                            for b in range(x.shape[0])], axis=0)
