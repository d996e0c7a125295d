"""The compute body of every Kimi K3 decode op, as the generic module calls it
(`mkc.families.qwen3_5.lowering` has the convention).

A K3 layer runs as two sublayers of the layer loop: attention (`kda` or `mla`), then the MLP
(`dense` in layer 0, `moe` after); the attention and MoE kinds' bodies between K3's input mix
and residual add are the layer library's (`BODIES`: `mkc.layers.kda.lowering`,
`mkc.layers.mla.lowering`, `mkc.layers.moe.lowering`). The residual stream is block attention
residuals: `blocks` (VMEM) holds the embedding, each completed block's sum and the block being
filled; every sublayer's input is a learned mixture of them, and its output is added to the
open block.
Attention projections come from the pool's weight view, MoE experts (MXFP4) from its expert
slots, every other matrix from the ring: `c.matmul` serves whichever the schedule chose.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mkc.families.kimi_k3 import ops
from mkc.families.kimi_k3.graph import LAYERS
from mkc.layers.sublayer import body_table
from mkc.model.contracts import lowers
from mkc.runtime.context import Kernel, Layer

F32 = jnp.float32
# The attention and MoE sublayers' bodies: the layer library's (`graph.LAYERS`).
BODIES = body_table(LAYERS)


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


@lowers("mlp_residual", kind="dense")
def dense_mlp_residual(c: Layer, mlp_out: jax.Array) -> None:
    _add_output(c, mlp_out)


@lowers("mlp_residual", kind="moe")
def moe_mlp_residual(c: Layer, mlp_out: jax.Array, shared_out: jax.Array) -> None:
    """The gathered latent_up (its first `hidden` columns) plus the shared experts'."""
    _add_output(c, mlp_out[:, :c.dims.hidden_size] + shared_out)


# ---- the dense MLP --------------------------------------------------------------------------
@lowers("gate_up")
def gate_up(c: Layer, h: jax.Array) -> jax.Array:
    """The SiTU MLP's gate|up (streamed)."""
    return ops.situ_packed(c.matmul("gate_up", h), c.per_rank["dense"], c.dims.situ_beta,
                           c.dims.situ_linear_beta)


@lowers("down")
def down(c: Layer, act: jax.Array) -> jax.Array:
    return c.matmul("down", act)[:, :c.dims.hidden_size]


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
