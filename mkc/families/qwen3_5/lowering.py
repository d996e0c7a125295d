"""The compute bodies of every Qwen3.5 decode op, as the generic module calls them: the
layer library's, composed as `graph.LAYERS` says (`BODIES`, keyed by layer kind and op), and
around the layers its zero-centred final norm (`mkc.layers.decoder.lowering`).

A body is `op(c, *values) -> values`: `c` is the layer (`mkc.runtime.context.Layer`); the
values are the op's graph reads and writes that are not tensors (weights, vectors, states,
caches) or the residual stream `x` (a VMEM buffer the body reads and writes itself), in graph
order. Shapes are per rank; sizes come from `c.per_rank` (the graph's) and `c.dims`.
"""
from __future__ import annotations

from mkc.families.qwen3_5.graph import LAYERS
from mkc.layers.decoder.lowering import final_hidden_zero_centred as final_hidden  # noqa: F401
from mkc.layers.decoder.lowering import prologue  # noqa: F401
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table

BODIES = body_table(LAYERS)
