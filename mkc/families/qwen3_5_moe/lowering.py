"""The compute body of every Qwen3.5 MoE decode op (`mkc.families.qwen3_5.lowering` has the
convention). The attention sublayers are the layer library's, composed as Qwen3.5's
(`graph.LAYERS`, `BODIES`); the MoE sublayer's bodies are here."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.families.kimi_k3.lowering import _expert_matmul as _coded_expert_matmul
from mkc.families.qwen3_5.lowering import final_hidden, host_inputs, prologue  # noqa: F401
from mkc.families.qwen3_5_moe import ops
from mkc.families.qwen3_5_moe.graph import LAYERS
from mkc.layers import ops as qwen_ops
from mkc.layers.sublayer import body_table
from mkc.model.contracts import lowers
from mkc.runtime.context import Layer

F32 = jnp.float32
BF16 = jnp.bfloat16
BODIES = body_table(LAYERS)


@lowers("post_norm")
def post_norm(c: Layer) -> jax.Array:
    return qwen_ops.pre_norm("zero_centred", c, "post_norm")


@lowers("router")
def router(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("router", h)[:, :c.dims.experts]


@lowers("route")
def route(c: Layer, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k; this rank's picked local experts go to SMEM for their copies."""
    weights, ids = ops.route(router_logits, c.dims.top_k)
    c.select_experts(ids)
    return ids, weights


@lowers("shared_gate_up")
def shared_gate_up(c: Layer, h: jax.Array) -> jax.Array:
    return qwen_ops.swiglu(c.matmul("shared_gate_up", h), c.per_rank["shared"])


@lowers("shared_down")
def shared_down(c: Layer, shared_act: jax.Array) -> jax.Array:
    return c.matmul("shared_down", shared_act)[:, :c.dims.hidden_size]


def _expert_matmul(c: Layer, k, name: str, x: jax.Array) -> jax.Array:
    """x @ selected expert k's matrix `name` in the spec's format: bf16 from its slot, or FP8
    codes fed to the MXU as they are, one mixed bf16 x fp8 dot a pack group, the block's scale
    multiplying its partial product (Kimi K3's expert matmul, the one home of that dot)."""
    if c.kernel.formats[f"expert.{name}"].name == "bf16":
        return c.expert_matmul(k, name, x)
    return _coded_expert_matmul(c, k, x, name, c.per_rank[f"{name}_group"])


@lowers("routed_experts")
def routed_experts(c: Layer, h: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array) -> jax.Array:
    """This rank's picked experts on every row, each weighted by its routing weight (zero for
    rows that did not pick it), summed in ascending expert order: a partial sum over ranks."""
    width = c.dims.moe_intermediate_size

    def expert(k, acc):
        act = qwen_ops.swiglu(_expert_matmul(c, k, "gate_up", h), width)
        return acc + c.expert_weight(expert_weights, k) * _expert_matmul(c, k, "down", act)

    return c.fold_experts(expert, jnp.zeros((c.B, c.dims.hidden_size), F32))


@lowers("mlp_residual")
def mlp_residual(c: Layer, shared_out: jax.Array, routed_out: jax.Array, h: jax.Array) -> None:
    """x += routed + sigmoid(h . shared_gate) * shared (the gate's input rounded to bf16, as
    the MXU would take it)."""
    hb = h.astype(BF16).astype(F32)
    gate = jax.nn.sigmoid(jnp.sum(hb * c.vector("shared_gate"), axis=-1, keepdims=True))
    c.refs.x[...] = c.refs.x[...] + routed_out + gate * shared_out
