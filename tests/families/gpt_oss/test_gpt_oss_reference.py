"""The GPT-OSS reference (mkc.families.gpt_oss.reference) against the published facts, hand
values and an independent numpy implementation written here from upstream's formulas
(transformers models/gpt_oss/modeling_gpt_oss.py, modeling_rope_utils.py, masking_utils.py,
integrations/mxfp4.py), in f64 from the raw config, sharing no code with the reference."""
from __future__ import annotations

import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mkc.families.gpt_oss import reference as ref
from mkc.families.gpt_oss.graph import ATTENTION, MOE
from mkc.layers.gqa import reference as gqa_ref
from mkc.layers.moe import reference as moe_ref
from mkc.layers.reference import clamped_swiglu, linear
from mkc.model.config import CONFIG_DIR

# The shipped MINI with a window of 8 instead of 128 (the full models'), so that short
# sequences run past it: the window's mechanics are what these tests judge.
MINI_RAW = json.loads((CONFIG_DIR / "gpt_oss_mini.json").read_text()) | {"sliding_window": 8}
MINI = ref.load_config(MINI_RAW)
DECODE = jax.jit(ref.decode_step, static_argnums=1)


@pytest.fixture(scope="module")
def params():
    return ref.init_params(MINI, seed=0)


# ---- building blocks against hand values ---------------------------------------------------------


def test_clamped_swiglu_at_the_clamp_boundaries():
    """Gate clamped above only, up on both sides, ``(up + 1) * gate * sigmoid(1.702 gate)``,
    on interleaved [gate, up] pairs."""
    pairs = [(7.5, 8.0), (7.0, -7.0), (-20.0, -9.0), (6.9, 6.9), (-1.0, 0.5), (0.0, 3.0)]
    gate_up = jnp.asarray([v for pair in pairs for v in pair], jnp.float32)

    def hand(g, u):
        g, u = min(g, 7.0), max(min(u, 7.0), -7.0)
        return (u + 1) * g / (1 + math.exp(-1.702 * g))

    got = np.asarray(clamped_swiglu(gate_up[0::2], gate_up[1::2], 1.702, 7.0))
    np.testing.assert_allclose(got, [hand(g, u) for g, u in pairs], rtol=1e-6, atol=1e-12)
    assert got[0] == pytest.approx(56 / (1 + math.exp(-11.914)), rel=1e-6)   # both clamped
    assert got[2] == pytest.approx(-6 * -20 / (1 + math.exp(34.04)), rel=1e-5)  # gate not clamped below


def test_mxfp4_block_decodes_to_hand_values():
    """Byte b of a block holds element 2b (low nibble) and 2b+1 (high nibble); scale s means
    2^(s-127); gate_up's decoded rows alternate gate and up."""
    blocks = np.zeros((2, 64, 1, 16), np.uint8)
    blocks[1, 3, 0, :4] = [0x21, 0xF8, 0x7A, 0x00]        # (0.5, 1) (-0, -6) (-1, 6) (0, 0)
    scales = np.full((2, 64, 1), 127, np.uint8)
    scales[1, 3, 0] = 128                                  # x 2
    p = {"experts.gate_up_proj_blocks": blocks, "experts.gate_up_proj_scales": scales}
    w = np.asarray(moe_ref.mxfp4_experts(p, "gate_up", jnp.asarray([1])))[0]
    assert w.shape == (64, 32)
    np.testing.assert_array_equal(w[3, :8], [1.0, 2.0, -0.0, -12.0, -2.0, 12.0, 0.0, 0.0])
    assert not np.any(np.delete(w, 3, axis=0)) and not np.any(w[3, 8:])


