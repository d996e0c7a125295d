"""DeepSeek-V3's compute bodies: the layer library's, composed as `graph.LAYERS` says; the
rotary table (YaRN, the rope part's width) is the library's host input."""
from __future__ import annotations

import jax

from mkc.families.deepseek_v3.graph import LAYERS
from mkc.layers import ops
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table
from mkc.runtime.context import Kernel

BODIES = body_table(LAYERS)


def prologue(k: Kernel) -> None:
    """After the embedding: nothing beyond the residual stream x (which it filled)."""


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The final norm of the residual stream (head_norm row 0 holds its weight)."""
    return ops.rms_norm(k.refs.x[...], head_norm[0:1, :], k.dims.rms_norm_eps)
