"""`MoE`'s lowered bodies (`mkc.layers.moe.lowering`) against its f32 reference layer, every
variant the families compose: Qwen3-MoE's softmax top-k with `norm_topk_prob` on and off,
Qwen3.5-MoE's (zero-centred pre-norm, a gated shared expert), DeepSeek-V3's (sigmoid scores,
the correction bias, groups, `routed_scaling_factor`, an ungated shared expert; renormalised
or not) and GPT-OSS's (a biased router, the top k's softmax, biased experts, the clamped
SwiGLU). Every row's picks are the reference's (`route` in the kernel's own lanes) and the
residual stream after the layer agrees to TOL; a 1.01 scale of any term of a body moves it by
more (the table, each mutant applied to the source and this module run: every one failed it).
A term that only selects (the correction bias, the group score's terms) changes nothing unless
it flips a pick: `test_router_ties` builds the near-ties where it does.

Mutants (lowering.py unless named), 1.01 times ...          caught by
  post_norm's output (the MoE pre-norm)                        every case
  the router's product / its bias                              every case / gpt_oss
  the softmax probabilities' renormalising sum (route_weights) qwen3_moe (norm_topk_prob on)
  the kept probabilities (route_weights, off)                  qwen3_moe_unnormalised
  the top k's softmax sum (top_k_softmax_weights)              gpt_oss
  the sigmoid weights' sum / routed_scaling_factor             deepseek / both deepseek cases
  the shared expert's gate|up product / its down product       qwen3_5_moe, deepseek
  an expert's gate|up product / its gate|up bias / down bias   every case / gpt_oss
  the routing weight of an expert's output (routed_experts)    every case
  the shared gate's logit / the shared expert in the sum       qwen3_5_moe / deepseek (ungated)
  the routed sum (mlp_residual)                                every case
  ops.swiglu's up half / clamped_swiglu's alpha                silu cases / gpt_oss
"""
from __future__ import annotations

import dataclasses
from functools import cache

import jax.numpy as jnp
import numpy as np
import pytest

from layer_bodies import StandIn, draw_params, gap, layer_params, reference, run_bodies
from mkc.families.deepseek_v3 import reference as deepseek
from mkc.families.deepseek_v3.graph import MOE as DEEPSEEK_MOE
from mkc.families.gpt_oss import reference as gpt_oss
from mkc.families.gpt_oss.graph import MOE as GPT_OSS_MOE
from mkc.families.qwen3_5_moe import reference as qwen3_5_moe
from mkc.families.qwen3_moe import reference as qwen3_moe
from mkc.layers.moe import MoE
from mkc.layers.moe import reference as moe_ref
from mkc.layers.moe.options import Checkpoint
from mkc.layers.reference import NORM
from mkc.model.config import CONFIG_DIR

TOL = 2e-5
B = 4


def _dims(module, name: str, **changes):
    small = dict(hidden_size=128, experts=8, top_k=2, moe_intermediate_size=64)
    return dataclasses.replace(module.load_config(CONFIG_DIR / f"{name}.json"), **(small | changes))


CASES = {
    "qwen3_moe": (MoE(), lambda: _dims(qwen3_moe, "qwen3_moe_mini")),
    "qwen3_moe_unnormalised": (MoE(), lambda: _dims(qwen3_moe, "qwen3_moe_mini", norm_topk_prob=False)),
    "qwen3_5_moe": (MoE(norm="zero_centred", shared_expert=True),
                    lambda: _dims(qwen3_5_moe, "qwen3_5_moe_mini", shared_expert_intermediate_size=64)),
    "deepseek": (DEEPSEEK_MOE, lambda: _dims(deepseek, "deepseek_v3_mini", top_k=3)),
    "deepseek_unnormalised": (DEEPSEEK_MOE, lambda: _dims(deepseek, "deepseek_v3_mini", top_k=3,
                                                         norm_topk_prob=False)),
    # its experts as bf16 values (the slot's matmuls are the stand-in's; MXFP4 decoding is
    # `expert_formats`', tested on its own): halves of the expert's width, unpadded
    "gpt_oss": (dataclasses.replace(GPT_OSS_MOE, checkpoint=Checkpoint.BF16), lambda: dataclasses.replace(
        gpt_oss.load_config(CONFIG_DIR / "gpt_oss_mini.json"), hidden_size=128, intermediate_size=64,
        experts=4)),
}


def _slot_experts(sub: MoE, d, hf) -> list[dict[str, jnp.ndarray]]:
    """Every expert as its slot holds it ([in, out] values; MXFP4 decoded), bias rows [1, n]."""
    p = {n[len(sub.prefix):]: w for n, w in layer_params(hf).items() if n.startswith(sub.prefix)}
    inter = d.moe_intermediate_size
    half = sub.expert_half(d)
    out = []
    for e in range(d.experts):
        w = moe_ref._slot_expert(sub, p, d, e, slice(0, inter), half)
        out.append({n: (a if n.endswith("bias") else a.T) for n, a in w.items()})
    return out


@cache
def _run(case: str):
    sub, dims = CASES[case]
    d = dims()
    hf = draw_params(sub, d, seed=len(case))
    rng = np.random.default_rng(9)
    x = rng.normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    want, _ = reference(sub, d, hf, x, np.zeros(B, np.int32))
    p = {n[len(sub.prefix):]: w for n, w in layer_params(hf).items() if n.startswith(sub.prefix)}
    if sub.shared_expert and sub.shared_gate:
        # the kernel's gate reads h rounded to bf16, as the MXU takes it (the emulation's
        # `_kernel_mlp_residual`); the rest is the f32 reference's
        norm = layer_params(hf)["post_attention_layernorm.weight"]
        h = NORM[sub.norm](jnp.asarray(x), norm, d.rms_norm_eps)
        routed, shared = moe_ref.parts(sub, p, d, h, None, "moe")
        gate = p["shared_expert_gate.weight"]
        want = np.asarray(moe_ref._kernel_mlp_residual(jnp.asarray(x), routed, h, gate, shared), np.float64)
    c = StandIn(sub, d, hf, x, np.zeros(B, np.int32), per_rank={"expert_half": sub.expert_half(d)})
    values = run_bodies(c, _slot_experts(sub, d, hf))
    # the reference's picks, from the same logits (the router's product is the stand-in's)
    ids, _ = moe_ref.route(values["router_logits"], *moe_ref.route_args(sub, p, d))
    picked = np.sort(np.asarray(c.picked), -1)
    return x, want, np.asarray(c.refs.x.value), picked, np.sort(np.asarray(ids), -1)


@pytest.mark.parametrize("case", list(CASES))
def test_the_lowered_moe_is_the_reference_layer(case):
    x, want, got, picked, want_picked = _run(case)
    np.testing.assert_array_equal(picked, want_picked)
    assert gap(got - x, want - x) < TOL
