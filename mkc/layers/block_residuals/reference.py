"""Block attention residuals' reference (`mkc.layers.block_residuals`): the stream is a list of
sources, ``b_0`` = the token embedding and ``b_n`` = the sum of all sublayer outputs of layers
``(n-1)*S .. n*S - 1`` (S = ``attn_res_block_size``), plus the partial sum of the block being
filled. Each sublayer (and the final norm) reads ``sum_i softmax_i(score_i) * v_i`` over the
completed blocks and the non-empty partial sum, ``score_i = proj . rms(v_i, norm)``, with its
own ``*_res_norm.weight`` / ``*_res_proj.weight [1, H]``; layer i with ``i % S == 0`` first
closes the block. The blocks live only inside one decode step: nothing of them persists in the
cache. Upstream names: ``model.layers.{i}.self_attention_res`` (before the attention),
``.mlp_res`` (before the MLP) and ``model.output_attn_res`` (before the final norm).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mkc.layers.block_residuals import BlockAdd, BlockMix, slots
from mkc.layers.reference import rms_norm
from mkc.reference.rounding import Rounding

_HIGHEST = jax.lax.Precision.HIGHEST
# upstream's queries before a layer's attention and MLP, and before the final norm; the norm
# each place's kind reads its mixture through
QUERIES = {"attn": "self_attention_res", "mlp": "mlp_res"}
OUTPUT = "model.output_attn_res"
NORM_WEIGHTS = {"attn": "input_layernorm.weight", "mlp": "post_attention_layernorm.weight"}


def mix_shapes(d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """One attention-residual query: a norm weight and a [1, H] projection."""
    return {prefix + "_norm.weight": ((d.hidden_size,), "bfloat16"),
            prefix + "_proj.weight": ((1, d.hidden_size), "bfloat16")}


def attention_residual(sources: jax.Array, norm_weight: jax.Array, proj_weight: jax.Array,
                       eps: float) -> jax.Array:
    """Softmax mixture of ``sources [B, N, H]`` -> ``[B, H]``: score of source v is
    ``proj . rms(v, norm)`` (a depth-wise attention with a learned, input-independent query)."""
    normed = rms_norm(sources, norm_weight, eps)
    scores = jnp.einsum("bnh,h->bn", normed, proj_weight.reshape(-1), precision=_HIGHEST)
    probs = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bn,bnh->bh", probs, sources, precision=_HIGHEST)


# The rounding emulation sums in the kernel's f32 order (one-ulp bf16 flips otherwise spread
# through the step): the kernel's formulation, jitted whole as the kernel's body is compiled
# whole; checked bit-equal to an instrumented K3 MINI kernel (issue 12).
@functools.partial(jax.jit, static_argnames=("eps",))
def _kernel_mix(sources: tuple[jax.Array, ...], count: jax.Array, norm_w: jax.Array,
                proj_w: jax.Array, *, eps: float) -> jax.Array:
    """``attention_residual`` over the first ``count`` of the ``slots`` sources (``[B, H]``
    each, the rest masked), as the kernel forms it: one score per source, the softmax as a
    running sum, the mixture added source by source."""
    scores = [jnp.where(i < count, jnp.sum(rms_norm(v, norm_w, eps) * proj_w, axis=-1, keepdims=True),
                        -jnp.inf) for i, v in enumerate(sources)]
    top = scores[0]
    for score in scores[1:]:
        top = jnp.maximum(top, score)
    exps = [jnp.exp(score - top) for score in scores]
    total = exps[0]
    for e in exps[1:]:
        total = total + e
    mixed = jnp.zeros_like(sources[0])
    for i, (e, v) in enumerate(zip(exps, sources)):
        mixed = mixed + jnp.where(i < count, (e / total) * v, 0.0)
    return mixed


def mix(norm: jax.Array, proj: jax.Array, d: Any, sources: jax.Array, rounding: Rounding | None = None
        ) -> jax.Array:
    """The mixture of ``sources [B, N, H]`` under a query's norm and projection weights; with
    ``rounding``, in the kernel's order over its ``slots``."""
    if rounding is None:
        return attention_residual(sources, norm, proj, d.rms_norm_eps)
    count = sources.shape[1]   # the kernel's source slots past count are masked
    padded = tuple(sources[:, i] if i < count else jnp.zeros_like(sources[:, 0]) for i in range(slots(d)))
    return _kernel_mix(padded, jnp.int32(count), norm.reshape(1, -1), proj.reshape(1, -1), eps=d.rms_norm_eps)


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The residual stream under block attention residuals: the completed ``sources`` (the
    embedding first), the ``partial`` sum of the block being filled (None when empty), and
    between a `BlockMix` and its `BlockAdd` the kind's normed input ``h`` and its ``out``."""

    sources: tuple[jax.Array, ...]
    partial: jax.Array | None
    h: jax.Array | None = None
    out: jax.Array | None = None

    def visible(self) -> jax.Array:
        """The sources a mixture reads ``[B, N, H]``: the completed ones and a non-empty partial."""
        return jnp.stack([*self.sources, *(() if self.partial is None else (self.partial,))], axis=1)

    def leave(self, out: jax.Array) -> Blocks:
        """The stream with a residual-less kind's output, for its `BlockAdd`."""
        return dataclasses.replace(self, out=out)


