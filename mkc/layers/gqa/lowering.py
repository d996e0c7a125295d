"""The compute bodies of `GQA`, each `op(s, c, *values)` with the kind's options `s` bound by
`Sublayer.bodies` (`c`: `mkc.runtime.context.Layer`; the convention is
`mkc.families.qwen3_5.lowering`'s). The rotary table is the module's `rope` VMEM input
(`mkc.layers.rope.host_inputs`)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers import ops
from mkc.layers.gqa import GQA, softmax_scale
from mkc.runtime.context import Layer

F32 = jnp.float32


def input_norm(s: GQA, c: Layer) -> jax.Array:
    return ops.pre_norm(s.norm, c, "input_norm")


def qkv(s: GQA, c: Layer, h: jax.Array) -> jax.Array:
    """[q | k | v] of this part's heads (with their biases)."""
    if s.bias:
        return c.matmul("qkv", h)[:, :c.per_rank["qkv_cols"]] + c.vector("qkv_bias")
    return c.matmul("qkv", h)


def qkv_gate(s: GQA, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("qkv_gate", h)


def _k_offset(s: GQA, c: Layer) -> int:
    return (2 if s.output_gate else 1) * c.per_rank["nq"] * c.dims.head_dim


def _heads(s: GQA, c: Layer, proj: jax.Array, head=lambda x, w: x
           ) -> tuple[list[jax.Array], list[jax.Array]]:
    """`head(x, weight)` of each query head's and new key head's columns of the projection
    (the weight of its q or k norm, None without one) -> per-head lists."""
    nq, nkv, hd = c.per_rank["nq"], c.per_rank["nkv"], c.dims.head_dim
    qw, kw = (c.vector(n) for n in s.qk_weights) if s.qk_weights else (None, None)
    k_off = _k_offset(s, c)
    return ([head(proj[:, j * hd:(j + 1) * hd], qw) for j in range(nq)],
            [head(proj[:, k_off + j * hd:k_off + (j + 1) * hd], kw) for j in range(nkv)])


def _qk_norm(s: GQA, c: Layer):
    """One head's q/k norm, `norm(x, weight)`: weighted (`s.qk_norm`'s weight) or weightless."""
    eps = c.dims.rms_norm_eps
    if s.qk_norm == "weightless":
        return lambda x, w: ops.rms_norm_weightless(x, eps)
    return lambda x, w: ops.NORM[s.qk_norm](x, w, eps)


def _rotation(c: Layer):
    """One head's (partial) rotary embedding at each row's position (the host's table)."""
    rot = ops.rotate_half_matrix(c.dims.head_dim, c.dims.rotary_dim)
    cos, sin = c.refs.rope[0], c.refs.rope[1]
    return lambda x: ops.apply_rope(x, cos, sin, rot)


def qk_norm_rope(s: GQA, c: Layer, proj: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """Per-head RMS norm and (partial) rotary embedding of q and the new k -> per-head lists."""
    norm, rotate = _qk_norm(s, c), _rotation(c)
    return _heads(s, c, proj, lambda x, w: rotate(norm(x, w)))


def rope(s: GQA, c: Layer, proj: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """Rotary embedding of q and the new k, head by head -> per-head lists."""
    rotate = _rotation(c)
    return _heads(s, c, proj, lambda x, w: rotate(x))


def qk_norm(s: GQA, c: Layer, proj: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """A NoPE kind's per-head RMS norm of q and the new k (no rotation) -> per-head lists. Muse
    Spark's full layers (`MuseSparkTextAttention.forward`: q and k normed per head, q times
    `qk_scale_factor`, here in the scores' scale, `softmax_scale`; no position embeddings)."""
    return _heads(s, c, proj, _qk_norm(s, c))


def split_heads(s: GQA, c: Layer, proj: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """A NoPE kind's q and new k as they are projected -> per-head lists."""
    return _heads(s, c, proj)


def kv_write(s: GQA, c: Layer, k_new: list[jax.Array], proj: jax.Array) -> None:
    nkv, hd = c.per_rank["nkv"], c.dims.head_dim
    v_off = _k_offset(s, c) + nkv * hd
    key = jnp.concatenate(k_new, axis=-1) if nkv > 1 else k_new[0]
    c.kv_write([key, proj[:, v_off:v_off + nkv * hd]])


def _visible(s: GQA, c: Layer, tokens: jax.Array, position) -> jax.Array:
    """Cache slots a row at `position` attends: up to its position (upstream's causal mask);
    on a sliding kind by the absolute position each slot holds (`Layer.kv_positions`: the
    slot itself, or in a window's KV ring the latest position written to it), written and
    within the window (`p - W < q <= p`)."""
    if not s.sliding:
        return tokens <= position
    held = c.kv_positions(tokens, position)
    return (held >= 0) & (held <= position) & (held > position - c.dims.sliding_window)


def _start(s: GQA, c: Layer, group: list[int]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The online softmax's carry (running max, denominator, accumulator) of a group of query
    heads before any KV tile; with sinks, each head's sink logit as a key of a zero value (it
    adds exp(sink) to the denominator only, as upstream's dropped sink column does; starting
    from it cannot overflow, the max includes it)."""
    n, hd = len(group), c.dims.head_dim
    if not s.sinks:
        return jnp.full((n, 1), -1e30, F32), jnp.zeros((n, 1), F32), jnp.zeros((n, hd), F32)
    sinks = c.vector("sinks")
    m = jnp.concatenate([sinks[:, j:j + 1] for j in group], axis=0)
    return m.astype(F32), jnp.ones((n, 1), F32), jnp.zeros((n, hd), F32)


def attention(s: GQA, c: Layer, q: list[jax.Array]) -> jax.Array:
    """Online softmax per (row, KV head) over its sequence's cached tokens up to the row's
    position (a verify step's rows see each other's new entries, written before: causal). The
    query heads reading one KV head (j * nkv // nq, upstream's `repeat_kv`) go through each
    tile together: its keys and values are loaded into the MXU once for the group, not once
    per head, and as bf16, as the cache holds them (no f32 copy of the tile), with the f32
    queries and probabilities split in three bf16 parts (`ops.split_bf16x3`)."""
    nq, nkv, hd, B = c.per_rank["nq"], c.per_rank["nkv"], c.dims.head_dim, c.B
    scale = softmax_scale(c.dims)
    groups = [[j for j in range(nq) if (j * nkv) // nq == g] for g in range(nkv)]
    groups = [g for g in groups if g]
    kvh = [(g[0] * nkv) // nq for g in groups]
    qs = [[ops.split_bf16x3(jnp.concatenate([q[j][b:b + 1] for j in g], axis=0) if len(g) > 1
                            else q[g[0]][b:b + 1]) for g in groups] for b in range(B)]

    def tile(t, tiles, tokens, carry):
        keys, values = tiles
        out = []
        for b in range(B):
            visible = _visible(s, c, tokens, c.refs.positions[b])
            kt, vt = keys[c.sequence(b)], values[c.sequence(b)]
            for i, h in enumerate(kvh):
                m, denom, acc = carry[b * len(groups) + i]
                out.append(ops.attention_tile_bf16x3(qs[b][i], kt[:, h * hd:(h + 1) * hd],
                                                     vt[:, h * hd:(h + 1) * hd], visible, m, denom,
                                                     acc, scale))
        return tuple(out)

    init = tuple(_start(s, c, g) for _ in range(B) for g in groups)
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


def out_gate(s: GQA, c: Layer, core: jax.Array, proj: jax.Array) -> jax.Array:
    """The attention output times the sigmoid of its gate (the projection's gate columns):
    Qwen3.5's as it is; Muse Spark's RMS-normed first, head by head, without a weight, eps
    `rms_norm_eps` (`MuseSparkTextAttention.forward`: `o_norm(attn_output) * sigmoid(gate_proj(
    hidden_states))`, then o_proj; the hand kernel's `attention_layer` likewise, in f32)."""
    nq, hd = c.per_rank["nq"], c.dims.head_dim
    gate = jax.nn.sigmoid(proj[:, nq * hd:2 * nq * hd])
    if s.output_gate == "q_proj":
        return core * gate
    eps = c.dims.rms_norm_eps
    heads = [ops.rms_norm_weightless(core[:, j * hd:(j + 1) * hd], eps) for j in range(nq)]
    return (jnp.concatenate(heads, axis=-1) if nq > 1 else heads[0]) * gate


def o_proj(s: GQA, c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("o_proj", core)[:, :c.dims.hidden_size]


def attn_residual(s: GQA, c: Layer, attn_out: jax.Array) -> None:
    """x += o_proj's all-reduced product (plus its bias, added once, after the reduce)."""
    if s.o_bias:
        c.refs.x[...] = c.refs.x[...] + (attn_out + c.vector("o_bias"))
    else:
        c.refs.x[...] = c.refs.x[...] + attn_out
