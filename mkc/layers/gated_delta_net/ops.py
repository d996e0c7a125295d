"""The gated delta net's own kernel math (the shared math is `mkc.layers.ops`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

F32 = jnp.float32


def causal_conv_silu(window: list[jax.Array], taps: jax.Array) -> jax.Array:
    """Depthwise causal conv of one new step: window[j] [B, C] oldest first, taps [K, C]."""
    acc = window[0] * taps[0:1, :]
    for j in range(1, len(window)):
        acc = acc + window[j] * taps[j:j + 1, :]
    return jax.nn.silu(acc)


def delta_rule_head(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                    g: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule for one head and one batch row.

    state [Dk, Dv] f32; q, k [1, Dk] (normalised, q scaled); v [1, Dv]; g, beta [1, 1].
    S *= exp(g); S += k^T ((v - k S) * beta); o = q S.
    """
    state = state * jnp.exp(g)
    predicted = jnp.dot(k, state, preferred_element_type=F32)            # [1, Dv]
    delta = (v - predicted) * beta
    # Outer product as a broadcast of the transposed key (Mosaic has no outer-product dot).
    state = state + jnp.transpose(k) * delta
    o = jnp.dot(q, state, preferred_element_type=F32)
    return o, state
