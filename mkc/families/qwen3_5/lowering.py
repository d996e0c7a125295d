"""The compute body of every Qwen3.5 decode op, as the generic module calls it.

Each body is `op(c, *values) -> values`: `c` is the layer (`mkc.runtime.context.Layer`); the
values are the op's graph reads and writes that are not tensors (weights, vectors, states,
caches) or the residual stream `x` (a VMEM buffer the body reads and writes itself), in graph
order. Shapes are per rank; sizes come from `c.per_rank` (the graph's) and `c.dims`. Each body
is registered for its op with `@lowers("op")` (`mkc.model.contracts`): the family's lowered ops
are read from those decorators.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.families.qwen3_5 import ops
from mkc.model.contracts import lowers
from mkc.runtime.context import Kernel, Layer

F32 = jnp.float32
BF16 = jnp.bfloat16


def _norm(c: Layer, name: str) -> jax.Array:
    return ops.rms_norm_zero_centred(c.refs.x[...], c.vector(name), c.dims.rms_norm_eps)


@lowers("input_norm")
def input_norm(c: Layer) -> jax.Array:
    return _norm(c, "input_norm")


@lowers("post_norm")
def post_norm(c: Layer) -> jax.Array:
    return _norm(c, "post_norm")


@lowers("in_proj")
def in_proj(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("in_proj", h)


@lowers("qkv_gate")
def qkv_gate(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("qkv_gate", h)


@lowers("gate_up")
def gate_up(c: Layer, h: jax.Array) -> jax.Array:
    return ops.swiglu(c.matmul("gate_up", h), c.per_rank["inter"])


@lowers("down")
def down(c: Layer, act: jax.Array) -> jax.Array:
    return c.matmul("down", act)[:, :c.dims.hidden_size]


@lowers("out_proj")
def out_proj(c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("out_proj", core)[:, :c.dims.hidden_size]


@lowers("o_proj")
def o_proj(c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("o_proj", core)[:, :c.dims.hidden_size]


@lowers("attn_residual")
def attn_residual(c: Layer, attn_out: jax.Array) -> None:
    c.refs.x[...] = c.refs.x[...] + attn_out


@lowers("mlp_residual")
def mlp_residual(c: Layer, mlp_out: jax.Array) -> None:
    c.refs.x[...] = c.refs.x[...] + mlp_out


# ---- gated delta net ------------------------------------------------------------------------
@lowers("conv")
def conv(c: Layer, proj: jax.Array) -> jax.Array:
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
        out.append(ops.causal_conv_silu(window, c.vector("conv_weight")))
        for j in range(taps - 1):
            state[j, rows] = window[j + 1]
    return jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]


@lowers("delta_rule")
def delta_rule(c: Layer, qkv: jax.Array, proj: jax.Array) -> jax.Array:
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
            o, state[b, h] = ops.delta_rule_head(state[src, h], q, k, val, g[b:b + 1, h:h + 1],
                                                 beta[b:b + 1, h:h + 1])
            heads.append(o)
        rows.append(jnp.concatenate(heads, axis=-1) if nv > 1 else heads[0])
    return jnp.concatenate(rows, axis=0) if c.B > 1 else rows[0]


@lowers("gated_norm")
def gated_norm(c: Layer, core: jax.Array, proj: jax.Array) -> jax.Array:
    """Per-head RMS norm gated by SiLU(z); z follows q|k|v in in_proj's columns."""
    nv, dv, z_off = c.per_rank["nv"], c.per_rank["dv"], c.per_rank["conv_ch"]
    w, eps = c.vector("norm"), c.dims.rms_norm_eps
    heads = [ops.gated_rms_norm(core[:, h * dv:(h + 1) * dv], proj[:, z_off + h * dv:z_off + (h + 1) * dv],
                                w, eps) for h in range(nv)]
    return jnp.concatenate(heads, axis=-1) if nv > 1 else heads[0]


