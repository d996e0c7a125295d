"""The kernel-side math the layer kinds share: norms, activations, rotary embedding and the
online-softmax attention tile, as functions over in-kernel values.

Compute bodies (`mkc.layers.<kind>.lowering` and the families' own) call these between the
DMAs mkc schedules; nothing here touches a semaphore or decides when memory moves. Everything
computes in f32; shapes are per rank and kept 2-D ([rows, lanes]) so Mosaic lowers them without
relayouts.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mkc.layers.activation import Activation

F32 = jnp.float32
L2NORM_EPS = 1e-6  # fixed inside upstream's l2norm (Qwen3.5's gated delta net, Kimi's KDA)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMS norm with a plain weight (LlamaRMSNorm, GptOssRMSNorm, KimiRMSNorm):
    ``x * rsqrt(mean(x^2) + eps) * w``; x [B, H], w [1, H]."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def rms_norm_zero_centred(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMS norm with a zero-centred weight (Qwen3_5RMSNorm):
    ``x * rsqrt(mean(x^2) + eps) * (1 + w)``; x [B, H], w [1, H]."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


NORM = {"plain": rms_norm, "zero_centred": rms_norm_zero_centred}


def rms_norm_weightless(x: jax.Array, eps: float) -> jax.Array:
    """RMS norm without a weight (Muse Spark's `MuseSparkRMSNorm(with_scale=False)`):
    ``x * rsqrt(mean(x^2) + eps)``; x [B, D]."""
    return x * lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def pre_norm(norm: str, c, name: str) -> jax.Array:
    """A layer's RMS norm of its residual stream by its vector `name`, with a `norm` weight
    ("plain": w, "zero_centred": 1 + w); `c` is the layer (`mkc.runtime.context.Layer`)."""
    return NORM[norm](c.refs.x[...], c.vector(name), c.dims.rms_norm_eps)


def gated_rms_norm(o: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen3_5RMSNormGated over one head: norm(o) * w * silu(z); o, z [1, Dv], w [1, Dv]."""
    return o * lax.rsqrt(jnp.mean(o * o, axis=-1, keepdims=True) + eps) * w * jax.nn.silu(z)


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def delta_rule_update(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array, beta: jax.Array
                      ) -> tuple[jax.Array, jax.Array]:
    """The delta rule's update of one head's decayed state by one token, and its output (the
    gated delta net and KDA decay the state their own way first): state [Dk, Dv] f32; q, k
    [1, Dk] (normalised, q scaled); v [1, Dv]; beta [1, 1].
    S += k^T ((v - k S) * beta); o = q S."""
    predicted = jnp.dot(k, state, preferred_element_type=F32)            # [1, Dv]
    delta = (v - predicted) * beta
    # Outer product as a broadcast of the transposed key (Mosaic has no outer-product dot).
    state = state + jnp.transpose(k) * delta
    return jnp.dot(q, state, preferred_element_type=F32), state


def softplus(x: jax.Array) -> jax.Array:
    # log1p(exp(x)) overflows for large x; this form is exact to f32 rounding everywhere.
    return jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x)))


def swiglu(gate_up: jax.Array, width: int) -> jax.Array:
    """gate_up [B, 2*width] packed as [gate | up] -> silu(gate) * up."""
    return jax.nn.silu(gate_up[:, :width]) * gate_up[:, width:2 * width]


def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GptOssExperts' activation: ``gate`` clamped from above only, ``up`` on both sides,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


def clamped_swiglu_halves(gate_up: jax.Array, half: int, alpha: float, limit: float) -> jax.Array:
    """`clamped_swiglu` of a gate|up product ``[B, 2 * half]`` (gate lanes first, then up, each
    ``half`` lanes) -> ``[B, half]``."""
    return clamped_swiglu(gate_up[:, :half], gate_up[:, half:2 * half], alpha, limit)


