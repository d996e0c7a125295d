"""The compute body of every GPT-OSS decode op, as the generic module calls it
(`mkc.families.qwen3_5.lowering` has the convention).

A model layer runs as two sublayers of the layer loop: attention (`swa` on sliding layers,
`gqa` on full ones), then the MoE (`moe`). The attention bodies are the layer library's GQA
with q/k/v and o_proj biases, sinks (the online softmax starts from each head's sink logit)
and on sliding layers the window's mask (`graph.LAYERS`, `BODIES`), YaRN RoPE from the host's
table (`host_inputs`). The expert matmul (MXFP4 or FP8 codes from an expert slot, pack group
by pack group) is the layer library's (`mkc.layers.expert_formats`).

What is GPT-OSS's own (`ops`): the router's bias and its top-k softmax over the picked logits
only; each expert's biases and the clamped SwiGLU on its de-interleaved `[gate | up]` halves.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.families.gpt_oss import ops
from mkc.families.gpt_oss.graph import LAYERS
from mkc.layers.expert_formats.lowering import expert_matmul
from mkc.layers.sublayer import body_table
from mkc.model.contracts import lowers
from mkc.runtime import experts as expert_slots
from mkc.runtime import pool
from mkc.runtime.context import Kernel, Layer

F32 = jnp.float32
BODIES = body_table(LAYERS)


@lowers("post_norm")
def post_norm(c: Layer) -> jax.Array:
    return ops.rms_norm(c.refs.x[...], c.vector("post_norm"), c.dims.rms_norm_eps)


# ---- MoE --------------------------------------------------------------------------------------
@lowers("router")
def router(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("router", h)[:, :c.dims.experts] + c.vector("router_bias")


@lowers("route")
def route(c: Layer, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Top-k of the biased logits, softmax over the k picks; this rank's picked local experts
    go to SMEM for their copies."""
    weights, ids = ops.route(router_logits, c.dims.top_k)
    c.select_experts(ids)
    return ids, weights


def _expert_bias(c: Layer, k, name: str) -> jax.Array:
    """Selected expert k's bias row `name` ([1, n] bf16 in its slot) as f32."""
    es = c.kernel.experts
    row, rows, cols = expert_slots.matrix(es, c.refs, k, name)
    return pool.pooled_bf16(getattr(c.refs, es.pool), row, rows, cols).astype(F32)


@lowers("routed_experts")
def routed_experts(c: Layer, h: jax.Array, expert_ids: jax.Array,
                   expert_weights: jax.Array) -> jax.Array:
    """This rank's picked experts on every row, each `down(clamped_swiglu(gate_up h + b)) + b`
    weighted by its routing weight (zero for rows that did not pick it), summed in ascending
    expert order: a partial sum over the ranks."""
    d, p = c.dims, c.per_rank
    half = p["expert_half"]

    def expert(k, acc):
        gate_up = expert_matmul(c, k, h, "gate_up", p["gate_up_group"]) + _expert_bias(c, k, "gate_up_bias")
        act = ops.swiglu_halves(gate_up, half, d.swiglu_alpha, d.swiglu_limit)
        out = expert_matmul(c, k, act, "down", p["down_group"]) + _expert_bias(c, k, "down_bias")
        return acc + c.expert_weight(expert_weights, k) * out

    return c.fold_experts(expert, jnp.zeros((c.B, d.hidden_size), F32))


@lowers("mlp_residual")
def mlp_residual(c: Layer, mlp_out: jax.Array) -> None:
    c.refs.x[...] = c.refs.x[...] + mlp_out


# ---- around the layers ----------------------------------------------------------------------
def prologue(k: Kernel) -> None:
    """After the embedding: nothing beyond the residual stream x (which it filled)."""


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The final norm of the residual stream (head_norm row 0 holds its weight)."""
    return ops.rms_norm(k.refs.x[...], head_norm[0:1, :], k.dims.rms_norm_eps)


def host_inputs(dims, positions: jax.Array) -> dict[str, jax.Array]:
    """The `rope` VMEM input: YaRN cos and sin [2, B, head_dim] at each row's position."""
    return {"rope": ops.rope_table(dims, positions)}
