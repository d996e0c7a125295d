"""`MLA`'s lowered bodies (`mkc.layers.mla.lowering`, weight-absorbed over the latent cache)
against its f32 reference layer (expanded through kv_b_proj): DeepSeek-V3's (YaRN rope on the
query's and the shared key's rope parts, interleaved pairs or not, the softmax scale times
`yarn_mscale` twice) and Kimi K3's (NoPE, a sigmoid output gate). Two rows at positions where
rope turns every pair, over a cache of random bf16 latents whose scores spread the softmax,
norm weights not one: the residual stream after the layer agrees to TOL and the new latent
rows within a bf16 rounding; a 1.01 scale of any term of a body moves them by more (the table,
each mutant applied to the source and this module run: every one failed it).

Mutants (lowering.py unless named), 1.01 times ...          caught by
  input_norm's output / the residual's added product           every case
  kv_norm's weight / q_norm's weight (latent_norms)            every case
  the key's rope part rotation (latent_norms' _rotate)         deepseek cases
  the query's rope part rotation (absorb_query's _rotate)      deepseek cases
  q_up's product / key_up (absorb_query's w_uk)                every case
  the softmax scale (mla.softmax_scale's yarn_mscale)          deepseek cases
  the scores' rope term (ops.mla_tile)                         deepseek cases
  value_up (values_out) / the denominator (ops.mla_value_up)   every case
  the gate's logit (out_gate) / o_proj's product               k3 / every case
  the rotary table's angle (rope.rope_table)                   deepseek cases
  the tile's running rescale (ops.mla_tile)                    every case
`yarn_mscale` in the scale (mla.softmax_scale) is the reference's too: judged against
upstream's formula by tests/families/deepseek_v3/test_deepseek_v3_config.py.
"""
from __future__ import annotations

import dataclasses
from functools import cache

import jax.numpy as jnp
import numpy as np
import pytest

from layer_bodies import StandIn, bf16, draw_params, gap, kernel_states, reference, run_bodies
from mkc.families.deepseek_v3 import reference as deepseek
from mkc.layers.mla import MLA
from mkc.model.config import CONFIG_DIR

TOL = 2e-4
B, CONTEXT, TILE = 2, 24, 8
POSITIONS = np.array([21, 13])


def _dims(**changes):
    small = dict(hidden_size=128, num_attention_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32,
                 v_head_dim=32)
    mini = deepseek.load_config(CONFIG_DIR / "deepseek_v3_mini.json")
    return dataclasses.replace(mini, **(small | changes))


CASES = {
    "deepseek": (MLA(rope=True), lambda: _dims()),
    "deepseek_rotate_half": (MLA(rope=True), lambda: _dims(rope_interleave=False)),
    "k3": (MLA(output_gate=True), lambda: _dims(yarn_mscale=1.0)),
}


@cache
def _run(case: str):
    sub, dims = CASES[case]
    d = dims()
    hf = draw_params(sub, d, seed=len(case))
    rng = np.random.default_rng(8)
    x = rng.normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    latent = bf16(rng.normal(0, 1, (B, CONTEXT, d.kv_lora_rank + d.qk_rope_head_dim)))
    cache_in = {"layers.0.latent_cache": jnp.asarray(latent, jnp.bfloat16)}
    want, cache_out = reference(sub, d, hf, x, POSITIONS, cache_in)
    c = StandIn(sub, d, hf, x, POSITIONS, tile=TILE)
    c.caches = StandIn(sub, d, hf, x, POSITIONS, kernel_states(sub, d, c.part, cache_in, B), tile=TILE).caches
    run_bodies(c)
    want_cache = kernel_states(sub, d, c.part, cache_out, B)["latent"]
    return x, want, np.asarray(c.refs.x.value), want_cache, np.asarray(c.caches[0].value, np.float32)


@pytest.mark.parametrize("case", list(CASES))
def test_the_lowered_latent_attention_is_the_reference_layer(case):
    x, want, got, want_cache, got_cache = _run(case)
    assert gap(got - x, want - x) < TOL
    np.testing.assert_allclose(got_cache, want_cache, rtol=2 ** -7, atol=1e-6)
