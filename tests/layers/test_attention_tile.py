"""The kernels' online-softmax tile with f32 queries split in three bf16 parts
(`mkc.layers.ops.attention_tile_bf16x3`, GQA's) against f64 numpy attention over the same bf16
keys and values: scores large enough that the softmax is sharp (where an error in a score
shows in the output), three tiles with a masked tail. The parts' products summed as the
kernel sums them are the f32 dot to within 1e-6; an error of 1 % in the middle part (2^-8 of
the high one) is 4e-5 of a score and fails it, as does dropping the low part's products or a
1.01 scale of any term of the update (each mutant applied to the source and this module run:
every one failed it).

Mutants (mkc/layers/ops.py), 1.01 times ...
  the middle part's products (sum_parts) / the low part's (split_bf16x3's remainder)
  the score scale; the running max's rescale of the denominator / of the accumulator; the
  tile's probability sum; its probability-weighted values
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from mkc.layers import ops

F32 = jnp.float32


def test_three_bf16_parts_are_the_f32_dot_and_the_tile_is_softmax():
    rng = np.random.default_rng(14)
    n, d, tile, tiles, position = 3, 64, 8, 3, 19
    q = rng.normal(0, 1, (n, d)).astype(np.float32) * 3.0
    keys, values = (np.asarray(jnp.asarray(rng.normal(0, 1, (tiles * tile, d)), jnp.bfloat16).astype(F32),
                               np.float64) for _ in range(2))
    q3 = ops.split_bf16x3(jnp.asarray(q))
    dots = ops.sum_parts(jnp.dot(q3, jnp.asarray(keys, jnp.bfloat16).T, preferred_element_type=F32), n)
    want_dots = q.astype(np.float64) @ keys.T
    assert np.max(np.abs(np.asarray(dots) - want_dots)) < 1e-6 * np.max(np.abs(want_dots))

    scale = d ** -0.5
    m, denom, acc = jnp.full((n, 1), -1e30, F32), jnp.zeros((n, 1), F32), jnp.zeros((n, d), F32)
    for t in range(tiles):
        tokens = t * tile + jnp.arange(tile)[None, :]
        m, denom, acc = ops.attention_tile_bf16x3(
            q3, jnp.asarray(keys[t * tile:(t + 1) * tile], jnp.bfloat16),
            jnp.asarray(values[t * tile:(t + 1) * tile], jnp.bfloat16), tokens <= position, m, denom, acc,
            scale)
    scores = want_dots[:, :position + 1] * scale
    assert np.ptp(scores, axis=-1).min() > 5           # sharp: an error in a score shows
    p = np.exp(scores - scores.max(-1, keepdims=True))
    want = (p / p.sum(-1, keepdims=True)) @ values[:position + 1]
    np.testing.assert_allclose(np.asarray(acc / denom), want, rtol=1e-5, atol=1e-5)
