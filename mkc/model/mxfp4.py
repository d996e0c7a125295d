"""MXFP4 weight codec (OCP Microscaling FP4): e2m1 element codes and one E8M0 scale per 32 values.

Layout, as the Kimi K3 checkpoint ships its routed experts (``weight_packed`` / ``weight_scale``):

* a weight of logical shape ``[..., K]`` is blocked along its last (input / contraction) axis
  into ``K // 32`` blocks of 32 consecutive values;
* ``codes`` is uint8 ``[..., K // 2]``: element ``2j`` sits in the low nibble of byte ``j`` and
  element ``2j + 1`` in its high nibble (a little-endian u32 view then holds 8 elements, lowest
  index in the lowest bits, which is what kernels that reinterpret the bytes as ``u32`` rely on);
* a 4-bit code is ``s e e m``: bit 3 is the sign, bits 0-2 index the magnitudes
  ``0, 0.5, 1, 1.5, 2, 3, 4, 6`` (1 sign, 2 exponent, 1 mantissa bit, exponent bias 1);
* ``scales`` is uint8 ``[..., K // 32]``, an E8M0 exponent: the block's values are
  ``e2m1(code) * 2**(scale - 127)``; 255 encodes NaN.

``mxfp4_quantize`` picks, per block, the smallest power-of-two scale that keeps the block's
largest magnitude within the e2m1 range (|x| <= 6 * scale), then rounds each value to the
nearest e2m1 value, ties to the even code. The OCP reference recipe instead takes
``floor(log2(amax)) - 2`` and saturates, which can clip magnitudes in (6, 8) * 2**k; the two agree
on every block of already representable values, so dequantize -> quantize -> dequantize is exact.
Quantized scales stay in 1..254 (the normal range that checkpoint loaders accept).
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

BLOCK_SIZE = 32
SCALE_BIAS = 127
SCALE_NAN = 255
# The largest scale under which every e2m1 value (6 at most) is finite in bf16 and f32: 253 and
# 254 put 6 * 2**126 past them; the checkpoint loader refuses a stored scale above it.
SCALE_LARGEST = 252

# Value of each 4-bit code; index 8 is -0.0, which dequantizes equal to +0.0.
E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], np.float32)
E2M1_MAX = 6.0
E2M1_MAGNITUDES = E2M1_VALUES[:8].astype(np.float64)      # the codes 0-7: value of each
_MIDPOINTS = (E2M1_MAGNITUDES[1:] + E2M1_MAGNITUDES[:-1]) / 2  # rounding boundaries between neighbours


def nearest_e2m1(y: np.ndarray) -> np.ndarray:
    """Magnitudes `y` (at most `E2M1_MAX`) -> the code 0-7 of the nearest e2m1 magnitude, a
    tie to the even code (mantissa bit 0)."""
    lo = np.searchsorted(_MIDPOINTS, y, side="left")
    hi = np.searchsorted(_MIDPOINTS, y, side="right")
    # lo != hi exactly on a midpoint: take the neighbour with the even code.
    return np.where((hi != lo) & (lo % 2 == 1), hi, lo)


def _check_layout(codes_shape: tuple[int, ...], scales_shape: tuple[int, ...],
                  shape: tuple[int, ...]) -> None:
    if not shape or shape[-1] % BLOCK_SIZE:
        raise ValueError(f"the last axis of {shape} must be a positive multiple of {BLOCK_SIZE}")
    want_codes = (*shape[:-1], shape[-1] // 2)
    want_scales = (*shape[:-1], shape[-1] // BLOCK_SIZE)
    if tuple(codes_shape) != want_codes or tuple(scales_shape) != want_scales:
        raise ValueError(f"MXFP4 weight of shape {shape} needs codes {want_codes} and scales "
                         f"{want_scales}, got {tuple(codes_shape)} and {tuple(scales_shape)}")


def mxfp4_quantize(w: np.ndarray, block: int = BLOCK_SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Encode a float array ``[..., K]`` (K a multiple of ``block``, 32 for MXFP4) as (codes
    uint8 ``[..., K/2]``, scales uint8 ``[..., K/block]``). Raises on non-finite input."""
    w = np.asarray(w)
    if w.ndim == 0 or w.shape[-1] % block or w.shape[-1] == 0 or block % 2:
        raise ValueError(f"the last axis of {w.shape} must be a positive multiple of {block}")
    if not np.all(np.isfinite(w)):
        raise ValueError("cannot quantize non-finite values to MXFP4")
    x = w.astype(np.float64).reshape(*w.shape[:-1], w.shape[-1] // block, block)

    # Smallest s with amax <= 6 * 2**s, exactly: with amax = m * 2**e (m in [0.5, 1)),
    # 6 * 2**s >= amax  <=>  s - e >= log2(m / 6), i.e. s = e - 3 when m <= 0.75 else e - 2.
    amax = np.max(np.abs(x), axis=-1)
    mant, exp = np.frexp(amax)
    shared = np.where(amax == 0, 0, exp - np.where(mant <= 0.75, 3, 2))
    scales = np.clip(shared + SCALE_BIAS, 1, SCALE_NAN - 1)

    y = np.ldexp(np.abs(x), -(scales.astype(np.int64) - SCALE_BIAS)[..., None])
    y = np.minimum(y, E2M1_MAX)  # only bites when the scale was clamped at its maximum
    magnitude = nearest_e2m1(y)
    codes = magnitude + np.where((x < 0) & (magnitude > 0), 8, 0)  # no -0: zero is code 0
    codes = codes.reshape(w.shape).astype(np.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.astype(np.uint8), scales.astype(np.uint8)


def mxfp4_dequantize(codes: np.ndarray, scales: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Decode (codes, scales) to float32 of logical ``shape``. Exact: each value is a 3-bit
    significand times a power of two, representable down to the subnormal 2**-128; scale 255
    gives NaN, and products above the float32 range (scale 254 with |e2m1| >= 2) inf."""
    codes, scales, shape = np.asarray(codes), np.asarray(scales), tuple(shape)
    if codes.dtype != np.uint8 or scales.dtype != np.uint8:
        raise ValueError(f"codes and scales must be uint8, got {codes.dtype} and {scales.dtype}")
    _check_layout(codes.shape, scales.shape, shape)
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(shape)
    values = E2M1_VALUES[nibbles].reshape(*shape[:-1], shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    exponent = np.minimum(scales, SCALE_NAN - 1).astype(np.int32) - SCALE_BIAS
    scale = np.where(scales == SCALE_NAN, np.float32(np.nan), np.ldexp(np.float32(1.0), exponent))
    with np.errstate(over="ignore"):
        return (values * scale.astype(np.float32)[..., None]).reshape(shape)


def mxfp4_dequantize_jax(codes: jax.Array, scales: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """In-graph twin of :func:`mxfp4_dequantize` (jit-able, any leading axes).

    The scale is built from its bits (``scale << 23``), so it is exact for 1..254; scale 0
    (2**-127) and subnormal products may be flushed to zero on backends that flush denormals.
    """
    shape = tuple(shape)
    _check_layout(codes.shape, scales.shape, shape)
    codes = jnp.asarray(codes, jnp.uint8)
    nibbles = jnp.stack([codes & 0xF, codes >> 4], axis=-1).reshape(shape)
    values = jnp.asarray(E2M1_VALUES)[nibbles.astype(jnp.int32)]
    exponent = jnp.asarray(scales).astype(jnp.int32)
    scale = jax.lax.bitcast_convert_type(exponent << 23, jnp.float32)
    scale = jnp.where(exponent == 0, jnp.float32(2.0 ** -SCALE_BIAS), scale)
    scale = jnp.where(exponent == SCALE_NAN, jnp.float32(jnp.nan), scale)
    blocked = values.reshape(*shape[:-1], shape[-1] // BLOCK_SIZE, BLOCK_SIZE)
    return (blocked * scale[..., None]).reshape(shape)


# ---- requantization to one scale per larger block (`format CLASS fp4 block N`) --------------

@dataclass(frozen=True)
class Requantized:
    """MXFP4 values (a scale per 32) requantized to e2m1 codes under one scale per ``block``
    values along the last axis, and how far they moved.

    ``codes`` keep the checkpoint's layout (``[..., K/2]``, element 2j in the low nibble;
    FP8: the bytes of e4m3 values); ``scales`` hold one scale per block (``[..., K/block]``):
    an E8M0 byte, or with ``scale`` "bf16" a bf16 value (as f32). The checkpoint's values are
    read as the kernel's MXFP4 decode reads them (a 32-value scale of 0, 2**-127 and itself
    subnormal, is zero)."""

    codes: np.ndarray
    scales: np.ndarray
    block: int
    values: int            # values compared
    changed: int           # values the requantization moved
    blocks: int
    inexact_blocks: int
    max_abs: float         # largest |requantized - checkpoint|
    sq_err: float          # sum of squared errors
    sq_ref: float          # sum of the checkpoint's squared values
    first: tuple[int, ...] | None = None     # index (leading axes, then block) of the first inexact block
    first_scales: tuple[int, int] = (0, 0)   # its 32-value scales, smallest and largest
    scale: str = "e8m0"                      # how a block's scale is stored (`mkc.ir.BLOCK_SCALES`)

    @property
    def exact(self) -> bool:
        return self.changed == 0

    def scale_values(self) -> np.ndarray:
        """Each block's scale as a value, f64 ``[..., K/block]``."""
        if self.scale == "bf16":
            return self.scales.astype(np.float64)
        return np.ldexp(1.0, self.scales.astype(np.int64) - SCALE_BIAS)

    def scales_per_32(self) -> np.ndarray:
        """The block scales repeated per 32 values: the requantized values as MXFP4 (E8M0
        block scales only: a bf16 scale is no MXFP4 scale)."""
        if self.scale != "e8m0":
            raise ValueError(f"{self.scale} block scales are not MXFP4 scales")
        return np.repeat(self.scales, self.block // BLOCK_SIZE, axis=-1)


# The bf16 search (`scale bf16`, `mkc.ir.BLOCK_SCALES`): the E8M0 scale, and bf16 scales from
# SEARCH_LOW to 1 times the smallest bf16 one holding the largest magnitude (larger values then
# clipped to the code's largest).
SEARCH_LOW, SEARCH_STEPS = 0.8, 16


def _bf16(x: np.ndarray) -> np.ndarray:
    import ml_dtypes
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _holding_bf16(s: np.ndarray) -> np.ndarray:
    """The smallest bf16 value at least ``s`` (positive)."""
    import ml_dtypes
    held = np.asarray(s, np.float64).astype(ml_dtypes.bfloat16)
    up = (held.view(np.uint16) + 1).view(ml_dtypes.bfloat16)
    return np.where(held.astype(np.float64) < s, up.astype(np.float64), held.astype(np.float64))


def searched_bf16_scales(blocked: np.ndarray, largest: float, code) -> tuple[np.ndarray, np.ndarray]:
    """Values ``[..., n, block]`` -> (their codes' values under one bf16 scale a block, f64
    ``[..., n, block]``; the scales, f64 ``[..., n]``, each a bf16 value). A block's scale is,
    of the smallest power of two holding its largest magnitude (``largest`` times it) and the
    bf16 values from SEARCH_LOW to 1 times the smallest bf16 one holding it, the one whose codes
    (``code``: the ml_dtypes type, rounding to nearest, ties to even, after clipping to
    +-``largest``) are nearest in squared error, the earlier on a tie: the power of two first,
    so a block it holds exactly stays as it was. An all-zero block takes scale 1. Every scale is
    within E8M0's normal range, 2**-126 .. 2**127 (a TPU flushes a subnormal scale to zero)."""
    top = np.abs(blocked).max(axis=-1)
    safe = np.where(top > 0, top / largest, 1.0)
    tiny, huge = np.ldexp(1.0, 1 - SCALE_BIAS), np.ldexp(1.0, SCALE_NAN - 1 - SCALE_BIAS)

    def under(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        q = np.clip(blocked / s[..., None], -largest, largest).astype(code).astype(np.float64)
        return q, np.sum((q * s[..., None] - blocked) ** 2, axis=-1)

    power = np.exp2(np.ceil(np.log2(safe)))
    scales = np.clip(np.where(power * largest < top, 2 * power, power), tiny, huge)
    codes, err = under(scales)
    holding = _holding_bf16(safe)
    for f in np.linspace(SEARCH_LOW, 1.0, SEARCH_STEPS):
        s = _bf16(holding * f)
        s = np.where((s >= tiny) & (s <= huge), s, scales)
        q, e = under(s)
        better = e < err
        codes = np.where(better[..., None], q, codes)
        scales, err = np.where(better, s, scales), np.minimum(e, err)
    return codes, scales


def e2m1_codes(values: np.ndarray) -> np.ndarray:
    """e2m1 values ``[..., K]`` -> their codes packed as MXFP4 packs them (``[..., K/2]``, value
    2j in the low nibble), -0 as +0."""
    v = np.asarray(values, np.float64)
    magnitude = np.searchsorted(E2M1_MAGNITUDES, np.abs(v))
    if not np.array_equal(E2M1_MAGNITUDES[np.minimum(magnitude, 7)], np.abs(v)):
        raise ValueError("a value that is not an e2m1 value has no e2m1 code")
    codes = (magnitude + np.where((v < 0) & (magnitude > 0), 8, 0)).astype(np.uint8)
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).astype(np.uint8)


def requantize_blocks(codes: np.ndarray, scales: np.ndarray, block: int, scale: str = "e8m0"
                      ) -> Requantized:
    """MXFP4 ``codes [..., K/2]`` and ``scales [..., K/32]`` -> e2m1 codes with one scale per
    ``block`` values (a multiple of 32 dividing K). E8M0: each block takes the smallest scale
    that holds its largest magnitude (|v| <= 6 * scale, so nothing overflows) and every value
    is rounded to the nearest e2m1 value under it, ties to the even code (``mxfp4_quantize``
    over the block). Exact where every value of a block is an e2m1 value times that scale:
    always where the block's 32-value scales are equal; a 32-value block k octaves below the
    block's scale keeps only the values whose codes are multiples of 2**k (one octave: 0, 1,
    2, 3, 4 and 6 halve exactly, 0.5 and 1.5 do not). ``scale`` "bf16": a bf16 scale a block,
    searched (``searched_bf16_scales``; never further from the values than E8M0's, and exact
    where it is). A scale of 255 (NaN) is refused."""
    codes, scales = np.asarray(codes, np.uint8), np.asarray(scales, np.uint8)
    k = 2 * codes.shape[-1]
    if block % BLOCK_SIZE or k % block or block <= 0:
        raise ValueError(f"a block of {block} values does not tile {k} in {BLOCK_SIZE}s")
    if (scales == SCALE_NAN).any():
        raise ValueError("a scale of 255 (NaN) cannot be requantized")
    shape = (*codes.shape[:-1], k)
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(shape)
    per32 = np.where(scales == 0, 0.0, np.ldexp(1.0, scales.astype(np.int64) - SCALE_BIAS))
    values = (E2M1_VALUES[nibbles].astype(np.float64).reshape(*shape[:-1], k // BLOCK_SIZE, BLOCK_SIZE)
              * per32[..., None]).reshape(shape)
    if scale == "bf16":
        import ml_dtypes
        q, new_scales = searched_bf16_scales(values.reshape(*shape[:-1], k // block, block),
                                             E2M1_MAX, ml_dtypes.float4_e2m1fn)
        new_codes = e2m1_codes(q.reshape(shape))
        new = (q * new_scales[..., None]).reshape(shape)
        new_scales = new_scales.astype(np.float32)
    else:
        new_codes, new_scales = mxfp4_quantize(values, block)
        new_nibbles = np.stack([new_codes & 0xF, new_codes >> 4], axis=-1).reshape(shape)
        new = (E2M1_VALUES[new_nibbles].astype(np.float64).reshape(*shape[:-1], k // block, block)
               * np.ldexp(1.0, new_scales.astype(np.int64) - SCALE_BIAS)[..., None]).reshape(shape)
    err = np.abs(new - values)
    moved = (err != 0).reshape(*shape[:-1], k // block, block).any(axis=-1)
    first, spread = None, (0, 0)
    if moved.any():
        first = tuple(int(i) for i in np.argwhere(moved)[0])
        s32 = scales[first[:-1]].reshape(k // block, block // BLOCK_SIZE)[first[-1]]
        spread = (int(s32.min()), int(s32.max()))
    return Requantized(codes=new_codes, scales=new_scales, block=block, values=int(err.size),
                       changed=int(np.count_nonzero(err)), blocks=int(moved.size),
                       inexact_blocks=int(moved.sum()), max_abs=float(err.max(initial=0.0)),
                       sq_err=float(np.sum(err * err)), sq_ref=float(np.sum(values * values)),
                       first=first, first_scales=spread, scale=scale)


# ---- requantization of bf16 values to FP8 blocks (`format CLASS fp8 block N rounded`) --------
E4M3_MAX = 448.0      # float8_e4m3fn's largest finite value


def requantize_fp8_blocks(values: np.ndarray, block: int, scale: str = "e8m0") -> Requantized:
    """Values ``[..., K]`` (bf16 weights, as any float) -> FP8 e4m3 codes (``[..., K]``, the
    bytes of ``float8_e4m3fn`` values) under one scale per ``block`` values along the last
    axis (``[..., K/block]``), and how far they moved. E8M0: each block takes the smallest
    power-of-two scale that holds its largest magnitude (|v| <= 448 * scale, so nothing
    overflows), every value rounds to the nearest e4m3 value under it (ties to even; below
    2**-6 of the scale e4m3 is subnormal, below 2**-10 zero). An all-zero block takes scale
    1 (127). Scales are kept in 1..254; a non-finite value is refused (ValueError).
    ``scale`` "bf16": a bf16 scale a block, searched (``searched_bf16_scales``).

    Requantizing its own E8M0 result is exact: a block's largest value stays within its
    scale's range and every value is an e4m3 value times it."""
    import ml_dtypes
    v = np.asarray(values, np.float64)
    k = v.shape[-1]
    if block <= 0 or k % block:
        raise ValueError(f"a block of {block} values does not tile {k}")
    if not np.isfinite(v).all():
        raise ValueError("a value that is not finite cannot be requantized to FP8")
    blocked = v.reshape(*v.shape[:-1], k // block, block)
    top = np.abs(blocked).max(axis=-1)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(top / E4M3_MAX))
    e = np.where(top == 0, 0.0, e)
    # log2 of a quotient may land an ulp off a power of two: settle on the smallest that holds
    e = np.where(top > np.ldexp(E4M3_MAX, e.astype(np.int64)), e + 1, e)
    e = np.where((top > 0) & (top <= np.ldexp(E4M3_MAX, e.astype(np.int64) - 1)), e - 1, e)
    e = np.clip(e, 1 - SCALE_BIAS, SCALE_NAN - 1 - SCALE_BIAS).astype(np.int64)
    if scale == "bf16":
        q, scales = searched_bf16_scales(blocked, E4M3_MAX, ml_dtypes.float8_e4m3fn)
        codes, new = q.astype(ml_dtypes.float8_e4m3fn), q * scales[..., None]
        scales = scales.astype(np.float32)
    else:
        scaled = (blocked / np.ldexp(1.0, e)[..., None]).astype(np.float32)   # exact: a power of two
        codes = scaled.astype(ml_dtypes.float8_e4m3fn)
        new = codes.astype(np.float64) * np.ldexp(1.0, e)[..., None]
        scales = (e + SCALE_BIAS).astype(np.uint8)
    err = np.abs(new - blocked)
    moved = (err != 0).any(axis=-1)
    first = tuple(int(i) for i in np.argwhere(moved)[0]) if moved.any() else None
    shape = v.shape
    return Requantized(codes=codes.view(np.uint8).reshape(shape), scales=scales, block=block,
                       values=int(err.size), changed=int(np.count_nonzero(err)),
                       blocks=int(moved.size), inexact_blocks=int(moved.sum()),
                       max_abs=float(err.max(initial=0.0)), sq_err=float(np.sum(err * err)),
                       sq_ref=float(np.sum(blocked * blocked)), first=first, scale=scale)


def fp8_block_values(r: Requantized) -> np.ndarray:
    """The values a requantized FP8 result holds (codes times their block's scale), f64."""
    import ml_dtypes
    codes = r.codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    k = codes.shape[-1]
    return (codes.reshape(*codes.shape[:-1], k // r.block, r.block)
            * r.scale_values()[..., None]).reshape(codes.shape)


def relative_rms(sq_err: float, sq_ref: float) -> float:
    """Root of the squared error over the squared reference (0 for an all-zero reference)."""
    return (sq_err / sq_ref) ** 0.5 if sq_ref else 0.0


class RequantizationError:
    """A matrix class's requantization error summed over its matrices (`add` each
    ``Requantized``), reported as `mkc compile` and the module's `requantized_weights` give it:
    values, changed, blocks, inexact blocks, max abs error, relative RMS error against the
    checkpoint's values."""

    def __init__(self) -> None:
        self.values = self.changed = self.blocks = self.inexact_blocks = 0
        self.max_abs = self.sq_err = self.sq_ref = 0.0

    def add(self, r: Requantized) -> None:
        self.values += r.values
        self.changed += r.changed
        self.blocks += r.blocks
        self.inexact_blocks += r.inexact_blocks
        self.max_abs = max(self.max_abs, r.max_abs)
        self.sq_err += r.sq_err
        self.sq_ref += r.sq_ref

    @property
    def relative_rms(self) -> float:
        return relative_rms(self.sq_err, self.sq_ref)

    def report(self, spelled: str) -> dict:
        return {"format": spelled, "values": self.values, "changed": self.changed,
                "blocks": self.blocks, "inexact_blocks": self.inexact_blocks,
                "exact": self.changed == 0, "max_abs_error": self.max_abs,
                "relative_rms_error": self.relative_rms}
