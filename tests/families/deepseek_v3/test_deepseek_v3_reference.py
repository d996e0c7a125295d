"""The DeepSeek-V3 reference (the layer library's decoder as DeepSeek-V3 composes it) against an
independent numpy derivation of transformers' `DeepseekV3ForCausalLM` in f64, from the raw
config: a whole-sequence causal forward (no cache) with MLA expanded per head (q_lora, the
kv latent normed, kv_b_proj to keys and values), interleaved YaRN RoPE on the rope parts, the
softmax scale's mscale, the dense SwiGLU of the first layers and the MoE after (sigmoid
scores, the correction bias picking among the best groups, renormalised and scaled weights,
the ungated shared expert), over 12 decode steps of the MINI at two rows."""
from __future__ import annotations

import dataclasses
import json
import math

import jax.numpy as jnp
import numpy as np
import pytest

from mkc.families.deepseek_v3 import reference as ref
from mkc.model import fp8_blocks
from mkc.model.config import CONFIG_DIR
from tests_support import assert_decode_follows

RAW = json.loads((CONFIG_DIR / "deepseek_v3_mini.json").read_text())
MINI = ref.load_config(RAW)


def _norm(x, g, eps=RAW["rms_norm_eps"]):
    return g * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def _yarn(T: int):
    """cos, sin [T, rope / 2] (`_compute_yarn_parameters` from the raw rope_scaling) and the
    softmax scale."""
    r, rs = RAW["qk_rope_head_dim"], RAW["rope_scaling"]
    base, factor, original = RAW["rope_theta"], rs["factor"], rs["original_max_position_embeddings"]
    pos = base ** (np.arange(0, r, 2) / r)

    def dim(rot):
        return r * math.log(original / (rot * 2 * math.pi)) / (2 * math.log(base))
    low, high = max(math.floor(dim(rs["beta_fast"])), 0), min(math.ceil(dim(rs["beta_slow"])), r - 1)
    extrapolation = 1 - np.clip((np.arange(r // 2) - low) / (high - low), 0, 1)
    inv = 1 / (factor * pos) * (1 - extrapolation) + 1 / pos * extrapolation
    mscale = 0.1 * rs["mscale_all_dim"] * math.log(factor) + 1
    ang = np.arange(T)[:, None] * inv[None, :]
    scale = (RAW["qk_nope_head_dim"] + r) ** -0.5 * mscale * mscale
    return np.cos(ang), np.sin(ang), scale


def _rope(x, cos, sin):
    """apply_rotary_pos_emb_interleave on x [T, ..., r]: pairs (2i, 2i+1), evens out first."""
    c, s = (a.reshape(a.shape[0], *([1] * (x.ndim - 2)), -1) for a in (cos, sin))
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def _swiglu(w, p, x):
    g = x @ w[p + "gate_proj.weight"].T
    return (g / (1 + np.exp(-g)) * (x @ w[p + "up_proj.weight"].T)) @ w[p + "down_proj.weight"].T


def _moe(w, p, h, picks):
    """DeepseekV3MoE on h [T, H]; records each position's picked experts."""
    E, k, G, TG = RAW["n_routed_experts"], RAW["num_experts_per_tok"], RAW["n_group"], RAW["topk_group"]
    scores = 1 / (1 + np.exp(-(h @ w[p + "mlp.gate.weight"].T)))
    choice = scores + w[p + "mlp.gate.e_score_correction_bias"]
    groups = np.sort(choice.reshape(len(h), G, -1), axis=-1)[..., -2:].sum(-1)
    keep = np.zeros_like(groups, bool)
    np.put_along_axis(keep, np.argsort(-groups, axis=-1)[:, :TG], True, axis=-1)
    choice = np.where(np.repeat(keep, E // G, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    weights = np.take_along_axis(scores, ids, -1)
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-20) * RAW["routed_scaling_factor"]
    picks.append(ids)
    inter = RAW["moe_intermediate_size"]
    out = _swiglu(w, p + "mlp.shared_experts.", h)
    for t in range(len(h)):
        for e, wt in zip(ids[t], weights[t]):
            gu = w[p + "mlp.experts.gate_up_proj"][e] @ h[t]
            g, u = gu[:inter], gu[inter:]
            out[t] += wt * (w[p + "mlp.experts.down_proj"][e] @ (g / (1 + np.exp(-g)) * u))
    return out


def _forward(params: dict, tokens: np.ndarray, picks: list) -> np.ndarray:
    """Logits [T, vocab] of one sequence, every position attending to those up to it."""
    w = {k: np.asarray(v, np.float64) for k, v in params.items()}
    T, nh = len(tokens), RAW["num_attention_heads"]
    nope, r, vd = RAW["qk_nope_head_dim"], RAW["qk_rope_head_dim"], RAW["v_head_dim"]
    kvl = RAW["kv_lora_rank"]
    cos, sin, scale = _yarn(T)
    x = w["model.embed_tokens.weight"][tokens]
    for i in range(RAW["num_hidden_layers"]):
        p, a = f"model.layers.{i}.", f"model.layers.{i}.self_attn."
        h = _norm(x, w[p + "input_layernorm.weight"])
        q = _norm(h @ w[a + "q_a_proj.weight"].T, w[a + "q_a_layernorm.weight"]) @ w[a + "q_b_proj.weight"].T
        q = q.reshape(T, nh, nope + r)
        ckv = h @ w[a + "kv_a_proj_with_mqa.weight"].T
        kv = _norm(ckv[:, :kvl], w[a + "kv_a_layernorm.weight"]) @ w[a + "kv_b_proj.weight"].T
        kv = kv.reshape(T, nh, -1)
        q = np.concatenate([q[..., :nope], _rope(q[..., nope:], cos, sin)], axis=-1)
        k_rot = _rope(ckv[:, kvl:], cos, sin)
        k = np.concatenate([kv[..., :nope], np.broadcast_to(k_rot[:, None], (T, nh, r))], axis=-1)
        s = np.einsum("qhd,khd->hqk", q, k) * scale
        s = np.where(np.tril(np.ones((T, T), bool))[None], s, -np.inf)
        att = np.exp(s - s.max(-1, keepdims=True))
        att /= att.sum(-1, keepdims=True)
        x = x + np.einsum("hqk,khd->qhd", att, kv[..., nope:]).reshape(T, nh * vd) @ w[a + "o_proj.weight"].T
        h = _norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + (_swiglu(w, p + "mlp.", h) if i < RAW["first_k_dense_replace"] else _moe(w, p, h, picks))
    return _norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def test_the_reference_is_transformers_math_over_twelve_steps():
    params = ref.init_params(MINI, seed=3)
    rng = np.random.default_rng(0)
    steps = 12
    tokens = rng.integers(0, MINI.vocab_size, (2, steps))
    picks: list = []
    want = [_forward(params, tokens[b], picks) for b in range(2)]
    # the routing is exercised: every expert picked somewhere, different experts per position
    assert len(np.unique(np.concatenate(picks))) == MINI.experts
    assert len({tuple(sorted(r)) for ids in picks for r in ids}) > 40
    assert_decode_follows(ref, MINI, params, tokens, want)


def test_an_fp8_checkpoint_is_read_as_its_values():
    """The MINI FP8 checkpoint (the same draws stored as e4m3 codes beside f32 128 x 128 block
    scales): the reference follows transformers' math on the checkpoint's values, its routed
    experts code x scale (f32) and its other linear weights the bf16 DeepSeek's fp8_cast_bf16
    writes, as the kernel holds them."""
    fp8 = ref.load_config(CONFIG_DIR / "deepseek_v3_mini_fp8.json")
    params = ref.init_params(fp8, seed=3)
    values = {}
    for name, w in params.items():
        if name.endswith("_scale_inv"):
            continue
        scales = params.get(name + "_scale_inv")
        if scales is None:
            values[name] = w
        elif name.endswith(".weight"):
            values[name] = fp8_blocks.widen(w, scales, (128, 128))
        else:
            values[name] = fp8_blocks.dequantize(w, scales, (128, 128))
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, fp8.vocab_size, (2, 12))
    want = [_forward(values, tokens[b], []) for b in range(2)]
    assert_decode_follows(ref, fp8, params, tokens, want)


@pytest.mark.parametrize("change", [{"rope_interleave": False}, {"n_group": 1, "topk_group": 1},
                                    {"routed_scaling_factor": 1.0}])
def test_each_setting_is_read(change):
    """Interleaved RoPE, the group limit and the routed scaling each change the logits."""
    params = ref.init_params(MINI, seed=3)
    other = dataclasses.replace(MINI, **change)
    args = (jnp.asarray([5, 9, 700, 3], jnp.int32), jnp.asarray([0, 3, 7, 11], jnp.int32))
    cache = ref.init_cache(MINI, 4, 16)
    for t in range(3):      # a few steps, so RoPE has past keys to rotate against
        base, cache_a = ref.decode_step(params, MINI, cache, args[0], args[1] + t)
        changed, _ = ref.decode_step(params, other, cache, args[0], args[1] + t)
        cache = cache_a
    assert np.max(np.abs(np.asarray(base) - np.asarray(changed))) > 1e-3


def test_the_weights_table_is_upstream_s():
    """DeepseekV3ForCausalLM's parameter names and shapes: MLA, the dense MLP of layer 0, the
    router with its correction bias, the fused experts and the shared experts of layer 1."""
    shapes = ref.param_shapes(MINI)
    H, E, W, bf16 = MINI.hidden_size, MINI.experts, MINI.moe_intermediate_size, "bfloat16"
    attention = {"self_attn.q_a_proj.weight": ((256, H), bf16),
                 "self_attn.q_a_layernorm.weight": ((256,), bf16),
                 "self_attn.q_b_proj.weight": ((16 * 128, 256), bf16),
                 "self_attn.kv_a_proj_with_mqa.weight": ((256 + 64, H), bf16),
                 "self_attn.kv_a_layernorm.weight": ((256,), bf16),
                 "self_attn.kv_b_proj.weight": ((16 * 128, 256), bf16),
                 "self_attn.o_proj.weight": ((H, 16 * 64), bf16), "input_layernorm.weight": ((H,), bf16),
                 "post_attention_layernorm.weight": ((H,), bf16)}
    layer = {i: {n.removeprefix(f"model.layers.{i}."): s for n, s in shapes.items()
                 if n.startswith(f"model.layers.{i}.")} for i in (0, 1)}
    assert layer[0] == attention | {f"mlp.{m}_proj.weight": ((512, H) if m != "down" else (H, 512), bf16)
                                    for m in ("gate", "up", "down")}
    assert layer[1] == attention | {
        "mlp.gate.weight": ((E, H), bf16), "mlp.gate.e_score_correction_bias": ((E,), "float32"),
        "mlp.experts.gate_up_proj": ((E, 2 * W, H), bf16), "mlp.experts.down_proj": ((E, H, W), bf16),
        **{f"mlp.shared_experts.{m}_proj.weight": ((W, H) if m != "down" else (H, W), bf16)
           for m in ("gate", "up", "down")}}
    assert len(shapes) == 3 + 12 + 3 * 16
