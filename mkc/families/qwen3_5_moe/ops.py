"""Qwen3.5 MoE compute pieces beyond Qwen3.5's: softmax top-k routing inside a kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.runtime import experts


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing per row -> (weights [B, E], ids [B, top_k] int32).

    weights is zero except at the chosen experts, where it holds their softmax probabilities
    renormalised to sum 1 (upstream Qwen3_5MoeTopKRouter always renormalises). ids lists the
    picks best first, ties to the lowest index (`mkc.runtime.experts.top_k`)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    kept, ids = experts.top_k(probs, probs, top_k)
    return kept / jnp.sum(kept, axis=-1, keepdims=True), ids
