"""The compute body of every GPT-OSS decode op, as the generic module calls it
(`mkc.families.qwen3_5.lowering` has the convention).

A model layer runs as two sublayers of the layer loop: attention (`swa` on sliding layers,
`gqa` on full ones: the same bodies), then the MoE (`moe`). Kimi K3's expert matmul (MXFP4
or FP8 codes decoded from an expert slot, pack group by pack group) is reused.

What is GPT-OSS's own (`ops`): the plain-weight RMS norm; q, k and v biases added to the
projection; YaRN RoPE from the host's table (`host_inputs`) on whole heads; attention as an
online softmax that starts from each head's sink logit (`ops.sink_start`); o_proj's bias
added once, after the heads' all-reduce (`attn_residual`); the router's bias and its top-k
softmax over the picked logits only; each expert's biases and the clamped SwiGLU on its
de-interleaved `[gate | up]` halves.

A sliding layer's KV cache is the window's KV ring when its phase declares one (`kv ring N
slots`: position p in slot p % N, the core's mechanism, `mkc.runtime.kv`), else the core's
per-token cache of a context at most the window (`graph.window_limit`); either way its body
masks each slot by the absolute position it holds to the window (`p - W < q <= p`).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from mkc.families.gpt_oss import ops
from mkc.families.kimi_k3.lowering import _expert_matmul
from mkc.model.contracts import lowers
from mkc.runtime import experts as expert_slots
from mkc.runtime import pool
from mkc.runtime.context import Kernel, Layer

F32 = jnp.float32


def _norm(c: Layer, name: str) -> jax.Array:
    return ops.rms_norm(c.refs.x[...], c.vector(name), c.dims.rms_norm_eps)


@lowers("input_norm")
def input_norm(c: Layer) -> jax.Array:
    return _norm(c, "input_norm")


@lowers("post_norm")
def post_norm(c: Layer) -> jax.Array:
    return _norm(c, "post_norm")


# ---- attention (swa and gqa) -----------------------------------------------------------------
@lowers("qkv")
def qkv(c: Layer, h: jax.Array) -> jax.Array:
    """[q | k | v] of this part's heads, with their biases."""
    return c.matmul("qkv", h)[:, :c.per_rank["qkv_cols"]] + c.vector("qkv_bias")


@lowers("rope")
def rope(c: Layer, proj: jax.Array) -> tuple[list[jax.Array], list[jax.Array]]:
    """YaRN rotary embedding of each query head and each new key head -> per-head lists."""
    nq, nkv, hd = c.per_rank["nq"], c.per_rank["nkv"], c.dims.head_dim
    cos, sin = c.refs.rope[0], c.refs.rope[1]
    return (ops.rope_heads(proj[:, :nq * hd], nq, hd, cos, sin),
            ops.rope_heads(proj[:, nq * hd:(nq + nkv) * hd], nkv, hd, cos, sin))


@lowers("kv_write")
def kv_write(c: Layer, k_new: list[jax.Array], proj: jax.Array) -> None:
    nq, nkv, hd = c.per_rank["nq"], c.per_rank["nkv"], c.dims.head_dim
    key = jnp.concatenate(k_new, axis=-1) if nkv > 1 else k_new[0]
    c.kv_write([key, proj[:, (nq + nkv) * hd:(nq + 2 * nkv) * hd]])


def _visible(c: Layer, tokens: jax.Array, position) -> jax.Array:
    """Cache slots row `position` attends, by the absolute position each holds
    (`Layer.kv_positions`: the slot itself, or in a sliding layer's KV ring the latest position
    written to it): written, upstream's causal mask, and on a sliding layer its window."""
    held = c.kv_positions(tokens, position)
    visible = (held >= 0) & ops.full_visible(held, position)
    if c.kind == "swa":
        visible = visible & (held > position - c.dims.sliding_window)
    return visible


@lowers("attention")
def attention(c: Layer, q: list[jax.Array]) -> jax.Array:
    """Online softmax per (row, query head) over its sequence's cached tokens, started from
    the head's sink logit (which joins the denominator only); query head j of this part reads
    its KV head (j * nkv) // nq, upstream's `repeat_kv`."""
    nq, nkv, hd, B = c.per_rank["nq"], c.per_rank["nkv"], c.dims.head_dim, c.B
    scale = hd ** -0.5
    sinks = c.vector("sinks")

    def tile(t, tiles, tokens, carry):
        keys, values = tiles
        out = []
        for b in range(B):
            visible = _visible(c, tokens, c.refs.positions[b])
            kt, vt = keys[c.sequence(b)], values[c.sequence(b)]
            for j in range(nq):
                kvh = (j * nkv) // nq
                m, denom, acc = carry[b * nq + j]
                out.append(ops.attention_tile(q[j][b:b + 1], kt[:, kvh * hd:(kvh + 1) * hd],
                                              vt[:, kvh * hd:(kvh + 1) * hd], visible, m, denom, acc,
                                              scale))
        return tuple(out)

    init = tuple(ops.sink_start(sinks[:, j:j + 1], hd) for _ in range(B) for j in range(nq))
    final = c.kv_fold(tile, init)
    rows = []
    for b in range(B):
        heads = [ops.attention_finish(final[b * nq + j][1], final[b * nq + j][2]) for j in range(nq)]
        rows.append(jnp.concatenate(heads, axis=-1) if nq > 1 else heads[0])
    return jnp.concatenate(rows, axis=0) if B > 1 else rows[0]


@lowers("o_proj")
def o_proj(c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("o_proj", core)[:, :c.dims.hidden_size]


@lowers("attn_residual")
def attn_residual(c: Layer, attn_out: jax.Array) -> None:
    """x += o_proj's all-reduced product plus its bias (added once, after the reduce)."""
    c.refs.x[...] = c.refs.x[...] + (attn_out + c.vector("o_bias"))


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
        gate_up = _expert_matmul(c, k, h, "gate_up", p["gate_up_group"]) + _expert_bias(c, k, "gate_up_bias")
        act = ops.swiglu_halves(gate_up, half, d.swiglu_alpha, d.swiglu_limit)
        out = _expert_matmul(c, k, act, "down", p["down_group"]) + _expert_bias(c, k, "down_bias")
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
