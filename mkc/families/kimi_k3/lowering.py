"""Kimi K3's compute bodies: the layer library's, composed as `graph.LAYERS` says (KDA, MLA,
the dense SiTU MLP and the latent MoE, each between the block attention residuals' input mix
and residual add: `mkc.layers.block_residuals`); around the layer loop, the block residuals'
prologue (the embedding is block 0) and final mixture. Attention projections come from the
pool's weight view, MoE experts (MXFP4) from its expert slots, every other matrix from the
ring: `c.matmul` serves whichever the schedule chose.
"""
from __future__ import annotations

from mkc.families.kimi_k3.graph import LAYERS
from mkc.layers.block_residuals.lowering import final_hidden, prologue  # noqa: F401
from mkc.layers.decoder.lowering import no_host_inputs as host_inputs  # noqa: F401  (no rotary table)
from mkc.layers.sublayer import body_table

# Every op's body: the layer library's (`graph.LAYERS`).
BODIES = body_table(LAYERS)