# ---- gated attention ------------------------------------------------------------------------
@lowers("qk_norm_rope")
def qk_norm_rope(c: Layer, proj: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per-head RMS norm and partial rotary embedding of q and the new k -> per-head lists."""
    d, nq, nkv = c.dims, c.per_rank["nq"], c.per_rank["nkv"]
    hd, eps = d.head_dim, d.rms_norm_eps
    rot = ops.rotate_half_matrix(hd, d.rotary_dim)
    cos, sin = c.refs.rope[0], c.refs.rope[1]
    qn, kn = c.vector("q_norm"), c.vector("k_norm")
    q = [ops.apply_rope(ops.rms_norm_zero_centred(proj[:, j * hd:(j + 1) * hd], qn, eps), cos, sin, rot)
         for j in range(nq)]
    k_off = 2 * nq * hd
    k_new = [ops.apply_rope(ops.rms_norm_zero_centred(proj[:, k_off + j * hd:k_off + (j + 1) * hd], kn, eps),
                            cos, sin, rot) for j in range(nkv)]
    return q, k_new


@lowers("kv_write")
def kv_write(c: Layer, k_new: list[jax.Array], proj: jax.Array) -> None:
    nq, nkv, hd = c.per_rank["nq"], c.per_rank["nkv"], c.dims.head_dim
    v_off = 2 * nq * hd + nkv * hd
    key = jnp.concatenate(k_new, axis=-1) if nkv > 1 else k_new[0]
    c.kv_write([key, proj[:, v_off:v_off + nkv * hd]])


@lowers("attention")
def attention(c: Layer, q: list[jax.Array]) -> jax.Array:
    """Online softmax per (row, KV head) over its sequence's cached tokens up to the row's
    position (a verify step's rows see each other's new entries, written before: causal). The
    query heads reading one KV head (j * nkv // nq, upstream's `repeat_kv`) go through each
    tile together: its keys and values are loaded into the MXU once for the group, not once
    per head, and as bf16, as the cache holds them (no f32 copy of the tile), with the f32
    queries and probabilities split in three bf16 parts (`ops.split_bf16x3`)."""
    nq, nkv, hd, B = c.per_rank["nq"], c.per_rank["nkv"], c.dims.head_dim, c.B
    scale = hd ** -0.5
    groups = [[j for j in range(nq) if (j * nkv) // nq == g] for g in range(nkv)]
    groups = [g for g in groups if g]
    kvh = [(g[0] * nkv) // nq for g in groups]
    qs = [[ops.split_bf16x3(jnp.concatenate([q[j][b:b + 1] for j in g], axis=0) if len(g) > 1
                            else q[g[0]][b:b + 1]) for g in groups] for b in range(B)]

    def tile(t, tiles, tokens, carry):
        keys, values = tiles
        out = []
        for b in range(B):
            visible = tokens <= c.refs.positions[b]
            kt, vt = keys[c.sequence(b)], values[c.sequence(b)]
            for i, h in enumerate(kvh):
                m, denom, acc = carry[b * len(groups) + i]
                out.append(ops.attention_tile_bf16x3(qs[b][i], kt[:, h * hd:(h + 1) * hd],
                                                     vt[:, h * hd:(h + 1) * hd], visible, m, denom,
                                                     acc, scale))
        return tuple(out)

    init = tuple((jnp.full((len(g), 1), -1e30, F32), jnp.zeros((len(g), 1), F32),
                  jnp.zeros((len(g), hd), F32)) for _ in range(B) for g in groups)
    final = c.kv_fold(tile, init)
    rows = []
    for b in range(B):
        heads = []
        for i, g in enumerate(groups):
            _, denom, acc = final[b * len(groups) + i]
            out = acc / denom
            heads += [out[n:n + 1] for n in range(len(g))]
        rows.append(jnp.concatenate(heads, axis=-1) if nq > 1 else heads[0])
    return jnp.concatenate(rows, axis=0) if B > 1 else rows[0]


@lowers("out_gate")
def out_gate(c: Layer, core: jax.Array, proj: jax.Array) -> jax.Array:
    nq, hd = c.per_rank["nq"], c.dims.head_dim
    return core * jax.nn.sigmoid(proj[:, nq * hd:2 * nq * hd])


# ---- around the layers ----------------------------------------------------------------------
def prologue(k: Kernel) -> None:
    """After the embedding: nothing beyond the residual stream x (which it filled)."""


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The final norm of the residual stream (head_norm row 0 holds its weight)."""
    return ops.rms_norm_zero_centred(k.refs.x[...], head_norm[0:1, :], k.dims.rms_norm_eps)


def rope_table(dims, positions: jax.Array) -> jax.Array:
    """The `rope` VMEM input: cos/sin rows [2, B, head_dim] for each row's position, 1 and 0
    past the rotary dims."""
    hd, rd = dims.head_dim, dims.rotary_dim
    inv_freq = 1.0 / (dims.rope_theta ** (jnp.arange(0, rd, 2, dtype=F32) / rd))
    ang = positions.astype(F32)[:, None] * inv_freq[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    pad = hd - rd
    cos = jnp.concatenate([jnp.cos(ang), jnp.ones((positions.shape[0], pad), F32)], axis=-1)
    sin = jnp.concatenate([jnp.sin(ang), jnp.zeros((positions.shape[0], pad), F32)], axis=-1)
    return jnp.stack([cos, sin])


def host_inputs(dims, positions: jax.Array) -> dict[str, jax.Array]:
    """The VMEM inputs the host computes per step (FAMILY.vmem_inputs declares their shapes)."""
    return {"rope": rope_table(dims, positions)}



