"""`KDA`'s lowered bodies (`mkc.layers.kda.lowering`, Kimi Delta Attention) against its f32
reference layer, with its own pre-norm and residual add (`KDA()`; K3 composes it without
them): two rows from random conv taps and recurrent states, two heads, the decay per key
channel spread over (0.08, 1), the output norm's weight not one: the residual stream after the
layer agrees to TOL, the new states within a bf16 rounding (the conv state) and TOL (the
recurrent state), and so does the delta rule's output before the gated norm (whose RMS norm
hides a scale of it, the query's); a 1.01 scale of any term of a body moves them by more (the table, each
mutant applied to the source and this module run: every one failed it).

Mutants (lowering.py unless named), 1.01 times ...
  input_norm's output; the decay gate's up product; a conv tap; the conv's input where it
  enters the state; beta's logit; the decay (ops.log_decay's lower bound / A_log's exp /
  dt_bias); the query scale hd ** -0.5; the key's l2 norm; the value; the gated output's
  weight / its gate (ops.gated_output); o_proj's product; the residual's added product
"""
from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np

from layer_bodies import bf16, draw_params, gap, run_recurrent_layer
from mkc.families.kimi_k3 import reference as k3
from mkc.layers.kda import KDA
from mkc.layers.kda import reference as kda_reference
from mkc.model.config import CONFIG_DIR

TOL = 2e-5
B = 2


@cache
def _run():
    d = dataclasses.replace(k3.load_config(CONFIG_DIR / "kimi_k3_mini.json"), hidden_size=128,
                            kda_num_heads=2, kda_head_dim=32)
    sub = KDA()
    hf = draw_params(sub, d, seed=6)
    rng = np.random.default_rng(11)
    x = rng.normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    width = d.kda_num_heads * d.kda_head_dim
    conv = bf16(rng.normal(0, 1, (B, 3 * width, d.conv_kernel_size - 1)))
    recurrent = rng.normal(0, 0.3, (B, d.kda_num_heads, d.kda_head_dim, d.kda_head_dim))
    return run_recurrent_layer(sub, d, hf, x, conv, recurrent, keep=(kda_reference, "delta_rule_step"))


def test_the_lowered_kda_is_the_reference_layer():
    x, want, got, want_states, got_states, (core, want_core) = _run()
    assert gap(got - x, want - x) < TOL
    assert gap(core, want_core) < TOL
    np.testing.assert_allclose(got_states["conv"], want_states["conv"], rtol=2 ** -7, atol=1e-6)
    assert gap(got_states["recurrent"], want_states["recurrent"]) < TOL
