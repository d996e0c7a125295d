"""The compute bodies of `MoE` (`op(s, c, *values)`, as `mkc.layers.gqa.lowering`'s), and the
kernel math of its routing; its experts' formats are `mkc.layers.expert_formats`'."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers import ops
from mkc.layers.expert_formats.lowering import expert_matmul
from mkc.layers.moe import MoE
from mkc.runtime import experts as expert_slots
from mkc.runtime.context import Layer

F32 = jnp.float32
BF16 = jnp.bfloat16


def route_weights(logits: jax.Array, top_k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing per row -> (weights [B, E], ids [B, top_k] int32): weights is zero
    except at the picked experts, where it holds their softmax probabilities, divided by their
    sum when `renormalise`; ids lists the picks best first, ties to the lowest index
    (`mkc.runtime.experts.top_k`)."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    kept, ids = expert_slots.top_k(probs, probs, top_k)
    return (kept / jnp.sum(kept, axis=-1, keepdims=True) if renormalise else kept), ids


def post_norm(s: MoE, c: Layer) -> jax.Array:
    return ops.pre_norm(s.norm, c, "post_norm")


def router(s: MoE, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("router", h)[:, :c.dims.experts]


def route(s: MoE, c: Layer, router_logits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k; this rank's picked local experts go to SMEM for their copies."""
    weights, ids = route_weights(router_logits, c.dims.top_k, c.dims.norm_topk_prob)
    c.select_experts(ids)
    return ids, weights


def shared_gate_up(s: MoE, c: Layer, h: jax.Array) -> jax.Array:
    return ops.swiglu(c.matmul("shared_gate_up", h), c.per_rank["shared"])


def shared_down(s: MoE, c: Layer, shared_act: jax.Array) -> jax.Array:
    return c.matmul("shared_down", shared_act)[:, :c.dims.hidden_size]


def routed_experts(s: MoE, c: Layer, h: jax.Array, expert_ids: jax.Array, expert_weights: jax.Array
                   ) -> jax.Array:
    """This rank's picked experts on every row, each weighted by its routing weight (zero for
    rows that did not pick it), summed in ascending expert order: a partial sum over ranks."""
    width, groups = c.dims.moe_intermediate_size, c.per_rank

    def expert(k, acc):
        act = ops.swiglu(expert_matmul(c, k, h, "gate_up", groups["gate_up_group"]), width)
        return acc + c.expert_weight(expert_weights, k) * expert_matmul(c, k, act, "down",
                                                                         groups["down_group"])

    return c.fold_experts(expert, jnp.zeros((c.B, c.dims.hidden_size), F32))


def mlp_residual(s: MoE, c: Layer, *values: jax.Array) -> None:
    """x += routed (+ sigmoid(h . shared_gate) * shared, the gate's input rounded to bf16, as
    the MXU would take it): values are (shared_out, routed_out, h) with a shared expert, else
    (routed_out,)."""
    if not s.shared_expert:
        (routed_out,) = values
        c.refs.x[...] = c.refs.x[...] + routed_out
        return
    shared_out, routed_out, h = values
    hb = h.astype(BF16).astype(F32)
    gate = jax.nn.sigmoid(jnp.sum(hb * c.vector("shared_gate"), axis=-1, keepdims=True))
    c.refs.x[...] = c.refs.x[...] + routed_out + gate * shared_out
