"""The compute bodies of `GatedDeltaNet` (`op(s, c, *values)`, as `mkc.layers.gqa.lowering`'s)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers import ops
from mkc.layers.gated_delta_net import GatedDeltaNet
from mkc.layers.gated_delta_net.ops import causal_conv_silu, delta_rule_head
from mkc.runtime.context import Layer

F32 = jnp.float32
BF16 = jnp.bfloat16


def input_norm(s: GatedDeltaNet, c: Layer) -> jax.Array:
    return ops.pre_norm(s.norm, c, "input_norm")


def in_proj(s: GatedDeltaNet, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("in_proj", h)


def conv(s: GatedDeltaNet, c: Layer, proj: jax.Array) -> jax.Array:
    """Causal depthwise conv + SiLU over the conv state's taps and this token, a wave of rows at
    a time (a verify step's rows of one sequence follow each other); each row's state entry
    keeps its newest taps. Inputs are rounded to bf16 where they enter the state, as upstream
    caches them."""
    taps, channels = c.dims.linear_conv_kernel_dim, c.per_rank["conv_ch"]
    state = c.state("conv")
    mixed = proj[:, :channels].astype(BF16).astype(F32)
    out = []
    for rows, source in c.waves():
        window = [state[j, source] for j in range(taps - 1)] + [mixed[rows]]
        out.append(causal_conv_silu(window, c.vector("conv_weight")))
        for j in range(taps - 1):
            state[j, rows] = window[j + 1]
    return jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]


def delta_rule(s: GatedDeltaNet, c: Layer, qkv: jax.Array, proj: jax.Array) -> jax.Array:
    """The gated delta rule, row by row and head by head, on the recurrent state (each row
    starts from its sequence's previous row: `Layer.state_source`)."""
    p = c.per_rank
    nk, nv, dk, dv = p["nk"], p["nv"], p["dk"], p["dv"]
    state = c.state("recurrent")
    beta = jax.nn.sigmoid(proj[:, p["b_off"]:p["b_off"] + nv])
    g = -jnp.exp(c.vector("A_log")) * ops.softplus(proj[:, p["a_off"]:p["a_off"] + nv] + c.vector("dt_bias"))
    rows = []
    for b in range(c.B):
        src = c.state_source(b)
        heads = []
        for h in range(nv):
            kh = h // (nv // nk)
            q = ops.l2_normalize(qkv[b:b + 1, kh * dk:(kh + 1) * dk]) * (dk ** -0.5)
            k = ops.l2_normalize(qkv[b:b + 1, nk * dk + kh * dk:nk * dk + (kh + 1) * dk])
            val = qkv[b:b + 1, 2 * nk * dk + h * dv:2 * nk * dk + (h + 1) * dv]
            o, state[b, h] = delta_rule_head(state[src, h], q, k, val, g[b:b + 1, h:h + 1],
                                         beta[b:b + 1, h:h + 1])
            heads.append(o)
        rows.append(jnp.concatenate(heads, axis=-1) if nv > 1 else heads[0])
    return jnp.concatenate(rows, axis=0) if c.B > 1 else rows[0]


def gated_norm(s: GatedDeltaNet, c: Layer, core: jax.Array, proj: jax.Array) -> jax.Array:
    """Per-head RMS norm gated by SiLU(z); z follows q|k|v in in_proj's columns."""
    nv, dv, z_off = c.per_rank["nv"], c.per_rank["dv"], c.per_rank["conv_ch"]
    w, eps = c.vector("norm"), c.dims.rms_norm_eps
    heads = [ops.gated_rms_norm(core[:, h * dv:(h + 1) * dv], proj[:, z_off + h * dv:z_off + (h + 1) * dv],
                                w, eps) for h in range(nv)]
    return jnp.concatenate(heads, axis=-1) if nv > 1 else heads[0]


def out_proj(s: GatedDeltaNet, c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("out_proj", core)[:, :c.dims.hidden_size]


def attn_residual(s: GatedDeltaNet, c: Layer, attn_out: jax.Array) -> None:
    c.refs.x[...] = c.refs.x[...] + attn_out
