"""The compute bodies of block attention residuals (`mkc.layers.block_residuals`), and the
kernel-wide steps a family with them calls around the layer loop (`prologue`,
`final_hidden`). The blocks live in VMEM (`k.refs.blocks`); the mixture masks the sources a
layer does not see yet before they can touch the result (they may hold stale memory)."""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from mkc.layers.block_residuals import NORMS, BlockAdd, BlockMix
from mkc.layers.ops import rms_norm
from mkc.runtime.context import Kernel, Layer

F32 = jnp.float32


def residual_mix(sources: Sequence[jax.Array], count: jax.Array | int, norm_w: jax.Array,
                 proj_w: jax.Array, eps: float) -> jax.Array:
    """Softmax mixture of the first ``count`` (a traced scalar) of the residual ``sources``
    ([B, H] f32 blocks: completed block sums, then the partial sum) -> [B, H], with score_i =
    proj . rms(v_i, norm); norm_w, proj_w [1, H]. The other sources are masked out before they
    can touch the result (they may hold stale memory)."""
    scores = [jnp.where(i < count, jnp.sum(rms_norm(v, norm_w, eps) * proj_w, axis=-1, keepdims=True),
                        -jnp.inf) for i, v in enumerate(sources)]
    top = scores[0]
    for sc in scores[1:]:
        top = jnp.maximum(top, sc)
    exps = [jnp.exp(sc - top) for sc in scores]
    total = sum(exps[1:], exps[0])
    mixed = jnp.zeros_like(sources[0])
    for i, (e, v) in enumerate(zip(exps, sources)):
        mixed = mixed + jnp.where(i < count, (e / total) * v, 0.0)
    return mixed


def _sources(k: Kernel, layer):
    """(slot of the block being filled, sources to mix) for loop layer `layer`: blocks 0 .. n-1
    are complete (block 0 is the embedding), slot n holds the partial sum, empty at the
    attention sublayer of a layer that opens a block."""
    model_layer = lax.div(layer, 2)
    n = lax.div(model_layer, k.dims.attn_res_block_size) + 1
    empty = (lax.rem(layer, 2) == 0) & (lax.rem(model_layer, k.dims.attn_res_block_size) == 0)
    return n, n + 1 - empty.astype(jnp.int32)


def _blocks(k: Kernel) -> list[jax.Array]:
    return [k.refs.blocks[i] for i in range(k.refs.blocks.shape[0])]


def _mix(s: BlockMix, c: Layer) -> jax.Array:
    n, count = _sources(c.kernel, c.index)
    mixed = residual_mix(_blocks(c.kernel), count, c.vector(s.place + "_res_norm"),
                         c.vector(s.place + "_res_proj"), c.dims.rms_norm_eps)
    return rms_norm(mixed, c.vector(NORMS[s.place]), c.dims.rms_norm_eps)


def input_mix(s: BlockMix, c: Layer) -> jax.Array:
    return _mix(s, c)


def mlp_mix(s: BlockMix, c: Layer) -> jax.Array:
    return _mix(s, c)


def _add(s: BlockAdd, c: Layer, *outputs: jax.Array) -> None:
    H = c.dims.hidden_size
    cut = [v if v.shape[-1] == H else v[:, :H] for v in outputs]
    out = sum(cut[1:], cut[0])
    n, count = _sources(c.kernel, c.index)
    empty = count == n
    blocks = c.refs.blocks

    @pl.when(empty)
    def _():
        blocks[n] = out

    @pl.when(jnp.logical_not(empty))
    def _():
        blocks[n] = blocks[n] + out


def attn_residual(s: BlockAdd, c: Layer, *outputs: jax.Array) -> None:
    _add(s, c, *outputs)


def mlp_residual(s: BlockAdd, c: Layer, *outputs: jax.Array) -> None:
    _add(s, c, *outputs)


def prologue(k: Kernel) -> None:
    """The embedding (in x) becomes block 0; the other blocks start empty."""
    for i in range(k.refs.blocks.shape[0]):
        k.refs.blocks[i] = jnp.zeros((k.B, k.dims.hidden_size), F32)
    k.refs.blocks[0] = k.refs.x[...]


def final_hidden(k: Kernel, head_norm) -> jax.Array:
    """The output mixture over every block, then the final norm (head_norm rows: final norm,
    output mixture norm and projection)."""
    n, count = _sources(k, k.layers)
    mixed = residual_mix(_blocks(k), count, head_norm[1:2, :], head_norm[2:3, :], k.dims.rms_norm_eps)
    return rms_norm(mixed, head_norm[0:1, :], k.dims.rms_norm_eps)
