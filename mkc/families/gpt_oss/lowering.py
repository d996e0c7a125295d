"""The compute body of every GPT-OSS decode op, as the generic module calls it
(`mkc.families.qwen3_5.lowering` has the convention).

A model layer runs as two sublayers of the layer loop: attention (`swa` on sliding layers,
`gqa` on full ones), then the MoE (`moe`), every body the layer library's (`graph.LAYERS`,
`BODIES`): GQA with q/k/v and o_proj biases, sinks (the online softmax starts from each head's
sink logit) and on sliding layers the window's mask; the MoE with its router's bias, the top-k
softmax over the picked logits, each expert's biases and the clamped SwiGLU on its
de-interleaved `[gate | up]` halves, the expert matmul on MXFP4 or FP8 codes
(`mkc.layers.expert_formats`). GPT-OSS's own: YaRN RoPE from the host's table (`host_inputs`).
"""
from __future__ import annotations

import jax

from mkc.families.gpt_oss import ops
from mkc.families.gpt_oss.graph import LAYERS
from mkc.layers.sublayer import body_table
from mkc.runtime.context import Kernel

BODIES = body_table(LAYERS)


# ---- around the layers ----------------------------------------------------------------------
def prologue(k: Kernel) -> None:
    """After the embedding: nothing beyond the residual stream x (which it filled)."""


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The final norm of the residual stream (head_norm row 0 holds its weight)."""
    return ops.rms_norm(k.refs.x[...], head_norm[0:1, :], k.dims.rms_norm_eps)


def host_inputs(dims, positions: jax.Array) -> dict[str, jax.Array]:
    """The `rope` VMEM input: YaRN cos and sin [2, B, head_dim] at each row's position."""
    return {"rope": ops.rope_table(dims, positions)}
