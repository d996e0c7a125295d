"""Per-row token sampling on device: one jitted function over all B rows of a step's logits.

Each row carries its own request's settings (temperature, top-k, top-p, seed); the step's
logits never leave the device, and the host reads back only the B chosen tokens (which it
needs anyway to stream them), with their logprobs when a row asked for them. A row with
temperature 0 takes the argmax, exactly the kernel's own greedy choice. A sampled row draws
from `fold_in(key(seed), n)`, n being the number of tokens its request has generated, so a
seeded request gives the same text whichever row it holds and whatever shares the step with it.

Logprobs are those of the model's own distribution, `log_softmax(logits)` of the logits the
token was chosen from, before temperature, top-k and top-p reshape it (OpenAI's and vLLM's
default): a sampled token's logprob says how likely the model found it, not how likely the
sampler was to draw it. A row may have its token forced (`row_arrays`' `forced`): a prompt
token fed by a decode step, whose logprob under the logits before it is what `echo` with
`logprobs` reports.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

# The static widths of the top-logprobs computed in a step (one compile each): the smallest
# that holds every row's request. 5 is the completions API's bound, 20 the chat API's.
LOGPROB_WIDTHS = (0, 5, 20)


@dataclass(frozen=True)
class SamplingParams:
    """One request's sampling settings (validated by the API before they get here).
    `logprobs`: None for none, else how many of the most likely tokens to report beside the
    chosen token's logprob (0 to LOGPROB_WIDTHS[-1]); `prompt_logprobs`: with `logprobs`, the
    prompt's tokens' too (each under the logits of the position before it)."""

    max_tokens: int
    temperature: float = 1.0        # 0: greedy
    top_k: int = 0                  # 0 (or below): every token
    top_p: float = 1.0
    seed: int = 0
    stop_token_ids: frozenset[int] = frozenset()
    logprobs: int | None = None
    prompt_logprobs: bool = False


class Sampled(NamedTuple):
    """A step's choices for N rows: tokens int32[N]; with logprobs, the chosen tokens'
    logprobs f32[N] and the `width` most likely tokens int32[N, width] and their logprobs
    f32[N, width] (None without)."""

    tokens: jax.Array
    logprob: jax.Array | None = None
    top_ids: jax.Array | None = None
    top_logprobs: jax.Array | None = None


def logprob_width(params: list[SamplingParams | None]) -> int | None:
    """The top-logprobs width a step computes: None when no row wants logprobs."""
    wanted = [p.logprobs for p in params if p is not None and p.logprobs is not None]
    if not wanted:
        return None
    return next(w for w in LOGPROB_WIDTHS if w >= max(wanted))


def _with_logprobs(logits: jax.Array, tokens: jax.Array, width: int | None) -> Sampled:
    if width is None:
        return Sampled(tokens)
    logp = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logp, tokens[:, None], axis=-1)[:, 0]
    top_logprobs, top_ids = jax.lax.top_k(logp, width)
    return Sampled(tokens, chosen, top_ids.astype(jnp.int32), top_logprobs)


@functools.partial(jax.jit, static_argnames=("width",))
def sample_rows(logits: jax.Array, temperature: jax.Array, top_k: jax.Array, top_p: jax.Array,
                seed: jax.Array, counter: jax.Array, forced: jax.Array,
                width: int | None = None) -> Sampled:
    """The next token of each row: logits f32[B, V]; temperature, top_p f32[B]; top_k, seed,
    counter, forced int32[B] (a row's token where it is 0 or more); with logprobs `width` wide
    unless width is None."""
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
    logits = logits.astype(jnp.float32)
    tokens = jax.vmap(one)(logits, temperature, top_k, top_p, seed, counter)
    tokens = jnp.where(forced >= 0, forced, tokens)
    return _with_logprobs(logits, tokens, width)


@functools.partial(jax.jit, static_argnames=("width",))
def greedy_rows(logits: jax.Array, width: int | None = None) -> Sampled:
    """Each row's argmax (logits f32[N, V]), with logprobs `width` wide unless width is None:
    the verify step's rows under speculative decoding."""
    logits = logits.astype(jnp.float32)
    return _with_logprobs(logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), width)


@functools.partial(jax.jit, static_argnames=("width",))
def score_rows(logits: jax.Array, tokens: jax.Array, width: int) -> Sampled:
    """Given tokens int32[N]' logprobs under logits f32[N, V], with the `width` most likely: a
    verify prefill's prompt tokens, each under the logits of the position before it."""
    return _with_logprobs(logits.astype(jnp.float32), tokens, width)


def row_arrays(params: list[SamplingParams | None], counters: list[int],
               forced: list[int] | None = None) -> tuple[np.ndarray, ...]:
    """`sample_rows`' per-row inputs for B rows (None: an idle row, sampled greedily);
    `forced`: each row's token to take in place of a sample, or -1 (default: none)."""
    idle = SamplingParams(max_tokens=1, temperature=0.0)
    rows = [p or idle for p in params]
    return (np.array([p.temperature for p in rows], np.float32),
            np.array([p.top_k for p in rows], np.int32),
            np.array([p.top_p for p in rows], np.float32),
            np.array([p.seed for p in rows], np.int32),
            np.array(counters, np.int32),
            np.array([-1] * len(rows) if forced is None else forced, np.int32))


def row_logprobs(sampled: Sampled, row: int, params: SamplingParams
                 ) -> tuple[float | None, tuple[tuple[int, float], ...] | None]:
    """One row's chosen-token logprob and its `params.logprobs` most likely (token, logprob),
    from a Sampled already on the host; (None, None) when the request wants none."""
    if params.logprobs is None or sampled.logprob is None:
        return None, None
    k = params.logprobs
    top = tuple((int(t), float(lp)) for t, lp in zip(sampled.top_ids[row][:k],
                                                     sampled.top_logprobs[row][:k]))
    return float(sampled.logprob[row]), top