def test_router_takes_the_top_k_biased_logits_and_softmaxes_over_them_only():
    x = jnp.asarray([[1.0, -2.0]])
    weight = jnp.asarray([[0.5, 0.0], [0.0, -1.0], [1.0, 1.0], [0.2, 0.1]])
    bias = jnp.asarray([0.0, -0.5, 0.3, 1.5])             # logits 0.5, 1.5, -0.7, 1.5
    ids, weights = moe_ref.route(linear(x, weight) + bias, 2, True, "top_k_softmax")
    assert sorted(np.asarray(ids)[0].tolist()) == [1, 3]
    np.testing.assert_allclose(np.asarray(weights), [[0.5, 0.5]], rtol=1e-6)
    ids, weights = moe_ref.route(jnp.asarray([[0.0, 2.0, -1.0, 1.5]]), 3, True, "top_k_softmax")
    np.testing.assert_array_equal(np.asarray(ids), [[1, 3, 0]])
    e = np.exp([2.0, 1.5, 0.0])
    np.testing.assert_allclose(np.asarray(weights)[0], e / e.sum(), rtol=1e-6)


def _plain_attention(q, keys, values):
    """softmax(q k^T / sqrt(D)) v for one head, numpy f64: q [D], keys/values [T, D]."""
    s = keys @ q / math.sqrt(len(q))
    e = np.exp(s - s.max())
    return e @ values / e.sum(), np.exp(s).sum()


def test_sinks_join_the_softmax_denominator_only():
    """A sink of -inf is plain softmax attention; a sink s scales each head's output by
    Z / (Z + e^s), Z the sum of the visible exp-scores."""
    rng = np.random.default_rng(1)
    q = rng.normal(size=(1, 4, 64))
    keys, values = rng.normal(size=(2, 1, 2, 6, 64))
    visible = np.array([[True] * 5 + [False]])
    for sinks in (np.full(4, -np.inf), np.array([-1.0, 0.0, 2.0, 8.0])):
        got = np.asarray(gqa_ref.attend(*(jnp.asarray(a, jnp.float32) for a in (q, keys, values)),
                                    jnp.asarray(visible), jnp.asarray(sinks, jnp.float32)))
        for h in range(4):
            plain, z = _plain_attention(q[0, h], keys[0, h // 2, :5], values[0, h // 2, :5])
            np.testing.assert_allclose(got[0, h], plain * z / (z + np.exp(sinks[h])), rtol=2e-5, atol=1e-6)
    assert np.linalg.norm(got[0, 3]) < 0.05 * np.linalg.norm(plain)     # a large sink shrinks it


# ---- the sliding window ----------------------------------------------------------------------------


def _prefix_cache(params, tokens, cfg=MINI, context=16):
    cache = ref.init_cache(cfg, 1, context)
    logits = None
    for t, tok in enumerate(tokens):
        logits, cache = DECODE(params, cfg, cache, jnp.asarray([tok]), jnp.asarray([t]))
    return logits, cache


def test_a_sliding_layer_forgets_the_token_that_left_its_window(params):
    """Before the step at position p (> W), layer 0's ring slot p % W still holds position
    p - W: whatever it holds does not change the step; the slot of p - W + 1 (the oldest
    position in the window) does, and so does position p - W in the full layer 1's cache."""
    tokens = list(range(5, 5 + 12))
    w, p = MINI.sliding_window, 12
    _, cache = _prefix_cache(params, tokens)

    def step(edit_layer=None, slot=None):
        edited = dict(cache)
        if edit_layer is not None:
            for part in ("key_cache", "value_cache"):
                name = f"layers.{edit_layer}.{part}"
                edited[name] = cache[name].at[0, :, slot].set(3.0)
        return np.asarray(DECODE(params, MINI, edited, jnp.asarray([40]), jnp.asarray([p]))[0])

    base = step()
    np.testing.assert_array_equal(step(0, p % w), base)               # holds p - W: out of the window
    assert np.abs(step(0, (p + 1) % w) - base).max() > 1e-2          # holds p - W + 1: inside
    assert np.abs(step(1, p - w) - base).max() > 1e-2                # full attention sees p - W


def test_a_one_layer_sliding_model_ignores_tokens_before_its_window(params):
    """End to end through the ring: with one sliding layer, the logits at p do not depend on
    the token at p - W, and do on the one at p - W + 1; with one full layer they do on both."""
    def last_logits(kind, tokens):
        cfg = dataclasses.replace(MINI, num_hidden_layers=1, layer_kinds=(kind, "moe"))
        one = {n: v for n, v in params.items() if not n.startswith("model.layers.") or
               n.startswith("model.layers.0.")}
        return np.asarray(_prefix_cache(one, tokens, cfg)[0])

    tokens = [int(t) for t in np.random.default_rng(2).integers(0, MINI.vocab_size, 14)]
    p, w = len(tokens) - 1, MINI.sliding_window
    for kind, changes_outside in (("swa", False), ("gqa", True)):
        base = last_logits(kind, tokens)
        outside = last_logits(kind, tokens[:p - w] + [7] + tokens[p - w + 1:])
        inside = last_logits(kind, tokens[:p - w + 1] + [7] + tokens[p - w + 2:])
        assert (np.abs(outside - base).max() > 1e-3) == changes_outside, kind
        assert np.abs(inside - base).max() > 1e-3, kind


# ---- against an independent numpy implementation -----------------------------------------------------


def _bf16(x):
    return np.asarray(x, np.float32).astype(ml_dtypes.bfloat16).astype(np.float64)


def _np_mxfp4(blocks, scales):
    """[..., out, G, 16] codes and [..., out, G] scales -> [..., out, 32 G] (f64)."""
    lut = np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6])
    values = np.stack([lut[blocks & 15], lut[blocks >> 4]], axis=-1).reshape(*scales.shape, 32)
    return (values * np.exp2(scales.astype(np.float64) - 127)[..., None]).reshape(*scales.shape[:-1], -1)


