"""Per-row token sampling on device: one jitted function over all B rows of a step's logits.

Each row carries its own request's settings (temperature, top-k, top-p, seed); the step's
logits never leave the device, and the host reads back only the B chosen tokens (which it
needs anyway to stream them). A row with temperature 0 takes the argmax, exactly the kernel's
own greedy choice. A sampled row draws from `fold_in(key(seed), n)`, n being the number of
tokens its request has generated, so a seeded request gives the same text whichever row it
holds and whatever shares the step with it.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (validated by the API before they get here)."""

    max_tokens: int
    temperature: float = 1.0        # 0: greedy
    top_k: int = 0                  # 0 (or below): every token
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()


@jax.jit
def sample_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                seed: jax.Array, counter: jax.Array) -> jax.Array:
    """The next token of each row: logits f32[B, V]; temperature, top_p f32[B]; top_k, seed,
    counter int32[B] -> int32[B]."""
    def one(row, t, k, p, s, n):
        greedy = jnp.argmax(row).astype(jnp.int32)
        scaled = row / jnp.where(t > 0, t, 1.0)
        order = jnp.argsort(-scaled, stable=True)          # most likely first
        ranked = scaled[order]
        rank = jnp.arange(row.shape[0])
        keep = (k <= 0) | (rank < k)
        probs = jax.nn.softmax(jnp.where(keep, ranked, -jnp.inf))
        keep &= (jnp.cumsum(probs) - probs) < p            # the smallest prefix reaching p
        key = jax.random.fold_in(jax.random.PRNGKey(s), n)
        choice = jax.random.categorical(key, jnp.where(keep, ranked, -jnp.inf))
        return jnp.where(t > 0, order[choice].astype(jnp.int32), greedy)
    return jax.vmap(one)(logits.astype(jnp.float32), temperature, top_k, top_p, seed, counter)


def row_arrays(params: list[SamplingParams | None], counters: list[int]) -> tuple[np.ndarray, ...]:
    """`sample_rows`' per-row inputs for B rows (None: an idle row, sampled greedily)."""
    idle = SamplingParams(max_tokens=1, temperature=0.0)
    rows = [p or idle for p in params]
    return (np.array([p.temperature for p in rows], np.float32),
            np.array([p.top_k for p in rows], np.int32),
            np.array([p.top_p for p in rows], np.float32),
            np.array([p.seed for p in rows], np.int32),
            np.array(counters, np.int32))
