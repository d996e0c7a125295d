"""The reference math the layer kinds share: the f32 oracle's linear maps and norms, and the
pieces of the kernel rounding emulation (`mkc.reference.rounding`) every kind's reference
calls the same way.

A kind's reference (`mkc.layers.<kind>.reference`) is the oracle the kernels are judged
against: it shares no code with the kernel's bodies (`mkc.layers.ops`) and favours plain,
readable math. With a `Rounding` it rounds where the generated kernel does, summing in the
kernel's f32 order, each piece jitted in the kernel's formulation and shapes.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers import ops
from mkc.layers.activation import Activation
from mkc.reference.rounding import Rounding, allreduce, row_parallel

HIGHEST = jax.lax.Precision.HIGHEST


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for a PyTorch-layout ``[out, in]`` weight, in full f32."""
    return jnp.einsum("...i,oi->...o", x, w, precision=HIGHEST)


# The norms are jitted, as the kernel's are compiled: run eagerly, ``mean(x * x)`` is a reduce
# of its own, which XLA's CPU backend sums in another f32 order than the kernel's fused one at
# some widths (hidden 384: 263 of 768 elements of a pre-norm one ulp apart, which flipped a
# bf16 input of a Qwen3-MoE layer's K/V projection; at 256 they agree).
@jax.jit
def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMS norm over the last axis with a plain weight (LlamaRMSNorm, Qwen3MoeRMSNorm)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


