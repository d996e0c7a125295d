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

import functools
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp

from mkc.layers.block_residuals import slots
from mkc.layers.reference import rms_norm
from mkc.reference.rounding import Rounding

_HIGHEST = jax.lax.Precision.HIGHEST


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


def block_attention_residuals(embedding: jax.Array, num_layers: int, block_size: int,
                              sublayer: Callable[[int, jax.Array], jax.Array],
                              mix: Callable[[int, jax.Array], jax.Array]) -> jax.Array:
    """Run ``2 * num_layers`` sublayers (j = 2i attention, 2i + 1 MLP of layer i) through Block
    AttnRes and return the final mixture ``mix(2 * num_layers, ...)`` (before the final norm).

    ``mix(j, sources [B, N, H]) -> [B, H]`` forms sublayer j's input; ``sublayer(j, h)`` returns
    its output. Sources are the completed block sums (``b_0`` = embedding) plus, when non-empty,
    the partial sum of the current block.
    """
    blocks: list[jax.Array] = []
    partial: jax.Array | None = embedding  # b_0 is "filled" by the embedding alone
    for i in range(num_layers):
        if i % block_size == 0:  # layer i opens a new block: close the current one
            assert partial is not None
            blocks.append(partial)
            partial = None
        for j in (2 * i, 2 * i + 1):
            sources = blocks if partial is None else [*blocks, partial]
            out = sublayer(j, mix(j, jnp.stack(sources, axis=1)))
            partial = out if partial is None else partial + out
    assert partial is not None
    return mix(2 * num_layers, jnp.stack([*blocks, partial], axis=1))


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


def mix(params: Mapping[str, Any], d: Any, j: int, sources: jax.Array,
        rounding: Rounding | None = None) -> jax.Array:
    """Sublayer j's input mixture (j = 2 * num_hidden_layers: the final one) of ``sources
    [B, N, H]``; with ``rounding``, in the kernel's order over its ``slots``."""
    if j == 2 * d.num_hidden_layers:
        prefix = "model.output_attn_res"
    else:
        prefix = f"model.layers.{j // 2}." + ("self_attention_res" if j % 2 == 0 else "mlp_res")
    norm, proj = (jnp.asarray(params[prefix + f"_{n}.weight"]).astype(jnp.float32) for n in ("norm", "proj"))
    if rounding is None:
        return attention_residual(sources, norm, proj, d.rms_norm_eps)
    count = sources.shape[1]   # the kernel's source slots past count are masked
    padded = tuple(sources[:, i] if i < count else jnp.zeros_like(sources[:, 0]) for i in range(slots(d)))
    return _kernel_mix(padded, jnp.int32(count), norm.reshape(1, -1), proj.reshape(1, -1), eps=d.rms_norm_eps)
