"""`SwiGLU`'s lowered bodies (`mkc.layers.swiglu.lowering`, a dense SwiGLU MLP) against its f32
reference layer, with a plain pre-norm (Llama's, DeepSeek-V3's dense layers) and a zero-centred
one (Qwen3.5's), norm weights not one: the residual stream after the layer agrees to TOL; a
1.01 scale of any term of a body moves it by more (each mutant applied to the source and this
module run: every one failed it).

Mutants (lowering.py unless named), 1.01 times ...
  post_norm's output; the gate|up product's gate half / up half (ops.swiglu); down's product;
  the residual's added product
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from layer_bodies import StandIn, draw_params, gap, reference, run_bodies
from mkc.families.llama import reference as llama
from mkc.layers.swiglu import SwiGLU
from mkc.model.config import CONFIG_DIR

TOL = 2e-5


@pytest.mark.parametrize("norm", ["plain", "zero_centred"])
def test_the_lowered_mlp_is_the_reference_layer(norm):
    d = dataclasses.replace(llama.load_config(CONFIG_DIR / "llama_mini.json"), hidden_size=128,
                            intermediate_size=96)
    sub = SwiGLU(norm=norm)
    hf = draw_params(sub, d, seed=4)
    x = np.random.default_rng(12).normal(0, 1, (3, d.hidden_size)).astype(np.float32)
    want, _ = reference(sub, d, hf, x, np.zeros(3, np.int32))
    c = StandIn(sub, d, hf, x, np.zeros(3, np.int32))
    run_bodies(c)
    assert gap(np.asarray(c.refs.x.value) - x, want - x) < TOL
