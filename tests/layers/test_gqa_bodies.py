"""`GQA`'s lowered bodies (`mkc.layers.gqa.lowering`) against its f32 reference layer, every
variant the families compose: Llama's (llama3 rope), Qwen3-MoE's (plain q/k norms), Qwen3.5's
(zero-centred norms, output gate, a quarter of each head rotated), GPT-OSS's (biases, sinks,
YaRN's scaled table; full, and sliding over a ring of more slots than its window). Two rows at positions
where rope turns every pair, over a cache of random bf16 keys and values whose scores spread
the softmax, norm weights not one, sinks and biases large enough to take their share: the
residual stream after the layer and the new cache entries agree to f32 rounding (TOL), and a
1.01 scale of any term of a body moves them by more (the table below, each mutant applied to
the source and this module run: every one failed it).

Mutants (lowering.py unless named), 1.01 times ...        caught by
  input_norm's weight (ops.pre_norm)                       every case
  qkv's bias / qkv_gate's product                          gpt_oss / qwen3_5
  the query rotation's sin term / cos term (ops.apply_rope) every case
  the key rotation (k_new's apply_rope)                    every case
  q_norm weight / k_norm weight (qk_norm_rope)             qwen3_moe, qwen3_5
  the rotary table's angle (rope.rope_table)               every case
  YaRN's attention factor on the table                     gpt_oss
  the softmax scale (attention's hd ** -0.5)               every case
  the value written to the cache (kv_write)                every case
  a sink's logit (_start)                                  gpt_oss
  the window (sliding_window + 1)                          gpt_oss_sliding
  the output gate's logit (out_gate)                       qwen3_5
  o_proj's bias / the residual's added product             gpt_oss / every case
  ops.rms_norm's / rms_norm_zero_centred's weight           plain / zero-centred cases
  the tile's running rescale / its probability sum          every case
The table's shared code the reference also runs (rope's llama3 and YaRN frequencies, YaRN's
factors) is judged against upstream's formulas by tests/families (llama's reference, GPT-OSS's
ops, DeepSeek-V3's config), the split parts' products by test_attention_tile.
"""
from __future__ import annotations

import dataclasses
from functools import cache

import jax.numpy as jnp
import numpy as np
import pytest

from layer_bodies import StandIn, bf16, draw_params, gap, kernel_states, reference, run_bodies
from mkc.families.gpt_oss import reference as gpt_oss
from mkc.families.llama import reference as llama
from mkc.families.qwen3_5 import reference as qwen3_5
from mkc.families.qwen3_moe import reference as qwen3_moe
from mkc.layers.gqa import GQA
from mkc.model.config import CONFIG_DIR

TOL = 2e-4
B, CONTEXT, TILE = 2, 24, 8
POSITIONS = np.array([21, 13])


def _dims(module, name: str, **changes):
    small = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return dataclasses.replace(module.load_config(CONFIG_DIR / f"{name}.json"), **(small | changes))


CASES = {
    "llama": (GQA(), lambda: _dims(llama, "llama_mini")),
    "qwen3_moe": (GQA(qk_norm="plain"), lambda: _dims(qwen3_moe, "qwen3_moe_mini")),
    "qwen3_5": (GQA(norm="zero_centred", qk_norm="zero_centred", output_gate="q_proj"),
                lambda: _dims(qwen3_5, "qwen3_8_mini", head_dim=64, rotary_dim=16)),
    # Qwen2's attention: q/k/v biases, none on o_proj
    "qkv_bias_only": (GQA(bias=True), lambda: _dims(llama, "llama_mini")),
    "gpt_oss": (GQA(bias=True, o_bias=True, sinks=True), lambda: _dims(gpt_oss, "gpt_oss_mini")),
    "gpt_oss_sliding": (GQA(bias=True, o_bias=True, sinks=True, sliding=True),
                        lambda: _dims(gpt_oss, "gpt_oss_mini", sliding_window=16)),
}


@cache
def _run(case: str):
    sub, dims = CASES[case]
    d = dims()
    hf = draw_params(sub, d, seed=len(case))
    if sub.sinks:       # sinks near the scores' scale take a share of each head's softmax
        hf["model.layers.0.self_attn.sinks"] = np.array([2.0, -1.0, 3.0, 0.5], np.float32)
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    # a sliding kind's ring past its window (a verify step's), so the window and not the ring
    # bounds what a row sees
    slots = d.sliding_window + TILE if sub.sliding else CONTEXT
    shape = (B, d.num_key_value_heads, slots, d.head_dim)
    cache_in = {"layers.0.key_cache": jnp.asarray(bf16(rng.normal(0, 1, shape)), jnp.bfloat16),
                "layers.0.value_cache": jnp.asarray(bf16(rng.normal(0, 1, shape)), jnp.bfloat16)}
    want, cache_out = reference(sub, d, hf, x, POSITIONS, cache_in)
    c = StandIn(sub, d, hf, x, POSITIONS, tile=TILE, ring=slots if sub.sliding else 0)
    c.caches = StandIn(sub, d, hf, x, POSITIONS, kernel_states(sub, d, c.part, cache_in, B), tile=TILE).caches
    run_bodies(c)
    want_caches = kernel_states(sub, d, c.part, cache_out, B)
    got_caches = [np.asarray(k.value, np.float32) for k in c.caches]
    return x, want, np.asarray(c.refs.x.value), want_caches, got_caches


@pytest.mark.parametrize("case", list(CASES))
def test_the_lowered_attention_is_the_reference_layer(case):
    x, want, got, want_caches, got_caches = _run(case)
    assert gap(got - x, want - x) < TOL
    for name, got_cache in zip(("key", "value"), got_caches):   # within a bf16 rounding
        np.testing.assert_allclose(got_cache, want_caches[name], rtol=2 ** -7, atol=1e-6, err_msg=name)
