"""The compute bodies of `MoE` (`op(s, c, *values)`, as `mkc.layers.gqa.lowering`'s), and the
kernel math of its routing and FP8 experts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from mkc.layers import ops
from mkc.layers.moe import MoE, feeds_codes
from mkc.runtime import experts as expert_slots
from mkc.runtime import pool
from mkc.runtime.context import Layer

F32 = jnp.float32
BF16 = jnp.bfloat16
SCALE_NAN = 255        # the E8M0 byte that encodes NaN


def route_weights(logits: jax.Array, top_k: int, renormalise: bool) -> tuple[jax.Array, jax.Array]:
    """Softmax top-k routing per row -> (weights [B, E], ids [B, top_k] int32): weights is zero
    except at the picked experts, where it holds their softmax probabilities, divided by their
    sum when `renormalise`; ids lists the picks best first, ties to the lowest index
    (`mkc.runtime.experts.top_k`)."""
    probs = jax.nn.softmax(logits.astype(F32), axis=-1)
    kept, ids = expert_slots.top_k(probs, probs, top_k)
    return (kept / jnp.sum(kept, axis=-1, keepdims=True) if renormalise else kept), ids


def e8m0_scale(scales: jax.Array) -> jax.Array:
    """E8M0 scales (uint8) -> f32 2**(s - 127) for s 1..254; 255 is NaN, and 0 (2**-127, itself
    subnormal, which TPUs flush) is zero, said here rather than left to the hardware."""
    s = scales.astype(jnp.int32)
    scale = lax.bitcast_convert_type(s << 23, F32)
    scale = jnp.where(s == 0, 0.0, scale)
    return jnp.where(s == SCALE_NAN, F32(jnp.nan), scale)


def fp8_group_matmul(x: jax.Array, codes: jax.Array, scale: jax.Array, as_codes: bool = True
                     ) -> jax.Array:
    """x [B, G] bf16 @ FP8 codes (uint8 [G, N], float8_e4m3fn bytes) whose rows share the
    ``scale`` [1, N] (f32) -> f32 [B, N]: one mixed bf16 x fp8 dot (`as_codes` False: the codes
    converted to bf16 first, where the MXU takes no FP8 operand), the power-of-two scale applied
    to the partial product rather than to every value. On a CPU (interpret mode) XLA multiplies
    both operands as f32, which `mixed_fp8` in ``mkc.reference.rounding`` follows."""
    w = lax.bitcast_convert_type(codes, jnp.float8_e4m3fn)
    w = w if as_codes else w.astype(BF16)
    return jnp.dot(x, w, preferred_element_type=F32) * scale


def coded_expert_matmul(c: Layer, k, x: jax.Array, name: str, group: int) -> jax.Array:
    """x @ selected expert k's FP8 matrix `name` (codes and scales in its slot), one pack group
    of `group` input rows at a time, its block's scale multiplying the group's partial
    product (every block's scale decoded at once: a row at a time costs as many registers)."""
    slots, buf = c.kernel.experts, getattr(c.refs, c.kernel.experts.pool)
    c_row, c_rows, c_cols = expert_slots.matrix(slots, c.refs, k, name + "_codes")
    scales = expert_slots.read_u8(slots, c.refs, k, name + "_scales")
    fmt = c.kernel.formats[f"expert.{name}"]
    decoded = e8m0_scale(scales)
    out = None
    for g in range(x.shape[1] // group):
        xg = x[:, g * group:(g + 1) * group].astype(BF16)
        codes = pool.pooled_u8(buf, c_row, c_rows, c_cols, first=g * group, count=group)
        b = g * group // fmt.block
        part = fp8_group_matmul(xg, codes, decoded[b:b + 1], feeds_codes(fmt))
        out = part if out is None else out + part
    return out


def _expert_matmul(c: Layer, k, name: str, x: jax.Array) -> jax.Array:
    """x @ selected expert k's matrix `name` in the spec's format: bf16 from its slot, or FP8."""
    if c.kernel.formats[f"expert.{name}"].name == "bf16":
        return c.expert_matmul(k, name, x)
    return coded_expert_matmul(c, k, x, name, c.per_rank[f"{name}_group"])


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
    width = c.dims.moe_intermediate_size

    def expert(k, acc):
        act = ops.swiglu(_expert_matmul(c, k, "gate_up", h), width)
        return acc + c.expert_weight(expert_weights, k) * _expert_matmul(c, k, "down", act)

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
