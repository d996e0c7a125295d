"""Compute bodies for the Kimi K3 family, as functions over in-kernel values.

Generated Kimi kernels call these between the DMAs mkc schedules; nothing here touches a
semaphore or decides when memory moves. Everything computes in f32 on 2-D values ([rows,
lanes]) with only ops Mosaic lowers: no ``lax.top_k``, ``cumsum``, outer-product dots, vector
gathers or lane reshapes that split a 128-lane vreg. The math is that of
``mkc.families.kimi_k3.reference`` (latent MoE with sigmoid routing, SiTU, block attention
residuals); its KDA and NoPE gated MLA are the layer library's (`mkc.layers.kda.ops`,
`mkc.layers.mla.ops`, the latter re-exported here with its packers `split_q_b_proj` and
`split_kv_b_proj`; the routed experts' formats are the layer library's,
`mkc.layers.expert_formats`).
"""
from __future__ import annotations


import jax
import jax.numpy as jnp

from mkc.layers.mla.ops import mla_absorb_query, mla_tile, mla_value_up  # noqa: F401  (MLA's)
from mkc.layers.mla.weights import split_kv_b_proj, split_q_b_proj  # noqa: F401
from mkc.layers.moe.lowering import sigmoid_route_weights
from mkc.layers.block_residuals.lowering import residual_mix  # noqa: F401  (block residuals)
from mkc.layers.ops import rms_norm, situ, situ_packed  # noqa: F401  (KimiRMSNorm: a plain weight; SiTU)

F32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# MoE routing


def route(logits: jax.Array, bias: jax.Array, top_k: int,
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Sigmoid top-k routing per row -> (weights [B, E], ids [B, top_k] int32): the layer
    library's MoE router with one group (`mkc.layers.moe.lowering.sigmoid_route_weights`).

    logits [B, E] f32, bias [1, E] (``e_score_correction_bias``, used only to pick). weights is
    zero except at the chosen experts, where it holds the sigmoid scores renormalised over the
    chosen and times ``scaling`` (``routed_scaling_factor``). ids lists the picks best first,
    ties to the lowest index (``mkc.runtime.experts.top_k``). DMAs need scalar ids in SMEM: store
    ``mkc.runtime.experts.expert_id(ids, b, j)`` into an SMEM ref; ``expert_weight`` there
    reads a dynamic expert's column.
    """
    return sigmoid_route_weights(logits, bias, top_k, True, scaling)
