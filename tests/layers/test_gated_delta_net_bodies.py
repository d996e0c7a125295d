"""`GatedDeltaNet`'s lowered bodies (`mkc.layers.gated_delta_net.lowering`, Qwen3.5's linear
attention) against its f32 reference layer: two rows from random conv taps and recurrent
states (so the conv's every tap and the decay act), norm weights not one, two value heads a key
head: the residual stream after the layer agrees to TOL, the new states within a bf16 rounding
(the conv state) and TOL (the recurrent state), and so does the delta rule's output before the
gated norm (whose RMS norm hides a scale of it, the query's); a 1.01 scale of any term of a body moves them
by more (the table, each mutant applied to the source and this module run: every one failed).

Mutants (lowering.py unless named), 1.01 times ...
  input_norm's output; in_proj's product; a conv tap (ops.causal_conv_silu); the conv's input
  where it enters the state; beta's logit; A_log's exp; dt_bias; softplus's argument; the query
  scale dk ** -0.5; the key's l2 norm; the value; the decay (ops.delta_rule_head's exp(g)); the
  delta (ops.delta_rule_update); the gated norm's weight / its gate z; out_proj's product; the
  residual's added product
"""
from __future__ import annotations

import dataclasses
from functools import cache

import numpy as np

from layer_bodies import bf16, draw_params, gap, run_recurrent_layer
from mkc.families.qwen3_5 import reference as qwen3_5
from mkc.families.qwen3_5.graph import DELTA_NET
from mkc.layers.gated_delta_net import reference as gdn_reference
from mkc.model.config import CONFIG_DIR

TOL = 2e-5
B = 2


@cache
def _run():
    d = dataclasses.replace(qwen3_5.load_config(CONFIG_DIR / "qwen3_8_mini.json"), hidden_size=128,
                            linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=32,
                            linear_value_head_dim=32)
    sub = DELTA_NET
    hf = draw_params(sub, d, seed=5)
    rng = np.random.default_rng(10)
    x = rng.normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    conv = bf16(rng.normal(0, 1, (B, d.linear_conv_dim, d.linear_conv_kernel_dim - 1)))
    heads = (d.linear_num_value_heads, d.linear_key_head_dim, d.linear_value_head_dim)
    recurrent = rng.normal(0, 0.3, (B, *heads))
    return run_recurrent_layer(sub, d, hf, x, conv, recurrent, keep=(gdn_reference, "gated_delta_step"))


def test_the_lowered_delta_net_is_the_reference_layer():
    x, want, got, want_states, got_states, (core, want_core) = _run()
    assert gap(got - x, want - x) < TOL
    assert gap(core, want_core) < TOL
    np.testing.assert_allclose(got_states["conv"], want_states["conv"], rtol=2 ** -7, atol=1e-6)
    assert gap(got_states["recurrent"], want_states["recurrent"]) < TOL

