"""DeepSeek-V3's compute bodies: the layer library's, composed as `graph.LAYERS` says; the
rotary table (YaRN, the rope part's width) is the library's host input."""
from __future__ import annotations

from mkc.families.deepseek_v3.graph import LAYERS
from mkc.layers.decoder.lowering import final_hidden, prologue  # noqa: F401
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table

BODIES = body_table(LAYERS)
