"""The compute bodies of `KDA`, each `op(s, c, *values)` with the kind's options `s` bound by
`Sublayer.bodies` (`c`: `mkc.runtime.context.Layer`). The projection's columns are `[q | k | v
| g | b]` on this rank's heads (`mkc.layers.kda.weights`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers import ops
from mkc.layers.kda import KDA
from mkc.layers.kda import ops as kda_ops
from mkc.runtime.context import Layer

F32 = jnp.float32
BF16 = jnp.bfloat16


def input_norm(s: KDA, c: Layer) -> jax.Array:
    return ops.pre_norm("plain", c, "input_norm")


def gate_down(s: KDA, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("gate_down", h)


def gate_up(s: KDA, c: Layer, gate_low: jax.Array) -> jax.Array:
    return c.matmul("gate_up", gate_low)


def projection(s: KDA, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("projection", h)


def conv(s: KDA, c: Layer, proj: jax.Array) -> jax.Array:
    """Causal depthwise conv + SiLU over q|k|v, a wave of rows at a time (`Layer.waves`); they
    enter the conv state as bf16, as the reference caches them."""
    width = c.per_rank["heads"] * c.dims.kda_head_dim
    taps = c.dims.conv_kernel_size
    state = c.state("conv")
    mixed = proj[:, :3 * width].astype(BF16)
    w = c.vector("conv_weight")
    out = []
    for rows, source in c.waves():
        window = [state[j, source] for j in range(taps - 1)] + [mixed[rows]]
        acc = window[0].astype(F32) * w[0:1]
        for j in range(1, taps):
            acc = acc + window[j].astype(F32) * w[j:j + 1]
        for j in range(taps - 1):
            state[j, rows] = window[j + 1]
        out.append(jax.nn.silu(acc))
    return jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]


def delta_rule(s: KDA, c: Layer, qkv: jax.Array, gate: jax.Array, proj: jax.Array) -> jax.Array:
    """The delta rule, row by row and head by head, on the recurrent state (each row starts
    from its sequence's previous row: `Layer.state_source`)."""
    heads, hd = c.per_rank["heads"], c.dims.kda_head_dim
    width = heads * hd
    state = c.state("recurrent")
    decay = kda_ops.log_decay(gate, c.vector("a_log"), c.vector("dt_bias"), c.dims.gate_lower_bound)
    beta = jax.nn.sigmoid(proj[:, 4 * width:4 * width + heads])
    rows = []
    for b in range(c.B):
        outs = []
        for h in range(heads):
            lanes = slice(h * hd, (h + 1) * hd)
            q = ops.l2_normalize(qkv[b:b + 1, lanes]) * (hd ** -0.5)
            k = ops.l2_normalize(qkv[b:b + 1, width + h * hd:width + (h + 1) * hd])
            val = qkv[b:b + 1, 2 * width + h * hd:2 * width + (h + 1) * hd]
            o, state[b, h] = kda_ops.delta_rule_head(state[c.state_source(b), h], q, k, val,
                                                     decay[b:b + 1, lanes], beta[b:b + 1, h:h + 1])
            outs.append(o)
        rows.append(jnp.concatenate(outs, axis=-1) if heads > 1 else outs[0])
    return jnp.concatenate(rows, axis=0) if c.B > 1 else rows[0]


def gated_norm(s: KDA, c: Layer, core: jax.Array, proj: jax.Array) -> jax.Array:
    """Per-head RMS norm gated by sigmoid(g); g follows q|k|v in the projection's columns."""
    heads, hd = c.per_rank["heads"], c.dims.kda_head_dim
    w, g_off = c.vector("o_norm"), 3 * heads * hd
    return jnp.concatenate([
        kda_ops.gated_output(core[:, h * hd:(h + 1) * hd], proj[:, g_off + h * hd:g_off + (h + 1) * hd], w,
                             c.dims.rms_norm_eps)
        for h in range(heads)], axis=-1)


def o_proj(s: KDA, c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("o_proj", core)[:, :c.dims.hidden_size]


def attn_residual(s: KDA, c: Layer, attn_out: jax.Array) -> None:
    c.refs.x[...] = c.refs.x[...] + attn_out
