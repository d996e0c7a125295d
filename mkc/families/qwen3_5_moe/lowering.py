"""The compute bodies of every Qwen3.5 MoE decode op: the layer library's, composed as
`graph.LAYERS` says (`BODIES`, keyed by layer kind and op; `mkc.families.qwen3_5.lowering` has
the convention), and around the layers its zero-centred final norm."""
from __future__ import annotations

from mkc.families.qwen3_5_moe.graph import LAYERS
from mkc.layers.decoder.lowering import final_hidden_zero_centred as final_hidden  # noqa: F401
from mkc.layers.decoder.lowering import prologue  # noqa: F401
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table

BODIES = body_table(LAYERS)
