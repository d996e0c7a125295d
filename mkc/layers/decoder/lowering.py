"""What the generated module calls around a composed decoder's layer loop (the `prologue` and
`final_hidden` of `mkc.model.contracts.Lowering`): a family's lowering imports the pair whose
final norm its decoder has, `final_hidden` (a plain weight, `w`) or `final_hidden_zero_centred`
(`1 + w`), as `final_hidden`."""
from __future__ import annotations

from typing import Any

import jax

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
