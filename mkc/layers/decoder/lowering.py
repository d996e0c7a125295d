"""What the generated module calls around a composed decoder's layer loop (the `prologue` and
`final_hidden` of `mkc.model.contracts.Lowering`): a family's lowering imports the pair whose
final norm its decoder has, `final_hidden` (a plain weight, `w`) or `final_hidden_zero_centred`
(`1 + w`), as `final_hidden`; a family whose logits are post-processed (`Family.final_logits`)
imports `softcapped_logits` as `final_logits`."""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from mkc.layers import ops
from mkc.runtime.context import Kernel


def prologue(k: Kernel) -> None:
    """After the embedding: nothing beyond the residual stream x (which it filled)."""


def no_host_inputs(dims: Any, positions: jax.Array) -> dict[str, jax.Array]:
    """A decoder without VMEM inputs computed on the host (no rotary table)."""
    return {}


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The final norm of the residual stream (head_norm row 0 holds its weight)."""
    return ops.rms_norm(k.refs.x[...], head_norm[0:1, :], k.dims.rms_norm_eps)


def final_hidden_zero_centred(k: Kernel, head_norm) -> jax.Array:
    """The zero-centred final norm of the residual stream (head_norm row 0 holds its weight)."""
    return ops.rms_norm_zero_centred(k.refs.x[...], head_norm[0:1, :], k.dims.rms_norm_eps)


def softcapped_logits(k: Kernel, logits: jax.Array, vocab: tuple[int, int]) -> jax.Array:
    """Muse Spark's logits: ``T * tanh(logits * output_multiplier / T)`` in upstream's order (T:
    the dims' `final_logit_softcapping`), and -inf on the ids at or past the dims' `vocab_used`
    (untrained padding rows, never picked nor sampled). `logits` [B, cols] are this rank's vocab
    part's (`vocab`: the class's (ways, stride) rule), columns past the part padding."""
    d = k.dims
    cap = d.final_logit_softcapping
    capped = jnp.tanh((logits * d.output_multiplier) / cap) * cap
    ways, stride = vocab
    first = lax.rem(lax.axis_index(k.axis) // stride, ways) * k.per_rank["vocab"]
    ids = first + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    return jnp.where(ids < getattr(d, "vocab_used", d.vocab_size), capped, -jnp.inf)
