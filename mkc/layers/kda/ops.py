"""KDA's own kernel math (the shared math is `mkc.layers.ops`), on 2-D values with only ops
Mosaic lowers."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers.ops import delta_rule_update, rms_norm


def log_decay(gate: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float) -> jax.Array:
    """Per-key-channel log decay a = lower_bound * sigmoid(exp(A_log) * (gate + dt_bias)) <= 0.

    gate [B, H*Dk] is the ``f_b_proj`` output; a_log [1, H*Dk] is ``A_log`` repeated over each
    head's channels (`mkc.layers.kda.weights.expand_a_log`); dt_bias [1, H*Dk]. Head h owns
    lanes [h*Dk, (h+1)*Dk).
    """
    return lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * (gate + dt_bias))


def delta_rule_head(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                    decay: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the KDA delta rule for one head and one batch row -> (o [1, Dv], state).

    state [Dk, Dv] f32 (key axis first, the cache layout); q, k [1, Dk] (l2-normalised, q
    scaled by Dk**-0.5); v [1, Dv]; decay [1, Dk] log-decay; beta [1, 1].
    S = diag(exp(decay)) S; S += k^T (beta (v - k S)); o = q S.
    """
    # Rows of S are key channels, so per-channel factors act as [Dk, 1] columns: a transposed
    # [1, Dk] row lowers.
    return delta_rule_update(state * jnp.transpose(jnp.exp(decay)), q, k, v, beta)


def gated_output(o: jax.Array, g: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """A head's output before o_proj: rms(o, o_norm) * sigmoid(g_proj(x)); o, g, w [1, Dv]."""
    return rms_norm(o, w, eps) * jax.nn.sigmoid(g)
