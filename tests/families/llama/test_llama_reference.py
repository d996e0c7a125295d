"""The Llama reference (the layer library's decoder as Llama composes it) against an
independent numpy derivation of transformers' `LlamaForCausalLM` in f64: a whole-sequence
causal forward (no cache), its rotary frequencies from Meta's `apply_scaling` loop, over 12
decode steps of the MINI at two rows with different tokens and positions; and the Mistral
MINI (the alias: transformers' `MistralForCausalLM` is the same math without a window, default
rope at its theta) against the same derivation."""
from __future__ import annotations

import math

import numpy as np
import pytest

from mkc.families.llama import reference as ref
from mkc.model.config import CONFIG_DIR
from tests_support import assert_decode_follows

MINI = ref.load_config(CONFIG_DIR / "llama_mini.json")
MISTRAL_MINI = ref.load_config(CONFIG_DIR / "mistral_mini.json")


def _frequencies(d) -> np.ndarray:
    """Meta's llama3 `apply_scaling`, one frequency at a time (the default rope: unscaled)."""
    if d.rope_type == "default":
        return 1.0 / d.rope_theta ** (np.arange(0, d.head_dim, 2) / d.head_dim)
    out = []
    for i in range(0, d.head_dim, 2):
        freq = 1.0 / d.rope_theta ** (i / d.head_dim)
        wavelength = 2 * math.pi / freq
        low, high = d.rope_original_max_position / d.rope_low_freq_factor, \
            d.rope_original_max_position / d.rope_high_freq_factor
        if wavelength < high:
            out.append(freq)
        elif wavelength > low:
            out.append(freq / d.rope_factor)
        else:
            smooth = (d.rope_original_max_position / wavelength - d.rope_low_freq_factor) / \
                (d.rope_high_freq_factor - d.rope_low_freq_factor)
            out.append((1 - smooth) * freq / d.rope_factor + smooth * freq)
    return np.array(out)


def _forward(p: dict, d, tokens: np.ndarray) -> np.ndarray:
    """Logits [T, vocab] of one sequence, every position attending to those up to it."""
    w = {k: np.asarray(v, np.float64) for k, v in p.items()}
    T, hd, hq, hkv = len(tokens), d.head_dim, d.num_attention_heads, d.num_key_value_heads

    def norm(x, g):
        return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + d.rms_norm_eps)

    ang = np.arange(T)[:, None] * _frequencies(d)[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(x):                                      # [T, heads, hd]
        x1, x2 = x[..., :hd // 2], x[..., hd // 2:]
        return x * cos[:, None] + np.concatenate([-x2, x1], -1) * sin[:, None]

    x = w["model.embed_tokens.weight"][tokens]
    for i in range(d.num_hidden_layers):
        p_ = f"model.layers.{i}."
        h = norm(x, w[p_ + "input_layernorm.weight"])
        q = rope((h @ w[p_ + "self_attn.q_proj.weight"].T).reshape(T, hq, hd))
        k = rope((h @ w[p_ + "self_attn.k_proj.weight"].T).reshape(T, hkv, hd))
        v = (h @ w[p_ + "self_attn.v_proj.weight"].T).reshape(T, hkv, hd)
        k, v = np.repeat(k, hq // hkv, axis=1), np.repeat(v, hq // hkv, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
        a = np.exp(s - s.max(-1, keepdims=True))
        a /= a.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", a, v).reshape(T, hq * hd) @ w[p_ + "self_attn.o_proj.weight"].T
        h = norm(x, w[p_ + "post_attention_layernorm.weight"])
        g, u = h @ w[p_ + "mlp.gate_proj.weight"].T, h @ w[p_ + "mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[p_ + "mlp.down_proj.weight"].T
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


@pytest.mark.parametrize("mini", [MINI, MISTRAL_MINI], ids=lambda d: d.name)
def test_the_reference_is_transformers_math_over_twelve_steps(mini):
    params = ref.init_params(mini, seed=3)
    rng = np.random.default_rng(0)
    steps = 12
    tokens = rng.integers(0, mini.vocab_size, (2, steps))
    assert_decode_follows(ref, mini, params, tokens, [_forward(params, mini, tokens[b]) for b in range(2)])


def test_the_llama3_frequencies_are_meta_s():
    """The library's rope (kernel table and reference) against Meta's loop, on the shipped
    scaling and the MINI's (whose original context of 64 puts frequencies in all three bands)."""
    from mkc.layers import rope
    for d in (MINI, ref.load_config(CONFIG_DIR / "llama_3_1_8b.json")):
        want = _frequencies(d)
        np.testing.assert_allclose(rope.frequencies(d), want, rtol=1e-12)
        np.testing.assert_allclose(np.asarray(rope.inv_freq(d)), want, rtol=2e-6)
    bands = MINI.rope_original_max_position / np.array([MINI.rope_high_freq_factor,
                                                         MINI.rope_low_freq_factor])
    wavelength = 2 * math.pi / _frequencies(MINI)
    assert (wavelength < bands[0]).any() and (wavelength > bands[1]).any() and \
        ((wavelength >= bands[0]) & (wavelength <= bands[1])).any()
