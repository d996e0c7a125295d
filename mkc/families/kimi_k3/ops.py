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

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from mkc.layers.mla.ops import mla_absorb_query, mla_tile, mla_value_up  # noqa: F401  (MLA's)
from mkc.layers.mla.weights import split_kv_b_proj, split_q_b_proj  # noqa: F401
from mkc.layers.moe.lowering import sigmoid_route_weights
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


# ---------------------------------------------------------------------------------------------
# Block attention residuals


def residual_mix(sources: Sequence[jax.Array], count: jax.Array | int, norm_w: jax.Array,
                 proj_w: jax.Array, eps: float) -> jax.Array:
    """Softmax mixture of the first ``count`` (a traced scalar) of the residual ``sources``
    ([B, H] f32 blocks: completed block sums, then the partial sum) -> [B, H], with score_i =
    proj . rms(v_i, norm); norm_w, proj_w [1, H]. The other sources are masked out before they
    can touch the result (they may hold stale memory)."""
    scores = [jnp.where(i < count, jnp.sum(rms_norm(v, norm_w, eps) * proj_w, axis=-1, keepdims=True),
                        -jnp.inf) for i, v in enumerate(sources)]
    top = scores[0]
    for sc in scores[1:]:
        top = jnp.maximum(top, sc)
    exps = [jnp.exp(sc - top) for sc in scores]
    total = sum(exps[1:], exps[0])
    mixed = jnp.zeros_like(sources[0])
    for i, (e, v) in enumerate(zip(exps, sources)):
        mixed = mixed + jnp.where(i < count, (e / total) * v, 0.0)
    return mixed

