"""The decoder's lowered final norms (`mkc.layers.decoder.lowering.final_hidden`, plain, and
`final_hidden_zero_centred`) against the reference's (`mkc.layers.reference.NORM`), on rows of
several scales (one small enough that the norm's eps acts) and a weight not one: agree to f32
rounding; a 1.01 scale of the weight, of the eps or of the mean moves them by more (each
mutant applied to the source and this module run: every one failed it)."""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np
import pytest

from layer_bodies import Buffer, gap
from mkc.layers.decoder import lowering
from mkc.layers.reference import NORM

EPS = 1e-5


@pytest.mark.parametrize("norm, body", [("plain", lowering.final_hidden),
                                        ("zero_centred", lowering.final_hidden_zero_centred)])
def test_the_final_norm_is_the_references(norm, body):
    rng = np.random.default_rng(13)
    x = rng.normal(0, 1, (3, 128)).astype(np.float32) * np.array([[1.0], [30.0], [1e-3]], np.float32)
    w = (1.0 + rng.normal(0, 0.3, 128)).astype(np.float32)
    k = types.SimpleNamespace(refs=types.SimpleNamespace(x=Buffer(x)),
                              dims=types.SimpleNamespace(rms_norm_eps=EPS))
    got = body(k, jnp.asarray(w)[None, :])
    want = NORM[norm](jnp.asarray(x), jnp.asarray(w), EPS)
    for row in range(3):
        assert gap(got[row], want[row]) < 1e-6
