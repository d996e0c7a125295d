"""The compute body of every Kimi K3 decode op, as the generic module calls it
(`mkc.families.qwen3_5.lowering` has the convention).

A K3 layer runs as two sublayers of the layer loop: attention (`kda` or `mla`), then the MLP
(`dense` in layer 0, `moe` after). The residual stream is block attention residuals: `blocks`
(VMEM) holds the embedding, each completed block's sum and the block being filled; every
sublayer's input is a learned mixture of them, and its output is added to the open block.
Attention projections come from the pool's weight view, MoE experts (MXFP4) from its expert
slots, every other matrix from the ring: `c.matmul` serves whichever the schedule chose.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mkc.families.kimi_k3 import ops
from mkc.layers.expert_formats import pack_groups
from mkc.layers.expert_formats.lowering import expert_matmul
from mkc.model.contracts import lowers
from mkc.runtime.context import Kernel, Layer

F32 = jnp.float32
BF16 = jnp.bfloat16


# ---- block attention residuals ------------------------------------------------------------
def _sources(k: Kernel, layer):
    """(slot of the block being filled, sources to mix) for loop layer `layer`: blocks 0 .. n-1
    are complete (block 0 is the embedding), slot n holds the partial sum, empty at the
    attention sublayer of a layer that opens a block."""
    model_layer = lax.div(layer, 2)
    n = lax.div(model_layer, k.dims.block) + 1
    empty = (lax.rem(layer, 2) == 0) & (lax.rem(model_layer, k.dims.block) == 0)
    return n, n + 1 - empty.astype(jnp.int32)


def _blocks(k: Kernel) -> list[jax.Array]:
    return [k.refs.blocks[i] for i in range(k.refs.blocks.shape[0])]


def _mix(c: Layer, prefix: str, norm: str) -> jax.Array:
    n, count = _sources(c.kernel, c.index)
    mixed = ops.residual_mix(_blocks(c.kernel), count, c.vector(prefix + "_res_norm"),
                             c.vector(prefix + "_res_proj"), c.dims.rms_norm_eps)
    return ops.rms_norm(mixed, c.vector(norm), c.dims.rms_norm_eps)


def _add_output(c: Layer, out: jax.Array) -> None:
    n, count = _sources(c.kernel, c.index)
    empty = count == n
    blocks = c.refs.blocks

    @pl.when(empty)
    def _():
        blocks[n] = out

    @pl.when(jnp.logical_not(empty))
    def _():
        blocks[n] = blocks[n] + out


@lowers("input_mix")
def input_mix(c: Layer) -> jax.Array:
    return _mix(c, "attn", "input_norm")


@lowers("mlp_mix")
def mlp_mix(c: Layer) -> jax.Array:
    return _mix(c, "mlp", "post_norm")


@lowers("attn_residual")
def attn_residual(c: Layer, attn_out: jax.Array) -> None:
    _add_output(c, attn_out)


@lowers("mlp_residual")
def mlp_residual(c: Layer, mlp_out: jax.Array, *shared_out: jax.Array) -> None:
    """dense: the MLP output; moe: the gathered latent_up (its first `hidden` columns) plus the
    shared experts'."""
    if c.kind == "moe":
        _add_output(c, mlp_out[:, :c.dims.hidden_size] + shared_out[0])
    else:
        _add_output(c, mlp_out)


@lowers("o_proj")
def o_proj(c: Layer, core: jax.Array) -> jax.Array:
    return c.matmul("o_proj", core)[:, :c.dims.hidden_size]


def _cols(c: Layer, name: str) -> int | None:
    """A streamed matrix's own columns (its ring tiles pad them); None for a pooled one, whose
    product is as wide as the matrix."""
    streamed = c.plan.streamed.get(name)
    return streamed[1].cols if streamed else None


