"""Qwen3-MoE's compute bodies: the layer library's, composed as `graph.LAYERS` says, and around
the layers its plain final norm (`mkc.layers.decoder.lowering`)."""
from __future__ import annotations

from mkc.families.qwen3_moe.graph import LAYERS
from mkc.layers.decoder.lowering import final_hidden, prologue  # noqa: F401
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table

BODIES = body_table(LAYERS)