def _np_rope(x, positions):
    """YaRN RoPE from the raw config (halves convention): x [T, heads, D]."""
    rope, d = MINI_RAW["rope_scaling"], MINI_RAW["head_dim"]
    theta, factor, original = MINI_RAW["rope_theta"], rope["factor"], rope["original_max_position_embeddings"]

    def dim_of(rotations):
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = max(dim_of(rope["beta_fast"]), 0), min(dim_of(rope["beta_slow"]), d - 1)
    i = np.arange(d // 2)
    ramp = np.clip((i - low) / (high - low), 0, 1)
    inv = theta ** (-2 * i / d) * (ramp / factor + 1 - ramp)
    scale = 0.1 * math.log(factor) + 1
    cos, sin = (f(positions[:, None] * inv)[:, None, :] * scale for f in (np.cos, np.sin))
    x1, x2 = x[..., :d // 2], x[..., d // 2:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _np_attention(p, x, sliding):
    """One attention layer over a whole sequence x [T, H] (normed), causal (and banded)."""
    t, d = len(x), MINI_RAW["head_dim"]
    hq, hkv = MINI_RAW["num_attention_heads"], MINI_RAW["num_key_value_heads"]
    positions = np.arange(t, dtype=np.float64)
    proj = {n: x @ p[f"{n}_proj.weight"].T + p[f"{n}_proj.bias"] for n in "qkv"}
    q = _np_rope(proj["q"].reshape(t, hq, d), positions)
    k = _bf16(_np_rope(proj["k"].reshape(t, hkv, d), positions))     # the bf16 cache
    v = _bf16(proj["v"].reshape(t, hkv, d))
    i, j = np.indices((t, t))
    mask = (j <= i) & ((j > i - MINI_RAW["sliding_window"]) if sliding else True)
    out = np.zeros((t, hq, d))
    for h in range(hq):
        g = h // (hq // hkv)
        s = np.where(mask, q[:, h] @ k[:, g].T / math.sqrt(d), -np.inf)
        m = np.maximum(s.max(axis=1), p["sinks"][h])[:, None]
        e = np.exp(s - m)
        out[:, h] = e @ v[:, g] / (e.sum(axis=1, keepdims=True) + np.exp(p["sinks"][h] - m))
    return out.reshape(t, hq * d) @ p["o_proj.weight"].T + p["o_proj.bias"]


def _np_moe(p, x):
    """The MoE over tokens x [T, H] (normed)."""
    limit, alpha, k = MINI_RAW["swiglu_limit"], 1.702, MINI_RAW["num_experts_per_tok"]
    gate_up = _np_mxfp4(p["experts.gate_up_proj_blocks"], p["experts.gate_up_proj_scales"])
    down = _np_mxfp4(p["experts.down_proj_blocks"], p["experts.down_proj_scales"])
    logits = x @ p["router.weight"].T + p["router.bias"]
    out = np.zeros_like(x)
    for t in range(len(x)):
        picked = np.argsort(-logits[t], kind="stable")[:k]
        weights = np.exp(logits[t, picked] - logits[t, picked].max())
        for e, weight in zip(picked, weights / weights.sum()):
            h = gate_up[e] @ x[t] + p["experts.gate_up_proj_bias"][e]
            gate, up = np.minimum(h[0::2], limit), np.clip(h[1::2], -limit, limit)
            act = (up + 1) * gate / (1 + np.exp(-alpha * gate))
            out[t] += weight * (down[e] @ act + p["experts.down_proj_bias"][e])
    return out


def _np_norm(x, w):
    return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + MINI_RAW["rms_norm_eps"])


def _np_layer(params, i):
    return {n[len(f"model.layers.{i}."):]: (v if v.dtype == np.uint8 else np.asarray(v, np.float64))
            for n, v in params.items() if n.startswith(f"model.layers.{i}.")}


def _np_logits(params, tokens):
    """Every position's logits of a whole sequence, numpy f64 (keys and values through bf16)."""
    f64 = {n: np.asarray(params[n], np.float64) for n in ("model.embed_tokens.weight",
                                                           "model.norm.weight", "lm_head.weight")}
    x = f64["model.embed_tokens.weight"][tokens]
    for i, kind in enumerate(MINI_RAW["layer_types"]):
        lp = _np_layer(params, i)
        attn = {n[len("self_attn."):]: v for n, v in lp.items() if n.startswith("self_attn.")}
        x = x + _np_attention(attn, _np_norm(x, lp["input_layernorm.weight"]), kind == "sliding_attention")
        mlp = {n[len("mlp."):]: v for n, v in lp.items() if n.startswith("mlp.")}
        x = x + _np_moe(mlp, _np_norm(x, lp["post_attention_layernorm.weight"]))
    return _np_norm(x, f64["model.norm.weight"]) @ f64["lm_head.weight"].T


def _steep(params):
    """The MINI weights with every expert's gate_up scaled by 4 (each E8M0 scale + 2, exact),
    so that many gate and up pre-activations pass the clamp at +-7."""
    out = dict(params)
    for i in range(MINI.num_hidden_layers):
        name = f"model.layers.{i}.mlp.experts.gate_up_proj_scales"
        out[name] = params[name] + np.uint8(2)
    return out


def test_the_clamp_bites_in_the_steep_weights(params):
    lp = _np_layer(_steep(params), 0)
    embedded = np.asarray(params["model.embed_tokens.weight"][:64], np.float64)
    x = _np_norm(embedded, lp["input_layernorm.weight"])
    gate_up = _np_mxfp4(lp["mlp.experts.gate_up_proj_blocks"], lp["mlp.experts.gate_up_proj_scales"])
    pre = np.einsum("eoh,th->teo", gate_up, x)
    assert (pre[..., 0::2] > 7).mean() > 0.02 and (np.abs(pre[..., 1::2]) > 7).mean() > 0.04


@pytest.mark.parametrize("steep", [False, True])
def test_moe_block_matches_numpy(params, steep):
    p = _steep(params) if steep else params
    lp = _np_layer(p, 1)
    mlp = {n[len("mlp."):]: v for n, v in lp.items() if n.startswith("mlp.")}
    x = np.random.default_rng(3).normal(size=(6, MINI.hidden_size))
    got = moe_ref.block(MOE, {n: jnp.asarray(v, jnp.float32) for n, v in mlp.items()}, MINI,
                        jnp.asarray(x, jnp.float32))
    want = _np_moe(mlp, x)
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5 * np.abs(want).max())


