"""The gated delta net's own kernel math (the shared math is `mkc.layers.ops`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers.ops import delta_rule_update


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
    return delta_rule_update(state * jnp.exp(g), q, k, v, beta)
