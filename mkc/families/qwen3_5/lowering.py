"""The compute bodies of every Qwen3.5 decode op, as the generic module calls them: the
layer library's, composed as `graph.LAYERS` says (`BODIES`, keyed by layer kind and op).

A body is `op(c, *values) -> values`: `c` is the layer (`mkc.runtime.context.Layer`); the
values are the op's graph reads and writes that are not tensors (weights, vectors, states,
caches) or the residual stream `x` (a VMEM buffer the body reads and writes itself), in graph
order. Shapes are per rank; sizes come from `c.per_rank` (the graph's) and `c.dims`.
"""
from __future__ import annotations

import jax

from mkc.families.qwen3_5.graph import LAYERS
from mkc.layers import ops
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table
from mkc.runtime.context import Kernel

BODIES = body_table(LAYERS)


# ---- around the layers ----------------------------------------------------------------------
def prologue(k: Kernel) -> None:
    """After the embedding: nothing beyond the residual stream x (which it filled)."""


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The final norm of the residual stream (head_norm row 0 holds its weight)."""
    return ops.rms_norm_zero_centred(k.refs.x[...], head_norm[0:1, :], k.dims.rms_norm_eps)