@pytest.mark.parametrize("layer", [0, 1])
def test_attention_block_step_by_step_matches_numpy_over_the_sequence(params, layer):
    """Layer 0 (sliding, its ring wrapped twice) and layer 1 (full) stepped over 20 random
    inputs; each step's output against the numpy layer over the whole sequence."""
    lp = _np_layer(params, layer)
    attn = {n[len("self_attn."):]: v for n, v in lp.items() if n.startswith("self_attn.")}
    kind = MINI_RAW["layer_types"][layer]
    xs = np.random.default_rng(4).normal(size=(20, MINI.hidden_size))
    want = _np_attention(attn, xs, kind == "sliding_attention")
    cache = ref.init_cache(MINI, 1, 20)
    keys, values = cache[f"layers.{layer}.key_cache"], cache[f"layers.{layer}.value_cache"]
    sub = ATTENTION["swa" if kind == "sliding_attention" else "gqa"][0]
    block = jax.jit(gqa_ref.block, static_argnums=(0, 2))
    p32 = {n: jnp.asarray(v, jnp.float32) for n, v in attn.items()}
    for t, x in enumerate(xs):
        got, keys, values = block(sub, p32, MINI, jnp.asarray(x[None], jnp.float32), keys, values,
                                  jnp.asarray([t]))
        got = got + p32["o_proj.bias"]
        np.testing.assert_allclose(np.asarray(got[0]), want[t], rtol=1e-4, atol=1e-4 * np.abs(want).max())


