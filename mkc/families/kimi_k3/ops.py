"""Compute bodies for the Kimi K3 family, as functions over in-kernel values.

Generated Kimi kernels call these between the DMAs mkc schedules; nothing here touches a
semaphore or decides when memory moves. Everything computes in f32 on 2-D values ([rows,
lanes]) with only ops Mosaic lowers: no ``lax.top_k``, ``cumsum``, outer-product dots, vector
gathers or lane reshapes that split a 128-lane vreg. The math is that of
``mkc.families.kimi_k3.reference`` (KDA, NoPE gated MLA, latent MoE with sigmoid routing, SiTU, block
attention residuals).

Three weights are streamed in a kernel layout of their own; the numpy packers at the end of
this module build it from checkpoint tensors at load time:

* MLA runs weight-absorbed. ``q_b_proj`` is split into ``[q_lora, heads * nope]`` and
  ``[q_lora, heads * extra]`` (``split_q_b_proj``) so both query parts come out as flat rows,
  and ``kv_b_proj`` into ``w_uk [heads * nope, R]`` and ``w_uv [R, heads * v]``
  (``split_kv_b_proj``). Each per-head product then becomes one 2-D matmul against a
  block-diagonal operand built with an iota mask, with no in-kernel reshape of head rows.
* MXFP4 experts are stored K-major like every mkc weight tile (``[in, out]``, so the MX blocks
  of 32 run down the rows): ``codes [in/2, out]``, each pack group of ``group`` input rows as
  uint32 words whose bits sit where a shift and a mask put them into bf16s (``MXFP4_LAYOUT``),
  and ``scales [in/32, out]`` (``pack_mxfp4_for_kernel``).
* KDA's per-head ``A_log`` is repeated over each head's key channels (``expand_a_log``).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mkc.layers.ops import l2_normalize, rms_norm  # noqa: F401  (KimiRMSNorm: a plain weight)
from mkc.runtime import experts

F32 = jnp.float32
MX_BLOCK = 32      # values per E8M0 scale
MX_SCALE_NAN = 255


# ---------------------------------------------------------------------------------------------
# Norms and activations


def situ(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """SiTU GLU: beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta); any equal shapes."""
    return (beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
            * linear_beta * jnp.tanh(up / linear_beta))


def situ_packed(gate_up: jax.Array, width: int, beta: float = 4.0,
                linear_beta: float = 25.0) -> jax.Array:
    """gate_up [B, 2*width] packed as [gate | up] (one fused projection) -> SiTU [B, width]."""
    return situ(gate_up[:, :width], gate_up[:, width:2 * width], beta, linear_beta)


# ---------------------------------------------------------------------------------------------
# KDA (Kimi delta attention), one token


def kda_decay(gate: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float) -> jax.Array:
    """Per-key-channel log decay a = lower_bound * sigmoid(exp(A_log) * (gate + dt_bias)) <= 0.

    gate [B, H*Dk] is the ``f_b_proj`` output; a_log [1, H*Dk] is ``A_log`` repeated over each
    head's channels (``expand_a_log``); dt_bias [1, H*Dk]. Head h owns lanes [h*Dk, (h+1)*Dk).
    """
    return lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * (gate + dt_bias))


def kda_head_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                  decay: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the KDA delta rule for one head and one batch row -> (o [1, Dv], state).

    state [Dk, Dv] f32 (key axis first, the cache layout); q, k [1, Dk] (l2-normalised, q
    scaled by Dk**-0.5); v [1, Dv]; decay [1, Dk] log-decay; beta [1, 1].
    S = diag(exp(decay)) S; S += k^T (beta (v - k S)); o = q S.
    """
    # Rows of S are key channels, so per-channel factors act as [Dk, 1] columns: a transposed
    # [1, Dk] row lowers, and a rank-1 update is a column times a row (no outer-product dot).
    state = state * jnp.transpose(jnp.exp(decay))
    predicted = jnp.dot(k, state, preferred_element_type=F32)            # [1, Dv]
    delta = (v - predicted) * beta
    state = state + jnp.transpose(k) * delta
    return jnp.dot(q, state, preferred_element_type=F32), state