@jax.jit
def rms_norm_zero_centred(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMS norm over the last axis with a zero-centred weight, ``1 + w`` (Qwen3_5RMSNorm)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


NORM = {"plain": rms_norm, "zero_centred": rms_norm_zero_centred}


@jax.jit
def rms_norm_weightless(x: jax.Array, eps: float) -> jax.Array:
    """RMS norm over the last axis without a weight (`MuseSparkRMSNorm(with_scale=False)`, which
    computes ``x * (mean(x^2) + eps)^-0.5``)."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)


def input_scaled_norm(y: jax.Array, w: jax.Array, eps: float, rounded: bool = False) -> jax.Array:
    """`MuseSparkTextInputScaledRMSNorm`: ``t = y * (1 + w)`` (rounded to bf16 where
    ``rounded``, as a bf16 model's activations are), then its weightless RMS norm."""
    t = y * (1.0 + w)
    if rounded:
        t = t.astype(jnp.bfloat16).astype(jnp.float32)
    return rms_norm_weightless(t, eps)


@functools.partial(jax.jit, static_argnames=("cap", "multiplier", "used"))
def softcap_logits(logits: jax.Array, *, cap: float, multiplier: float, used: int) -> jax.Array:
    """``cap * tanh(logits * multiplier / cap)`` in upstream's order (`MuseSparkForConditional
    Generation.forward`), -inf on the vocabulary's ids from ``used`` on (untrained padding)."""
    capped = jnp.tanh((logits * multiplier) / cap) * cap
    return jnp.where(jnp.arange(logits.shape[-1]) < used, capped, -jnp.inf)


L2NORM_EPS = 1e-6  # fixed inside upstream's l2norm (the gated delta net's, Kimi's KDA), not rms_norm_eps


def l2_normalize(x: jax.Array) -> jax.Array:
    """``x * rsqrt(sum(x^2) + 1e-6)`` over the last axis (upstream's ``l2norm``)."""
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + L2NORM_EPS)


def delta_rule_update(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                      beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The delta rule's update of a decayed state by one token, for any leading axes (the gated
    delta net and KDA decay the state their own way first): state ``[..., Dk, Dv]``, q/k
    ``[..., Dk]`` (normalised, q scaled), v ``[..., Dv]``, beta ``[...]`` -> (o ``[..., Dv]``,
    new state): ``S += k (x) ((v - S^T k) * beta); o = S^T q``."""
    predicted = jnp.einsum("...kv,...k->...v", state, k, precision=HIGHEST)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    return jnp.einsum("...kv,...k->...v", state, q, precision=HIGHEST), state


def kernel_delta_update(state: jax.Array, q: jax.Array, k: jax.Array, v_pre: jax.Array,
                        v_gate: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`delta_rule_update` of one row's and head's decayed state ``[Dk, Dv]`` in the kernel's
    formulation and shapes (q, k ``[1, Dk]`` normalised; beta ``[1, 1]``), for a caller to jit:
    the values ``[1, Dv]`` enter as their conv SiLU's factors ``v = v_pre * v_gate``, which the
    kernel fuses into ``v - k S``, one multiply-add (a rounded v there is an ulp off in about
    1/6 of the state from step 1 on, where ``k S`` is not zero)."""
    predicted = jnp.dot(k, state, preferred_element_type=jnp.float32)
    state = state + jnp.transpose(k) * ((v_pre * v_gate - predicted) * beta)
    return jnp.dot(q, state, preferred_element_type=jnp.float32), state


@jax.jit
def kernel_conv_silu(window: jax.Array, taps: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """A depthwise causal conv and SiLU of one step as the kernel sums it: window [B, C, K]
    oldest first, taps [C, 1, K] (``conv1d.weight``); tap by tap, ``acc + window_j * tap_j``
    (one FMA each), where a sum over the tap axis adds in another order. Returns
    (``silu(acc)``, and its two factors ``acc`` and ``sigmoid(acc)``: the values enter the
    delta rule as the factors, `kernel_delta_update`)."""
    acc = window[:, :, 0] * taps[None, :, 0, 0]
    for j in range(1, window.shape[-1]):
        acc = acc + window[:, :, j] * taps[None, :, 0, j]
    gate = jax.nn.sigmoid(acc)
    return acc * gate, acc, gate


def own_norm(s: Any, d: Any, name: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A kind's pre-norm weight `name` where the kind has its own residual (`s.residual`; under
    another residual strategy that strategy's sublayer owns the norm)."""
    return {name: ((d.hidden_size,), "bfloat16")} if s.residual else {}


def mm_input(x: jax.Array, rounding: Rounding | None) -> jax.Array:
    return x if rounding is None else rounding.mm_in(x)


def matmul(x: jax.Array, w: jax.Array, rounding: Rounding | None, kind: str = "",
           family: str = "", by_tiles: bool = False) -> jax.Array:
    """An activation times a weight: in f32, or as the kernel multiplies (``Rounding.linear``;
    with the kernel's matrix family ``kind.family`` it multiplies, ``Rounding.matrix``: as
    codes where the spec stores it so; ``by_tiles``: ring tile by ring tile where the family
    streams through the ring, for a kernel that sums its contraction so)."""
    if rounding is None:
        return linear(x, w)
    if not kind:
        return rounding.linear(x, w)
    return rounding.matrix(x, w, kind, family, rounding.tile_rows(kind, family) if by_tiles else None)


def out_projection(x: jax.Array, w: jax.Array, rounding: Rounding | None, kind: str, op: str,
                   per_rank: int, cls: str, by_tiles: bool = False) -> jax.Array:
    """A projection back to the hidden size whose input, of shard class ``cls``, is split in
    contiguous ``per_rank`` ranges: plain, or per-rank partial sums all-reduced as the schedule
    says (the op's matrix family, of the op's name, multiplied as codes where stored so; tile
    by tile where it streams and is stored so, or with ``by_tiles``)."""
    if rounding is None:
        return linear(x, w)
    channel = rounding.channel(kind, op)
    return row_parallel(x, w, rounding.rank_ranges(cls, x.shape[-1], per_rank), rounding.ranks,
                        rounding, rounding.reduce(kind, op),
                        rounding.tile_rows(kind, op) if channel or by_tiles else None, channel)


def sub_params(params: Mapping[str, Any], prefix: str) -> dict[str, jax.Array]:
    """Parameters under ``prefix``, renamed relative to it and upcast to f32: host arrays
    where they are values (a reference run eagerly slices its weights thousands of times a
    step, an expert and a rank's part at a time: numpy does it without a dispatch each; the
    values are the same), traced ones in the trace."""
    return {name[len(prefix):]: jnp.asarray(w).astype(jnp.float32) if isinstance(w, jax.core.Tracer)
            else np.asarray(w).astype(np.float32)
            for name, w in params.items() if name.startswith(prefix)}


def embed(params: Mapping[str, Any], tokens: jax.Array, rounding: Rounding | None = None
          ) -> jax.Array:
    """Token embeddings ``[B, H]`` f32. With ``rounding``: as the vocab-sharded kernel forms
    them, each rank contributing the rows it owns (zeros elsewhere) to the embedding all-reduce
    (exact for bf16 rows on a bf16 or f32 wire, emulated all the same)."""
    table = jnp.asarray(params["model.embed_tokens.weight"])
    x = table[tokens].astype(jnp.float32)
    if rounding is None:
        return x
    owner = tokens // rounding.size("vocab")
    partials = [jnp.where((owner == rounding.part("vocab", r))[:, None], x, 0.0)
                for r in range(rounding.ranks)]
    return allreduce(partials, rounding.reduce("embed", "embed"))


@jax.jit
def attention_tile(q, k, v, visible, m, denom, acc):
    """One KV tile's online-softmax update for one query row and head, in the kernel's
    formulation and shapes (GPT-OSS's; q [1, D] f32; k, v [T, D] bf16; visible [1, T]; m,
    denom [1, 1]; acc [1, D]): jitted, so XLA fuses it as it fuses the kernel's (the rescaling ``alpha * acc
    + p @ v`` is one FMA there)."""
    d = q.shape[-1]
    s = jax.lax.dot_general(q, k.astype(jnp.float32), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = alpha * acc + jnp.dot(p, v.astype(jnp.float32), preferred_element_type=jnp.float32)
    return m_new, denom_new, acc_new


def split_bf16x3(x):
    """f32 [n, D] -> its high, middle and low bf16 parts stacked on rows [3n, D], as the
    kernel feeds an f32 operand against a bf16 one."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.concatenate([hi, mid, lo], axis=0)


@functools.partial(jax.jit, static_argnames=("scale",))
def attention_tile_bf16x3(q, k, v, visible, m, denom, acc, scale: float | None = None):
    """`attention_tile` as the GQA kernel computes it: the bf16 tile fed as it is, the f32
    queries (q [n, D]) and probabilities split in three bf16 parts whose products are summed
    high + middle + low in f32; the scores scaled by `scale` (None: D^-0.5)."""
    n, d = q.shape
    s3 = jax.lax.dot_general(split_bf16x3(q), k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    s = ((s3[:n] + s3[n:2 * n]) + s3[2 * n:]) * (d ** -0.5 if scale is None else scale)
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    pv3 = jnp.dot(split_bf16x3(p), v, preferred_element_type=jnp.float32)
    acc_new = alpha * acc + ((pv3[:n] + pv3[n:2 * n]) + pv3[2 * n:])
    return m_new, denom_new, acc_new


# A gated MLP's activations (`mkc.layers.activation.Activation`)
def clamped_swiglu(gate: jax.Array, up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GptOssExperts' activation: the gate clamped from above only, up on both sides,
    ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = jnp.minimum(gate, limit)
    up = jnp.clip(up, -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(alpha * gate))


# Jitted as the kernel's one expression (XLA's f32 order depends on it: `mkc.numerics`).
kernel_clamped_swiglu = jax.jit(clamped_swiglu, static_argnums=(2, 3))


def silu_glu(gate: jax.Array, up: jax.Array) -> jax.Array:
    return jax.nn.silu(gate) * up


# Each activation's reference math, on the gate and up products with the model's dims `d`;
# `kernel`: in the kernel's one jitted expression (XLA's f32 order depends on it). SiTU's is
# the kernel's own (one expression either way).
ACTIVATIONS: dict[Activation, Callable[..., jax.Array]] = {
    Activation.SILU: lambda d, gate, up, kernel: silu_glu(gate, up),
    Activation.CLAMPED: lambda d, gate, up, kernel: (kernel_clamped_swiglu if kernel else clamped_swiglu)(
        gate, up, d.swiglu_alpha, d.swiglu_limit),
    Activation.SITU: lambda d, gate, up, kernel: ops.situ(gate, up, d.activation_situ_beta,
                                                          d.activation_situ_linear_beta),
}


def activation(kind: Activation, d: Any, gate: jax.Array, up: jax.Array, kernel: bool = False) -> jax.Array:
    """A gated MLP's activation `kind` of its gate and up products."""
    return ACTIVATIONS[kind](d, gate, up, kernel)