@pytest.mark.parametrize("steep", [False, True])
def test_decode_step_by_step_equals_numpy_whole_prefix(params, steep):
    """The decode's logits at every step of a 14-token sequence (past the window of 8, over
    both layer types and both transitions) against numpy's whole-sequence recomputation."""
    p = _steep(params) if steep else params
    tokens = [int(t) for t in np.random.default_rng(5).integers(0, MINI.vocab_size, 14)]
    want = _np_logits(p, np.asarray(tokens))
    cache = ref.init_cache(MINI, 1, 16)
    for t, tok in enumerate(tokens):
        logits, cache = DECODE(p, MINI, cache, jnp.asarray([tok]), jnp.asarray([t]))
        np.testing.assert_allclose(np.asarray(logits[0]), want[t], rtol=1e-4,
                                   atol=1e-4 * np.abs(want[t]).max())


def test_decode_is_finite_and_deterministic(params):
    first = np.asarray(_prefix_cache(params, [1, 2, 3, 4, 5])[0])
    assert np.all(np.isfinite(first))
    np.testing.assert_array_equal(first, np.asarray(_prefix_cache(params, [1, 2, 3, 4, 5])[0]))


def test_the_emulations_sliding_attention_reads_a_ring_past_its_wrap_as_the_reference_masks_it():
    """The emulation's sliding attention over a kernel's window KV ring (N = 32 slots in
    16-token tiles, window 8, rows past the ring's wrap: slot s holds p - ((p - s) mod N)) is
    the reference's `attend` under its `cache_slots` mask, to f32 rounding; a window one
    position wider is not."""
    rng = np.random.default_rng(3)
    b, hq, hkv, d, slots, window = 3, 4, 2, 64, 32, 8
    q = jnp.asarray(rng.normal(size=(b, hq, d)), jnp.float32)
    keys, values = (jnp.asarray(rng.normal(size=(b, hkv, slots, d)), jnp.bfloat16) for _ in range(2))
    sinks = jnp.asarray(rng.normal(size=(hq,)), jnp.float32)
    positions = jnp.asarray([5, 37, 70])            # before the window, past one and two wraps
    _, visible = gqa_ref.cache_slots(True, slots, positions, window)
    want = gqa_ref.attend(q, keys.astype(jnp.float32), values.astype(jnp.float32), visible, sinks)
    got = gqa_ref.tiled_attention(q, keys, values, positions, 16, sinks=sinks, window=window)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-6)
    wide = gqa_ref.tiled_attention(q, keys, values, positions, 16, sinks=sinks, window=window + 1)
    assert np.max(np.abs(np.asarray(wide) - np.asarray(want))[1:]) > 1e-3
