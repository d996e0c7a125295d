"""Qwen3.5 MoE compute pieces beyond Qwen3.5's: softmax top-k routing inside a kernel."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing per row -> (weights [B, E], ids [B, top_k] int32).

    weights is zero except at the chosen experts, where it holds their softmax probabilities
    renormalised to sum 1 (upstream Qwen3_5MoeTopKRouter always renormalises). ids lists the
    picks best first, ties to the lowest index, as lax.top_k does; Mosaic cannot lower top_k,
    so this takes top_k rounds of max and lowest matching lane."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    n_experts = logits.shape[1]
    lane = lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    slot = lax.broadcasted_iota(jnp.int32, (logits.shape[0], top_k), 1)
    pick = probs
    kept = jnp.zeros_like(probs)
    ids = jnp.zeros((logits.shape[0], top_k), jnp.int32)
    for j in range(top_k):
        best = jnp.max(pick, axis=-1, keepdims=True)
        idx = jnp.min(jnp.where(pick == best, lane, n_experts), axis=-1, keepdims=True)
        hit = lane == idx
        kept = jnp.where(hit, probs, kept)
        pick = jnp.where(hit, -jnp.inf, pick)
        ids = jnp.where(slot == j, idx, ids)
    return kept / jnp.sum(kept, axis=-1, keepdims=True), ids
