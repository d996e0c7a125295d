"""The Qwen3-MoE reference (the layer library's decoder as Qwen3-MoE composes it) against an
independent numpy derivation of transformers' `Qwen3MoeForCausalLM` in f64: a whole-sequence
causal forward (no cache) with q/k normed per head before the default RoPE and the sparse MoE
block (softmax top-k router, renormalised iff `norm_topk_prob`, fused experts), over 12 decode
steps of the MINI at two rows with different tokens and positions."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from mkc.families.qwen3_moe import reference as ref
from mkc.model.config import CONFIG_DIR
from tests_support import assert_decode_follows

MINI = ref.load_config(CONFIG_DIR / "qwen3_moe_mini.json")


def _norm(x, g, eps):
    return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _moe(w: dict, p: str, d, h: np.ndarray, picks: list) -> np.ndarray:
    """Qwen3MoeSparseMoeBlock on h [T, H]; records each position's picked experts."""
    logits = h @ w[p + "mlp.gate.weight"].T
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    ids = np.argsort(-probs, axis=-1, kind="stable")[:, :d.top_k]
    weights = np.take_along_axis(probs, ids, -1)
    if d.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdims=True)
    picks.append(ids)
    out = np.zeros_like(h)
    inter = d.moe_intermediate_size
    for t in range(h.shape[0]):
        for e, wt in zip(ids[t], weights[t]):
            gu = w[p + "mlp.experts.gate_up_proj"][e] @ h[t]
            g, u = gu[:inter], gu[inter:]
            out[t] += wt * (w[p + "mlp.experts.down_proj"][e] @ (g / (1 + np.exp(-g)) * u))
    return out


def _forward(params: dict, d, tokens: np.ndarray, picks: list) -> np.ndarray:
    """Logits [T, vocab] of one sequence, every position attending to those up to it."""
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    T, hd, hq, hkv = len(tokens), d.head_dim, d.num_attention_heads, d.num_key_value_heads
    eps = d.rms_norm_eps
    freq = 1.0 / d.rope_theta ** (np.arange(0, hd, 2) / hd)
    ang = np.arange(T)[:, None] * freq[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):                                      # [T, heads, hd]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(d.num_hidden_layers):
        p = f"model.layers.{i}."
        h = _norm(x, w[p + "input_layernorm.weight"], eps)
        q = (h @ w[p + "self_attn.q_proj.weight"].T).reshape(T, hq, hd)
        k = (h @ w[p + "self_attn.k_proj.weight"].T).reshape(T, hkv, hd)
        q = rope(_norm(q, w[p + "self_attn.q_norm.weight"], eps))      # per head, before RoPE
        k = rope(_norm(k, w[p + "self_attn.k_norm.weight"], eps))
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(T, hkv, hd)
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(T, hq * hd) @ w[p + "self_attn.o_proj.weight"].T
        x = x + _moe(w, p, d, _norm(x, w[p + "post_attention_layernorm.weight"], eps), picks)
    return _norm(x, w["model.norm.weight"], eps) @ w["lm_head.weight"].T


@pytest.mark.parametrize("renormalise", [True, False])
def test_the_reference_is_transformers_math_over_twelve_steps(renormalise):
    d = dataclasses.replace(MINI, norm_topk_prob=renormalise)
    params = ref.init_params(d, seed=3)
    rng = np.random.default_rng(0)
    steps = 12
    tokens = rng.integers(0, d.vocab_size, (2, steps))
    picks: list = []
    want = [_forward(params, d, tokens[b], picks) for b in range(2)]
    # the routing is exercised: every expert picked somewhere, different experts per position
    assert len(np.unique(np.concatenate(picks))) == d.experts
    assert len({tuple(sorted(r)) for ids in picks for r in ids}) > 40
    assert_decode_follows(ref, d, params, tokens, want)


def test_renormalising_changes_the_output():
    """norm_topk_prob is read: the same weights give other logits without it."""
    params = ref.init_params(MINI, seed=3)
    off = dataclasses.replace(MINI, norm_topk_prob=False)
    args = (jnp.asarray([1, 2], jnp.int32), jnp.zeros((2,), jnp.int32))
    on_logits, _ = ref.decode_step(params, MINI, ref.init_cache(MINI, 2, 8), *args)
    off_logits, _ = ref.decode_step(params, off, ref.init_cache(off, 2, 8), *args)
    assert np.max(np.abs(np.asarray(on_logits) - np.asarray(off_logits))) > 1e-2


def test_the_weights_table_is_upstream_s():
    """Qwen3MoeForCausalLM's parameter names and shapes, layer by layer: attention with its
    q/k norms, the router, the fused experts, no shared expert."""
    shapes = ref.param_shapes(MINI)
    H, E, W, hd, bf16 = MINI.hidden_size, MINI.experts, MINI.moe_intermediate_size, MINI.head_dim, "bfloat16"
    prefix = "model.layers.1."
    layer = {n.removeprefix(prefix): s for n, s in shapes.items() if n.startswith(prefix)}
    assert layer == {
        "self_attn.q_proj.weight": ((8 * hd, H), bf16), "self_attn.k_proj.weight": ((2 * hd, H), bf16),
        "self_attn.v_proj.weight": ((2 * hd, H), bf16), "self_attn.o_proj.weight": ((H, 8 * hd), bf16),
        "self_attn.q_norm.weight": ((hd,), bf16), "self_attn.k_norm.weight": ((hd,), bf16),
        "input_layernorm.weight": ((H,), bf16), "mlp.gate.weight": ((E, H), bf16),
        "mlp.experts.gate_up_proj": ((E, 2 * W, H), bf16), "mlp.experts.down_proj": ((E, H, W), bf16),
        "post_attention_layernorm.weight": ((H,), bf16)}
    assert len(shapes) == 3 + 11 * MINI.num_hidden_layers