def kda_gated_output(o: jax.Array, g: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """KDA head output before o_proj: rms(o, o_norm) * sigmoid(g_proj(x)); o, g, w [1, Dv]."""
    return rms_norm(o, w, eps) * jax.nn.sigmoid(g)


# ---------------------------------------------------------------------------------------------
# MLA, weight-absorbed decode over streamed latent tiles (one batch row)


def _head_blocks(num_heads: int, head_dim: int) -> jax.Array:
    """[num_heads, num_heads * head_dim] mask: lane l belongs to head row l // head_dim."""
    shape = (num_heads, num_heads * head_dim)
    # lax.div, not //: jnp's floor division emits lax.sign, whose Mosaic rule needs a live TPU.
    return (lax.div(lax.broadcasted_iota(jnp.int32, shape, 1), jnp.int32(head_dim))
            == lax.broadcasted_iota(jnp.int32, shape, 0))


def mla_absorb_query(q_nope: jax.Array, q_extra: jax.Array, w_uk: jax.Array,
                     num_heads: int) -> tuple[jax.Array, jax.Array]:
    """Absorb the key up-projection into the query -> (q_lat [nh, R], q_extra [nh, extra]).

    q_nope [1, nh*nope] and q_extra [1, nh*extra] are one row's flat query parts (from
    ``split_q_b_proj``); w_uk [nh*nope, R] (``split_kv_b_proj``; bf16 or f32). Head h's absorbed
    query q_nope_h @ W_uk[h] is row h of one matmul: the flat row broadcast to nh rows and masked
    to head h's lanes (block-diagonal), times w_uk: the zero blocks add MXU rows, not weight passes.
    """
    nope = q_nope.shape[1] // num_heads
    extra = q_extra.shape[1] // num_heads
    blocks = jnp.where(_head_blocks(num_heads, nope),
                       jnp.broadcast_to(q_nope, (num_heads, num_heads * nope)), 0.0)
    q_lat = jnp.dot(blocks, w_uk.astype(F32), preferred_element_type=F32)
    # [1, nh*64] -> [nh, 64] is a lane-splitting reshape Mosaic rejects; stacking static lane
    # slices lowers and is exact.
    q_ext = jnp.concatenate([q_extra[:, h * extra:(h + 1) * extra] for h in range(num_heads)], axis=0)
    return q_lat, q_ext


def mla_tile(q_lat: jax.Array, q_extra: jax.Array, latent: jax.Array, extra: jax.Array,
             visible: jax.Array, m: jax.Array, denom: jax.Array, acc: jax.Array, scale: float
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax update with one tile of T cached latents -> (m, denom, acc).

    q_lat [nh, R], q_extra [nh, extra] from ``mla_absorb_query``; latent [T, R] (the normed
    ``c`` part of the cache rows) and extra [T, extra] (the shared extra key), bf16 or f32;
    visible [1, T] bool; running max m and denominator [nh, 1]; acc [nh, R] accumulates the
    probability-weighted latents (values are up-projected once, in ``mla_value_up``). Start
    from m = -inf, denom = acc = 0; a fully masked tile leaves the state unchanged.
    """
    nt = (((1,), (1,)), ((), ()))
    latent = latent.astype(F32)
    s = (lax.dot_general(q_lat, latent, nt, preferred_element_type=F32)
         + lax.dot_general(q_extra, extra.astype(F32), nt, preferred_element_type=F32)) * scale
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    # While nothing is visible yet m_new is -inf; shifting by 0 then keeps exp() NaN-free.
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - shift)
    p = jnp.exp(s - shift)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = alpha * acc + jnp.dot(p, latent, preferred_element_type=F32)
    return m_new, denom_new, acc_new


def mla_value_up(acc: jax.Array, denom: jax.Array, w_uv: jax.Array, num_heads: int) -> jax.Array:
    """Attention output [1, nh*v] (head-major, o_proj's input order) from the final tile state.

    acc [nh, R], denom [nh, 1]; w_uv [R, nh*v] (``split_kv_b_proj``). Row h of the full product
    holds every head's up-projection of head h's latent average; the block diagonal is the
    answer, kept by a mask and summed down the rows (adding zeros, so exact).
    """
    full = jnp.dot(acc / denom, w_uv.astype(F32), preferred_element_type=F32)   # [nh, nh*v]
    v_dim = w_uv.shape[1] // num_heads
    return jnp.sum(jnp.where(_head_blocks(num_heads, v_dim), full, 0.0), axis=0, keepdims=True)


# ---------------------------------------------------------------------------------------------
# MoE routing


def route(logits: jax.Array, bias: jax.Array, top_k: int,
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Sigmoid top-k routing per row -> (weights [B, E], ids [B, top_k] int32).

    logits [B, E] f32, bias [1, E] (``e_score_correction_bias``, used only to pick). weights is
    zero except at the chosen experts, where it holds the sigmoid scores renormalised over the
    chosen and times ``scaling`` (``routed_scaling_factor``). ids lists the picks best first,
    ties to the lowest index (``mkc.runtime.experts.top_k``). DMAs need scalar ids in SMEM: store
    ``mkc.runtime.experts.expert_id(ids, b, j)`` into an SMEM ref; ``expert_weight`` there
    reads a dynamic expert's column.
    """
    scores = jax.nn.sigmoid(logits)
    kept, ids = experts.top_k(scores + bias, scores, top_k)
    return kept / jnp.sum(kept, axis=-1, keepdims=True) * scaling, ids


# ---------------------------------------------------------------------------------------------
# MXFP4 expert tiles


# The kernel layout of MXFP4 codes (`pack_mxfp4_for_kernel`): a pack group of G input rows is
# G/8 little-endian uint32 words a column, 8 codes a word. Its rows are four quarters of G/4;
# row 2a + h of quarter q sits in word a, at the bits MXFP4_LAYOUT[q] gives (sign, then the
# three magnitude bits high to low) plus 16 h. Each quarter comes out of the word with one
# mask after a shift (q 0..2) or a shift, mask and multiply (q 3: one copy of its bits per
# term of the multiplier, no two overlapping), already where a bf16 keeps them: the sign at
# bit 15 (31), the magnitude at bits 8..6 (24..22), the bottom of the exponent and the top of
# the mantissa. The magnitude is stored re-coded so that adding the block's exponent bias
# makes the value: c = 0 is 0.5, c = 1 zero, c = 2..7 are 1, 1.5, 2, 3, 4, 6 (the e2m1 code).
MXFP4_LAYOUT = ((15, 8, 7, 6), (12, 5, 4, 3), (9, 2, 1, 0), (11, 10, 14, 13))
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
    return jnp.where(s == MX_SCALE_NAN, F32(jnp.nan), scale)


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


def feeds_codes(fmt) -> bool:
    """Whether a matrix stored in `fmt` (an ``mkc.ir.WeightFormat``) reaches the MXU as FP8
    codes: FP8 with one scale per pack group's partial product (a block past 32 rows) on a
    target whose MXU takes FP8 operands. The lowering and the reference's emulation both ask."""
    return fmt.name == "fp8" and fmt.block > MX_BLOCK and fmt.fp8_operand


# ---------------------------------------------------------------------------------------------
# Block attention residuals


def residual_mix(sources: Sequence[jax.Array], count: jax.Array | int, norm_w: jax.Array,
                 proj_w: jax.Array, eps: float) -> jax.Array:
    """Softmax mixture of the first ``count`` (a traced scalar) of the residual ``sources``
    ([B, H] f32 blocks: completed block sums, then the partial sum) -> [B, H], with score_i =
    proj . rms(v_i, norm); norm_w, proj_w [1, H]. The other sources are masked out before they
    can touch the result (they may hold stale memory)."""
    scores = [jnp.where(i < count, jnp.sum(rms_norm(v, norm_w, eps) * proj_w, axis=-1, keepdims=True),
                        -jnp.inf) for i, v in enumerate(sources)]
    top = scores[0]
    for sc in scores[1:]:
        top = jnp.maximum(top, sc)
    exps = [jnp.exp(sc - top) for sc in scores]
    total = sum(exps[1:], exps[0])
    mixed = jnp.zeros_like(sources[0])
    for i, (e, v) in enumerate(zip(exps, sources)):
        mixed = mixed + jnp.where(i < count, (e / total) * v, 0.0)
    return mixed


# ---------------------------------------------------------------------------------------------
# Host-side packing (numpy, at weight-load time)


def expand_a_log(a_log: np.ndarray, head_dim: int) -> np.ndarray:
    """KDA ``A_log`` [H] -> [1, H*head_dim] f32, each head's value over its key channels."""
    return np.repeat(np.asarray(a_log, np.float32), head_dim)[None, :]


def _heads(w: np.ndarray, num_heads: int, heads: Sequence[int] | None) -> np.ndarray:
    """PyTorch [num_heads * per_head, in] -> [len(heads), per_head, in]."""
    w = np.asarray(w).reshape(num_heads, -1, np.asarray(w).shape[-1])
    return w if heads is None else w[list(heads)]


def split_q_b_proj(w: np.ndarray, num_heads: int, nope_dim: int,
                   heads: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``q_b_proj.weight`` [num_heads*(nope+extra), q_lora] -> K-major (w_q_nope
    [q_lora, nh*nope], w_q_extra [q_lora, nh*extra]) for the selected heads (a rank's share)."""
    w = _heads(w, num_heads, heads)
    nh = w.shape[0]
    return (w[:, :nope_dim].reshape(nh * nope_dim, -1).T.copy(),
            w[:, nope_dim:].reshape(nh * (w.shape[1] - nope_dim), -1).T.copy())


def split_kv_b_proj(w: np.ndarray, num_heads: int, nope_dim: int,
                    heads: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``kv_b_proj.weight`` [num_heads*(nope+v), R] -> (w_uk [nh*nope, R], w_uv [R, nh*v]):
    the layouts ``mla_absorb_query`` and ``mla_value_up`` multiply by, for the selected heads."""
    w = _heads(w, num_heads, heads)
    nh, v_dim = w.shape[0], w.shape[1] - nope_dim
    return (w[:, :nope_dim].reshape(nh * nope_dim, -1).copy(),
            w[:, nope_dim:].reshape(nh * v_dim, -1).T.copy())


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
    nan = scales == MX_SCALE_NAN
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
    if (scales == MX_SCALE_NAN).any():
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
