"""Kimi K3's compute bodies: the layer library's, composed as `graph.LAYERS` says (KDA, MLA,
the dense SiTU MLP and the latent MoE, each between the block attention residuals' input mix
and residual add: `mkc.layers.block_residuals`); around the layer loop, the block residuals'
prologue (the embedding is block 0) and final mixture. Attention projections come from the
pool's weight view, MoE experts (MXFP4) from its expert slots, every other matrix from the
ring: `c.matmul` serves whichever the schedule chose.
"""
from __future__ import annotations

import jax

from mkc.families.kimi_k3.graph import LAYERS
from mkc.layers.block_residuals import lowering as block_residuals
from mkc.layers.sublayer import body_table
from mkc.runtime.context import Kernel

# Every op's body: the layer library's (`graph.LAYERS`).
BODIES = body_table(LAYERS)


def prologue(k: Kernel) -> None:
    """The embedding (in x) becomes residual block 0; the other blocks start empty."""
    block_residuals.prologue(k)


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The output mixture over every block, then the final norm (head_norm rows: final norm,
    output mixture norm and projection)."""
    return block_residuals.final_hidden(k, head_norm)


def host_inputs(dims, positions: jax.Array) -> dict[str, jax.Array]:
    """No VMEM inputs computed on the host."""
    return {}