def situ(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """SiTU GLU (Kimi K3's): beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta); any
    equal shapes."""
    return (beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
            * linear_beta * jnp.tanh(up / linear_beta))


def situ_packed(gate_up: jax.Array, width: int, beta: float = 4.0,
                linear_beta: float = 25.0) -> jax.Array:
    """gate_up [B, 2*width] packed as [gate | up] (one fused projection) -> SiTU [B, width]."""
    return situ(gate_up[:, :width], gate_up[:, width:2 * width], beta, linear_beta)


# Each gated MLP activation's kernel math (`mkc.layers.activation.Activation`), on a `[gate | up]`
# product of halves `width` lanes wide, with the model's dims `d`
ACTIVATIONS: dict[Activation, Callable[[jax.Array, int, Any], jax.Array]] = {
    Activation.SILU: lambda gate_up, width, d: swiglu(gate_up, width),
    Activation.CLAMPED: lambda gate_up, width, d: clamped_swiglu_halves(gate_up, width, d.swiglu_alpha,
                                                                        d.swiglu_limit),
    Activation.SITU: lambda gate_up, width, d: situ_packed(gate_up, width, d.activation_situ_beta,
                                                           d.activation_situ_linear_beta),
}


def activation(kind: Activation, gate_up: jax.Array, width: int, d: Any) -> jax.Array:
    """A gated MLP's activation `kind` of its `[gate | up]` product ``[B, 2 * width]``."""
    return ACTIVATIONS[kind](gate_up, width, d)


def rotate_half_matrix(head_dim: int, rotary_dim: int) -> jax.Array:
    """R with x @ R == rotate_half(x[:rotary_dim]) padded with zeros: [-x2, x1, 0...]."""
    half = rotary_dim // 2
    i = lax.broadcasted_iota(jnp.int32, (head_dim, head_dim), 0)
    j = lax.broadcasted_iota(jnp.int32, (head_dim, head_dim), 1)
    plus = (j >= half) & (j < rotary_dim) & (i == j - half)      # out[j] = x1[j - half]
    minus = (j < half) & (i == j + half)                        # out[j] = -x2[j]
    return jnp.where(plus, 1.0, jnp.where(minus, -1.0, 0.0)).astype(F32)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, rot: jax.Array) -> jax.Array:
    """x [n, D]; cos/sin [1, D] (1 and 0 past the rotary dims); rot from rotate_half_matrix."""
    return x * cos + jnp.dot(x, rot, preferred_element_type=F32) * sin


def attention_tile(q: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                   m: jax.Array, denom: jax.Array, acc: jax.Array, scale: float
                   ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax update with one KV tile for the query heads of one row.

    q [nq, D] f32; k, v [T, D] bf16; visible [1, T] bool; running max m and softmax
    denominator [nq, 1], acc [nq, D].
    """
    s = lax.dot_general(q, k.astype(F32), (((1,), (1,)), ((), ())),
                        preferred_element_type=F32) * scale               # [nq, T]
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = alpha * acc + jnp.dot(p, v.astype(F32), preferred_element_type=F32)
    return m_new, denom_new, acc_new


def split_bf16x3(x: jax.Array) -> jax.Array:
    """f32 x [n, D] as three bf16 parts stacked on rows [3n, D] (high, middle, low): their sum
    is x to f32 precision (8 + 8 + 8 significand bits), so a dot of the parts with a bf16
    operand, summed, is an f32 dot that loads the bf16 operand into the MXU once, as bf16."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(F32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(F32)).astype(jnp.bfloat16)
    return jnp.concatenate([hi, mid, lo], axis=0)


def sum_parts(y: jax.Array, n: int) -> jax.Array:
    """The three parts' products [3n, W] -> [n, W]: high + middle + low."""
    return (y[:n] + y[n:2 * n]) + y[2 * n:]


def attention_tile_bf16x3(q3: jax.Array, k: jax.Array, v: jax.Array, visible: jax.Array,
                          m: jax.Array, denom: jax.Array, acc: jax.Array, scale: float
                          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`attention_tile` with the bf16 tile fed to the MXU as it is: q3 [3n, D] bf16 is the n
    query heads' `split_bf16x3`, k, v [T, D] bf16 are loaded once each (no f32 copy of the
    tile), and the probabilities go through v split the same way. Each part's products are
    exact in f32; the parts are summed in f32."""
    n = m.shape[0]
    s = sum_parts(lax.dot_general(q3, k, (((1,), (1,)), ((), ())), preferred_element_type=F32),
                  n) * scale                                                 # [n, T]
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    pv = sum_parts(jnp.dot(split_bf16x3(p), v, preferred_element_type=F32), n)
    acc_new = alpha * acc + pv
    return m_new, denom_new, acc_new