class BlockResiduals:
    """The residual strategy of `mkc.layers.decode.DecoderReference`: the embedding is the
    partial block layer 0 closes; the final norm reads the output mixture over every block."""

    def start(self, embedding: jax.Array, d: Any = None) -> Blocks:
        return Blocks((), embedding)

    def finish(self, params: Mapping[str, Any], d: Any, stream: Blocks, rounding: Rounding | None
               ) -> jax.Array:
        norm, proj = (jnp.asarray(params[f"{OUTPUT}_{n}.weight"]).astype(jnp.float32)
                      for n in ("norm", "proj"))
        return mix(norm, proj, d, stream.visible(), rounding)

    def global_shapes(self, d: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        return mix_shapes(d, OUTPUT)

    def residual_scale(self, d: Any) -> float:
        """A block sums two outputs a layer of its `attn_res_block_size` layers."""
        return 1.0 / math.sqrt(2 * d.attn_res_block_size)


BLOCK_RESIDUALS = BlockResiduals()


def forward(s: BlockMix | BlockAdd, lp: Mapping[str, jax.Array], d: Any, x: Blocks, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> Blocks:
    """`BlockMix`: the attention place of a layer opening a block (every
    ``attn_res_block_size``-th) closes the partial one; the mixture of the visible sources
    under the place's query, then the kind's norm, is the kind's input. `BlockAdd`: the kind's
    output added to the partial block."""
    if isinstance(s, BlockAdd):
        return Blocks(x.sources, x.out if x.partial is None else x.partial + x.out)
    if s.place == "attn" and layer % d.attn_res_block_size == 0:
        x = Blocks((*x.sources, x.partial), None)
    query = QUERIES[s.place]
    mixed = mix(lp[f"{query}_norm.weight"], lp[f"{query}_proj.weight"], d, x.visible(), rounding)
    return dataclasses.replace(x, h=rms_norm(mixed, lp[NORM_WEIGHTS[s.place]], d.rms_norm_eps))


def param_shapes(s: BlockMix | BlockAdd, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """A `BlockMix`'s query and its kind's norm (upstream order: both queries, then both norms,
    is the family's draw order to choose)."""
    if isinstance(s, BlockAdd):
        return {}
    return mix_shapes(d, prefix + QUERIES[s.place]) | {
        prefix + NORM_WEIGHTS[s.place]: ((d.hidden_size,), "bfloat16")}


def init_cache(s: BlockMix | BlockAdd, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    return {}