# ---- Kimi Delta Attention -------------------------------------------------------------------
@lowers("gate_down")
def gate_down(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("gate_down", h)


@lowers("gate_up")
def gate_up(c: Layer, x: jax.Array) -> jax.Array:
    """kda: the decay gate's up projection (pooled); dense: the SiTU MLP's gate|up (streamed)."""
    if c.kind == "kda":
        return c.matmul("gate_up", x)
    return ops.situ_packed(c.matmul("gate_up", x), c.per_rank["dense"], c.dims.situ_beta,
                           c.dims.situ_linear_beta)


@lowers("projection")
def projection(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("projection", h)


@lowers("conv")
def conv(c: Layer, proj: jax.Array) -> jax.Array:
    """Causal depthwise conv + SiLU over q|k|v; they enter the conv state as bf16, as the
    reference caches them."""
    width = c.per_rank["heads"] * c.dims.head_dim
    taps = c.dims.conv_taps
    state = c.state("conv")
    mixed = proj[:, :3 * width].astype(BF16)
    w = c.vector("conv_weight")
    out = []
    for rows, source in c.waves():     # a wave of rows at a time (`Layer.waves`)
        window = [state[j, source] for j in range(taps - 1)] + [mixed[rows]]
        acc = window[0].astype(F32) * w[0:1]
        for j in range(1, taps):
            acc = acc + window[j].astype(F32) * w[j:j + 1]
        for j in range(taps - 1):
            state[j, rows] = window[j + 1]
        out.append(jax.nn.silu(acc))
    return jnp.concatenate(out, axis=0) if len(out) > 1 else out[0]


@lowers("delta_rule")
def delta_rule(c: Layer, qkv: jax.Array, gate: jax.Array, proj: jax.Array) -> jax.Array:
    heads, hd = c.per_rank["heads"], c.dims.head_dim
    width = heads * hd
    state = c.state("recurrent")
    decay = ops.kda_decay(gate, c.vector("a_log"), c.vector("dt_bias"), c.dims.gate_lower_bound)
    beta = jax.nn.sigmoid(proj[:, 4 * width:4 * width + heads])
    rows = []
    for b in range(c.B):
        outs = []
        for h in range(heads):
            lanes = slice(h * hd, (h + 1) * hd)
            q = ops.l2_normalize(qkv[b:b + 1, lanes]) * (hd ** -0.5)
            k = ops.l2_normalize(qkv[b:b + 1, width + h * hd:width + (h + 1) * hd])
            val = qkv[b:b + 1, 2 * width + h * hd:2 * width + (h + 1) * hd]
            o, state[b, h] = ops.kda_head_step(state[c.state_source(b), h], q, k, val,
                                               decay[b:b + 1, lanes], beta[b:b + 1, h:h + 1])
            outs.append(o)
        rows.append(jnp.concatenate(outs, axis=-1) if heads > 1 else outs[0])
    return jnp.concatenate(rows, axis=0) if c.B > 1 else rows[0]


@lowers("gated_norm")
def gated_norm(c: Layer, core: jax.Array, proj: jax.Array) -> jax.Array:
    heads, hd = c.per_rank["heads"], c.dims.head_dim
    w, g_off = c.vector("o_norm"), 3 * heads * hd
    return jnp.concatenate([
        ops.kda_gated_output(core[:, h * hd:(h + 1) * hd], proj[:, g_off + h * hd:g_off + (h + 1) * hd], w,
                             c.dims.rms_norm_eps)
        for h in range(heads)], axis=-1)


# ---- MLA --------------------------------------------------------------------------------------
@lowers("q_down")
def q_down(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("q_down", h)


@lowers("kv_down")
def kv_down(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("kv_down", h)


@lowers("latent_norms")
def latent_norms(c: Layer, q_low: jax.Array, kv_row: jax.Array) -> tuple[jax.Array, jax.Array]:
    eps, lora = c.dims.rms_norm_eps, c.dims.kv_lora
    normed = ops.rms_norm(kv_row[:, :lora], c.vector("kv_norm"), eps)
    return (ops.rms_norm(q_low, c.vector("q_norm"), eps),
            jnp.concatenate([normed, kv_row[:, lora:]], axis=-1))


@lowers("kv_write")
def kv_write(c: Layer, kv_row: jax.Array) -> None:
    c.kv_write([kv_row])


@lowers("q_up")
def q_up(c: Layer, q_low: jax.Array) -> jax.Array:
    return c.matmul("q_up", q_low)[:, :_cols(c, "q_up")]


@lowers("absorb_query")
def absorb_query(c: Layer, q: jax.Array) -> list:
    """Per row: the query's nope part absorbed into the latent space by key_up, and its extra
    (shared-key) part."""
    heads, hd = c.per_rank["heads"], c.dims.head_dim
    width = heads * hd
    w_uk = c.pooled("key_up")
    return [ops.mla_absorb_query(q[b:b + 1, :width], q[b:b + 1, width:width + heads * c.dims.qk_extra],
                                 w_uk, heads) for b in range(c.B)]


@lowers("attention")
def attention(c: Layer, q_lat: list) -> list:
    """Online softmax per row over this rank's heads and its sequence's cached latent tokens up
    to the row's position -> per row (latent average accumulator, denominator)."""
    heads, lora, extra = c.per_rank["heads"], c.dims.kv_lora, c.dims.qk_extra
    scale = (c.dims.head_dim + extra) ** -0.5

    def tile(t, tiles, tokens, carry):
        (latent,) = tiles
        out = []
        for b in range(c.B):
            cached = latent[c.sequence(b)]
            m, denom, acc = carry[b]
            q, q_extra = q_lat[b]
            out.append(ops.mla_tile(q, q_extra, cached[:, :lora], cached[:, lora:lora + extra],
                                    tokens <= c.refs.positions[b], m, denom, acc, scale))
        return tuple(out)

    init = tuple((jnp.full((heads, 1), -jnp.inf, F32), jnp.zeros((heads, 1), F32),
                  jnp.zeros((heads, lora), F32)) for _ in range(c.B))
    return [(acc, denom) for m, denom, acc in c.kv_fold(tile, init)]


@lowers("values_out")
def values_out(c: Layer, lat_avg: list) -> jax.Array:
    w_uv = c.pooled("value_up")
    outs = [ops.mla_value_up(acc, denom, w_uv, c.per_rank["heads"]) for acc, denom in lat_avg]
    return jnp.concatenate(outs, axis=0) if c.B > 1 else outs[0]


@lowers("gate")
def gate(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("gate", h)[:, :_cols(c, "gate")]


@lowers("out_gate")
def out_gate(c: Layer, core: jax.Array, gate_logits: jax.Array) -> jax.Array:
    return core * jax.nn.sigmoid(gate_logits)


# ---- latent MoE -----------------------------------------------------------------------------
@lowers("router")
def router(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("router", h)[:, :_cols(c, "router")]


@lowers("route")
def route(c: Layer, scores: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Sigmoid top-k with the score-correction bias; this rank's picked local experts go to
    SMEM for their copies."""
    n = c.dims.experts
    bias = c.vector("router_bias")[:, :n]
    weights, ids = ops.route(scores[:, :n], bias, c.dims.top_k, c.dims.routed_scaling)
    c.select_experts(ids)
    return ids, weights


@lowers("latent_down")
def latent_down(c: Layer, h: jax.Array) -> jax.Array:
    return c.matmul("latent_down", h)[:, :_cols(c, "latent_down")]


@lowers("shared_gate_up")
def shared_gate_up(c: Layer, h: jax.Array) -> jax.Array:
    return ops.situ_packed(c.matmul("shared_gate_up", h), c.per_rank["shared"], c.dims.situ_beta,
                           c.dims.situ_linear_beta)


@lowers("shared_down")
def shared_down(c: Layer, shared_act: jax.Array) -> jax.Array:
    return c.matmul("shared_down", shared_act)[:, :c.dims.hidden_size]


@lowers("down")
def down(c: Layer, act: jax.Array) -> jax.Array:
    return c.matmul("down", act)[:, :c.dims.hidden_size]


@lowers("routed_experts")
def routed_experts(c: Layer, latent_in: jax.Array, expert_ids: jax.Array,
                   expert_weights: jax.Array) -> jax.Array:
    """This rank's width slice of its group's picked experts on every row, each weighted by
    its routing weight (zero where a row did not pick it), summed in ascending expert order."""
    latent, width = c.dims.latent, c.per_rank["expert_width"]
    x = latent_in[:, :latent]

    groups = pack_groups({"gate_up": latent, "down": width})

    def expert(k, acc):
        gate_up = expert_matmul(c, k, x, "gate_up", groups["gate_up"])
        act = ops.situ_packed(gate_up, width, c.dims.situ_beta, c.dims.situ_linear_beta)
        return acc + c.expert_weight(expert_weights, k) * expert_matmul(c, k, act, "down",
                                                                         groups["down"])

    return c.fold_experts(expert, jnp.zeros((c.B, latent), F32))


@lowers("latent_norm")
def latent_norm(c: Layer, routed_out: jax.Array) -> jax.Array:
    return ops.rms_norm(routed_out, c.vector("latent_norm"), c.dims.rms_norm_eps)


@lowers("latent_up")
def latent_up(c: Layer, routed_out: jax.Array) -> jax.Array:
    return c.matmul("latent_up", routed_out)[:, :_cols(c, "latent_up")]


# ---- around the layers ----------------------------------------------------------------------
def prologue(k: Kernel) -> None:
    """The embedding (in x) becomes residual block 0; the other blocks start empty."""
    for i in range(k.refs.blocks.shape[0]):
        k.refs.blocks[i] = jnp.zeros((k.B, k.dims.hidden_size), F32)
    k.refs.blocks[0] = k.refs.x[...]


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The output mixture over every block, then the final norm (head_norm rows: final norm,
    output mixture norm and projection)."""
    n, count = _sources(k, k.layers)
    mixed = ops.residual_mix(_blocks(k), count, head_norm[1:2, :], head_norm[2:3, :], k.dims.rms_norm_eps)
    return ops.rms_norm(mixed, head_norm[0:1, :], k.dims.rms_norm_eps)


def host_inputs(dims, positions: jax.Array) -> dict[str, jax.Array]:
    """No VMEM inputs computed on the host."""
    return {}
