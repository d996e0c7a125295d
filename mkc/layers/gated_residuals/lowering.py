"""The compute bodies of gated norm-preserving residuals (`mkc.layers.gated_residuals`), and the
kernel-wide `prologue` a family with them calls after the embedding. The stream lives in
`k.refs.x` (f32), as a plain residual's does; every body computes in f32 ([B, H] values, the
per-layer vectors [1, H])."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers import ops
from mkc.layers.gated_residuals import GATES, POST_NORMS, PRE_NORMS, RESIDUAL_GATE_EPS, GatedAdd, GatedPre
from mkc.runtime.context import Kernel, Layer

F32 = jnp.float32


def gate_coefficients(gate: jax.Array, temperature: float) -> tuple[jax.Array, jax.Array]:
    """(alpha, beta) of a residual gate [1, H]: u = gate / temperature, beta = sigmoid(u),
    alpha = sqrt(max(sigmoid(-u) * (1 + beta), 1e-3))."""
    u = gate / temperature
    beta = jax.nn.sigmoid(u)
    alpha = jnp.sqrt(jnp.maximum(jax.nn.sigmoid(-u) * (1.0 + beta), RESIDUAL_GATE_EPS))
    return alpha, beta


def input_scaled_norm(y: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """`MuseSparkTextInputScaledRMSNorm`: t = y * (1 + w) rounded to bf16, then its weightless
    RMS norm (y [B, H], w [1, H])."""
    t = (y * (1.0 + w)).astype(jnp.bfloat16).astype(F32)
    return ops.rms_norm_weightless(t, eps)


def gated_update(x: jax.Array, normed: jax.Array, gate: jax.Array, temperature: float) -> jax.Array:
    """alpha * x + beta * normed, per channel."""
    alpha, beta = gate_coefficients(gate, temperature)
    return alpha * x + beta * normed


def _pre(s: GatedPre, c: Layer) -> jax.Array:
    return ops.rms_norm_zero_centred(c.refs.x[...], c.vector(PRE_NORMS[s.place]), c.dims.rms_norm_eps)


def input_norm(s: GatedPre, c: Layer) -> jax.Array:
    return _pre(s, c)


def pre_ffn_norm(s: GatedPre, c: Layer) -> jax.Array:
    return _pre(s, c)


def _summed(c: Layer, outputs: tuple[jax.Array, ...]) -> jax.Array:
    """The kind's outputs, each cut to the hidden size, summed."""
    H = c.dims.hidden_size
    cut = [v if v.shape[-1] == H else v[:, :H] for v in outputs]
    return sum(cut[1:], cut[0])


def attn_residual(s: GatedAdd, c: Layer, *outputs: jax.Array) -> None:
    """x = alpha * x + beta * rms(y): the weightless post norm of eps `post_norm_eps`."""
    normed = ops.rms_norm_weightless(_summed(c, outputs), c.dims.post_norm_eps)
    c.refs.x[...] = gated_update(c.refs.x[...], normed, c.vector(GATES[s.place]),
                                 c.dims.residual_gate_temperature)


def mlp_residual(s: GatedAdd, c: Layer, *outputs: jax.Array) -> None:
    """x = alpha * x + beta * the input-scaled post norm of y."""
    normed = input_scaled_norm(_summed(c, outputs), c.vector(POST_NORMS[s.place]), c.dims.post_norm_eps)
    c.refs.x[...] = gated_update(c.refs.x[...], normed, c.vector(GATES[s.place]),
                                 c.dims.residual_gate_temperature)


def prologue(k: Kernel) -> None:
    """The embedding (in x) under its weightless RMS norm (`MuseSparkTextNormedEmbedding`)."""
    k.refs.x[...] = ops.rms_norm_weightless(k.refs.x[...], k.dims.rms_norm_eps)
