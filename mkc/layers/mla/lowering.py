"""The compute bodies of `MLA`, each `op(s, c, *values)` with the kind's options `s` bound by
`Sublayer.bodies` (`c`: `mkc.runtime.context.Layer`). q_down, kv_down and key_up, value_up
are read whole (`c.pooled` for the two the query absorbs: a spec keeps them in a pool view);
with `rope` the rotary table is the module's `rope` VMEM input (`mkc.layers.rope.host_inputs`,
qk_rope_head_dim wide)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.layers import ops
from mkc.layers.mla import MLA, softmax_scale
from mkc.layers.mla import ops as mla_ops
from mkc.runtime.context import Layer

F32 = jnp.float32


def _rotate(c: Layer, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate-half RoPE of x [n, rope] at cos, sin [1 or n, rope]."""
    rope = c.dims.qk_rope_head_dim
    return ops.apply_rope(x, cos, sin, ops.rotate_half_matrix(rope, rope))


def input_norm(s: MLA, c: Layer) -> jax.Array:
    return ops.pre_norm("plain", c, "input_norm")


def q_down(s: MLA, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("q_down", h)


def kv_down(s: MLA, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("kv_down", h)


def latent_norms(s: MLA, c: Layer, q_low: jax.Array, kv_row: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The q latent's and the kv latent's RMS norms; with `rope` the row's shared key part
    rotated at its position (the cache holds it rotated)."""
    eps, lora = c.dims.rms_norm_eps, c.dims.kv_lora_rank
    normed = ops.rms_norm(kv_row[:, :lora], c.vector("kv_norm"), eps)
    q_normed = ops.rms_norm(q_low, c.vector("q_norm"), eps)
    rest = kv_row[:, lora:]
    if s.rope:
        rope = c.dims.qk_rope_head_dim
        rest = jnp.concatenate([_rotate(c, rest[:, :rope], c.refs.rope[0], c.refs.rope[1]),
                                rest[:, rope:]], axis=-1)
    return q_normed, jnp.concatenate([normed, rest], axis=-1)


def kv_write(s: MLA, c: Layer, kv_row: jax.Array) -> None:
    c.kv_write([kv_row])


def q_up(s: MLA, c: Layer, q_low: jax.Array) -> jax.Array:
    d = c.dims
    return c.matmul("q_up", q_low)[:, :c.per_rank["heads"] * (d.qk_nope_head_dim + d.qk_rope_head_dim)]


def absorb_query(s: MLA, c: Layer, q: jax.Array) -> list:
    """Per row: the query's nope part absorbed into the latent space by key_up, and its rope
    part (rotated at the row's position with `rope`)."""
    heads, nope, rope = c.per_rank["heads"], c.dims.qk_nope_head_dim, c.dims.qk_rope_head_dim
    width = heads * nope
    w_uk = c.pooled("key_up")
    out = [mla_ops.mla_absorb_query(q[b:b + 1, :width], q[b:b + 1, width:width + heads * rope], w_uk, heads)
           for b in range(c.B)]
    if s.rope:
        cos, sin = c.refs.rope[0], c.refs.rope[1]
        out = [(q_lat, _rotate(c, q_ext, cos[b:b + 1], sin[b:b + 1])) for b, (q_lat, q_ext) in enumerate(out)]
    return out


def attention(s: MLA, c: Layer, q_lat: list) -> list:
    """Online softmax per row over this rank's heads and its sequence's cached latent tokens up
    to the row's position -> per row (latent average accumulator, denominator)."""
    heads, lora, extra = c.per_rank["heads"], c.dims.kv_lora_rank, c.dims.qk_rope_head_dim
    scale = softmax_scale(c.dims)

    def tile(t, tiles, tokens, carry):
        (latent,) = tiles
        out = []
        for b in range(c.B):
            cached = latent[c.sequence(b)]
            m, denom, acc = carry[b]
            q, q_extra = q_lat[b]
            out.append(mla_ops.mla_tile(q, q_extra, cached[:, :lora], cached[:, lora:lora + extra],
                                        tokens <= c.refs.positions[b], m, denom, acc, scale))
        return tuple(out)

    init = tuple((jnp.full((heads, 1), -jnp.inf, F32), jnp.zeros((heads, 1), F32),
                  jnp.zeros((heads, lora), F32)) for _ in range(c.B))
    return [(acc, denom) for m, denom, acc in c.kv_fold(tile, init)]


def values_out(s: MLA, c: Layer, lat_avg: list) -> jax.Array:
    w_uv = c.pooled("value_up")
    outs = [mla_ops.mla_value_up(acc, denom, w_uv, c.per_rank["heads"]) for acc, denom in lat_avg]
    return jnp.concatenate(outs, axis=0) if c.B > 1 else outs[0]


def gate(s: MLA, c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("gate", h)[:, :c.per_rank["heads"] * c.dims.v_head_dim]


def out_gate(s: MLA, c: Layer, core: jax.Array, gate_logits: jax.Array) -> jax.Array:
    return core * jax.nn.sigmoid(gate_logits)


def o_proj(s: MLA, c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("o_proj", core)[:, :c.dims.hidden_size]


def attn_residual(s: MLA, c: Layer, attn_out: jax.Array) -> None:
    c.refs.x[...] = c.refs.x[...] + attn_out
