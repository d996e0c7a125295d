"""Pure-JAX reference decode for the Hugging Face ``gpt_oss`` family (gpt-oss-120b / -20b), one
decode token per row: the oracle a kernel will be judged against, so it shares no code with one
and favours plain math over speed. It follows upstream transformers
``models/gpt_oss/modeling_gpt_oss.py`` (``GptOssForCausalLM``) in f32, every dot at
``Precision.HIGHEST``, bf16 weights upcast and MXFP4 experts decoded exactly; the package
docstring lists the facts and where they were read. Per layer, on the residual ``x [B, H]``:

* ``h = rms_norm(x) * input_layernorm.weight`` (plain weight, not zero-centred), then attention:
  q, k, v projections with biases; RoPE with YaRN frequencies on whole heads in the halves
  convention (pair ``(i, i + D/2)``), cos and sin multiplied by the YaRN attention factor; scores
  ``q.k * D^-0.5`` over the visible positions, query head h reading KV head ``h // (Hq/Hkv)``;
  the head's sink logit joins the softmax's denominator only; ``o_proj`` with its bias;
* a ``sliding_attention`` layer sees positions ``p - W < j <= p`` (``W = sliding_window``), a
  ``full_attention`` layer ``j <= p``;
* ``x += attention``; ``h = rms_norm(x) * post_attention_layernorm.weight``; the MoE: router
  logits ``h @ router.weight^T + router.bias``, the ``top_k`` largest logits, softmax over those
  k only; each picked expert e: ``gate_up = W_gu[e] h + b_gu[e]`` with gate and up interleaved
  (gate = even rows, up = odd rows), ``gate = min(gate, limit)``, ``up = clip(up, -limit,
  limit)``, ``act = (up + 1) * gate * sigmoid(alpha * gate)``, ``out = W_d[e] act + b_d[e]``;
  ``x += sum_k weight_k * out_k``;
* after the last layer ``rms_norm(x) * model.norm.weight`` and ``lm_head`` (no bias, untied).

Decode state (``init_cache``; B batch, T context, W window), bf16 like upstream's cache:
``layers.{i}.key_cache`` / ``value_cache`` ``[B, Hkv, T, D]`` on full layers (slot t holds
position t) and ``[B, Hkv, W, D]`` on sliding layers, a ring of the last W positions (slot
``p % W`` holds position p; the slots a new row has not yet written are masked). Keys are stored
after RoPE. The new token's k and v are written first and read back, so a token sees the same
bf16 values whether it is the current one or a past one. Positions must be < T.

No kernel computes this family yet, so there is no kernel rounding emulation: ``rounding`` must
be None.
"""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.families.gpt_oss.config import FAMILY_NAME, GptOssDims, read_dims
from mkc.model.config import in_range, upstream_config
from mkc.model.mxfp4 import BLOCK_SIZE, mxfp4_dequantize_jax, mxfp4_quantize
from mkc.reference.rounding import bf16_weights

SLIDING = "sliding_attention"
FULL = "full_attention"
EXPERT_MATRICES = ("gate_up_proj", "down_proj")

_HIGHEST = jax.lax.Precision.HIGHEST


def load_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> GptOssDims:
    """The config of a gpt_oss model (dict, config.json path or checkpoint directory): the
    family's dims (``config.read_dims``: upstream defaults for omitted keys, ConfigError, a
    ValueError with a hint, for settings mkc does not compute), range-checked. Hashable, so it
    is the static jit argument of ``decode_step``."""
    raw, name = upstream_config(path_or_dict)
    model_type = raw.get("model_type", FAMILY_NAME)
    if model_type != FAMILY_NAME:
        raise ValueError(f"expected model_type {FAMILY_NAME!r}, got {model_type!r}")
    return in_range(read_dims(raw, name))


def expert_shapes(cfg: GptOssDims) -> dict[str, tuple[int, int]]:
    """Each expert matrix's logical ``[out, in]`` as the checkpoint stores it (its MXFP4 blocks
    run along ``in``): gate_up ``[2I, H]`` (rows interleaved gate, up), down ``[H, I]``."""
    return {"gate_up_proj": (2 * cfg.intermediate_size, cfg.hidden_size),
            "down_proj": (cfg.hidden_size, cfg.intermediate_size)}


def param_shapes(cfg: GptOssDims) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the published checkpoint -> (shape, dtype name), in upstream module
    order. Linear weights are ``[out, in]``; expert matrices are MXFP4: ``*_blocks`` uint8
    ``[E, out, in/32, 16]`` (two e2m1 codes a byte, low nibble first) and ``*_scales`` uint8
    ``[E, out, in/32]`` (E8M0, bias 127); everything else bf16."""
    h, d, e = cfg.hidden_size, cfg.head_dim, cfg.experts
    hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
    bf16, u8 = "bfloat16", "uint8"
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), bf16)}
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for proj, out in (("q_proj", hq * d), ("k_proj", hkv * d), ("v_proj", hkv * d)):
            shapes[f"{p}self_attn.{proj}.weight"] = ((out, h), bf16)
            shapes[f"{p}self_attn.{proj}.bias"] = ((out,), bf16)
        shapes[f"{p}self_attn.o_proj.weight"] = ((h, hq * d), bf16)
        shapes[f"{p}self_attn.o_proj.bias"] = ((h,), bf16)
        shapes[f"{p}self_attn.sinks"] = ((hq,), bf16)
        shapes[f"{p}mlp.router.weight"] = ((e, h), bf16)
        shapes[f"{p}mlp.router.bias"] = ((e,), bf16)
        for matrix, (out, k) in expert_shapes(cfg).items():
            shapes[f"{p}mlp.experts.{matrix}_blocks"] = ((e, out, k // BLOCK_SIZE, BLOCK_SIZE // 2), u8)
            shapes[f"{p}mlp.experts.{matrix}_scales"] = ((e, out, k // BLOCK_SIZE), u8)
            shapes[f"{p}mlp.experts.{matrix}_bias"] = ((e, out), bf16)
        shapes[f"{p}input_layernorm.weight"] = ((h,), bf16)
        shapes[f"{p}post_attention_layernorm.weight"] = ((h,), bf16)
    shapes["model.norm.weight"] = ((h,), bf16)
    shapes["lm_head.weight"] = ((cfg.vocab_size, h), bf16)
    return shapes


def _init_std(name: str, shape: tuple[int, ...], residual_scale: float) -> float:
    """The standard deviation of a random parameter (``init_params``), by what it feeds."""
    if name == "model.embed_tokens.weight" or name.endswith("sinks"):
        return 1.0
    if name.endswith(("_bias", ".bias")):
        return 0.1 * (residual_scale if name.endswith(("o_proj.bias", "down_proj_bias")) else 1.0)
    std = 1.0 / math.sqrt(shape[-1])
    return std * (residual_scale if name.endswith(("o_proj.weight", "down_proj")) else 1.0)


def init_params(cfg: GptOssDims, seed: int) -> dict[str, np.ndarray]:
    """Random parameters keeping the residual stream and logits O(1): projections and expert
    matrices N(0, 1/fan_in), those writing into the residual stream (o_proj, the experts'
    down_proj, and their biases) further scaled by 1/sqrt(2 * layers); biases N(0, 0.1) so
    every bias path is exercised (upstream initialises them to zero); norm weights 1 + N(0,
    0.1); sinks and the embedding N(0, 1). Expert matrices are drawn in f32 and stored through
    ``mxfp4_quantize``, so their blocks are valid codes with scales in 1..254."""
    rng = np.random.default_rng(seed)
    residual_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    logical = expert_shapes(cfg)
    out: dict[str, np.ndarray] = {}
    for name, (shape, _) in param_shapes(cfg).items():
        if name.endswith("_scales"):
            continue                                   # drawn with its blocks
        if name.endswith("_blocks"):
            matrix = name.rsplit(".", 1)[1].removesuffix("_blocks")
            full = (cfg.experts, *logical[matrix])
            w = rng.normal(0.0, _init_std(name.removesuffix("_blocks"), full, residual_scale), full)
            codes, scales = mxfp4_quantize(w.astype(np.float32))
            out[name] = codes.reshape(shape)
            out[name.removesuffix("_blocks") + "_scales"] = scales
        elif name.endswith("layernorm.weight") or name == "model.norm.weight":
            out[name] = bf16_weights(1.0 + rng.normal(0.0, 0.1, shape))
        else:
            out[name] = bf16_weights(rng.normal(0.0, _init_std(name, shape, residual_scale), shape))
    return {name: out[name] for name in param_shapes(cfg)}


def init_cache(cfg: GptOssDims, batch: int, context: int) -> dict[str, jax.Array]:
    """Zeroed decode state; see the module docstring for the layouts."""
    cache: dict[str, jax.Array] = {}
    for i, kind in enumerate(cfg.attention_types):
        slots = cfg.sliding_window if kind == SLIDING else context
        shape = (batch, cfg.num_key_value_heads, slots, cfg.head_dim)
        cache[f"layers.{i}.key_cache"] = jnp.zeros(shape, jnp.bfloat16)
        cache[f"layers.{i}.value_cache"] = jnp.zeros(shape, jnp.bfloat16)
    return cache


# ---------------------------------------------------------------------------------------------
# Building blocks (public so tests can check them in isolation).


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w.T + b`` for a PyTorch-layout ``[out, in]`` weight, in full f32."""
    y = jnp.einsum("...i,oi->...o", x, w, precision=_HIGHEST)
    return y if b is None else y + b


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """GptOssRMSNorm: ``w * x * rsqrt(mean(x^2) + eps)`` over the last axis."""
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


def yarn_inv_freq(cfg: GptOssDims) -> np.ndarray:
    """The ``D/2`` rotary frequencies: the original ``theta^(-2i/D)`` below pair index
    ``yarn_low``, those divided by ``yarn_factor`` above ``yarn_high``, a linear ramp between
    (computed in f64, rounded once to f32)."""
    d = cfg.head_dim
    original = cfg.rope_theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    high = cfg.yarn_high + (0.001 if cfg.yarn_high == cfg.yarn_low else 0.0)   # upstream's guard
    ramp = np.clip((np.arange(d // 2, dtype=np.float64) - cfg.yarn_low) / (high - cfg.yarn_low), 0, 1)
    return (original / cfg.yarn_factor * ramp + original * (1 - ramp)).astype(np.float32)


def rope_cos_sin(cfg: GptOssDims, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos, sin ``[..., D/2]`` at integer positions, times the YaRN attention factor."""
    angles = positions.astype(jnp.float32)[..., None] * jnp.asarray(yarn_inv_freq(cfg))
    return (jnp.cos(angles) * cfg.yarn_attention_factor, jnp.sin(angles) * cfg.yarn_attention_factor)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate pairs ``(x[i], x[i + D/2])`` of the last axis by cos, sin ``[..., D/2]``."""
    first, second = jnp.split(x, 2, axis=-1)
    return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array,
           sinks: jax.Array) -> jax.Array:
    """Softmax attention with a sink logit per query head: q ``[B, Hq, D]``, keys and values
    ``[B, Hkv, T, D]``, visible ``[B, T]``, sinks ``[Hq]`` -> ``[B, Hq, D]``. The sink joins the
    softmax over each head's scores ``q.k * D^-0.5`` and is dropped after it, so the weights of
    the visible positions sum to less than one."""
    b, hq, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)             # query head h reads KV head h // (Hq/Hkv)
    scores = jnp.einsum("bgrd,bgtd->bgrt", qg, keys, precision=_HIGHEST) * d ** -0.5
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    sink = jnp.broadcast_to(sinks.reshape(1, hkv, hq // hkv, 1), (b, hkv, hq // hkv, 1))
    probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bgrt,bgtd->bgrd", probs, values, precision=_HIGHEST).reshape(b, hq, d)


def cache_slots(kind: str, slots: int, positions: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """(the slot each row's new token is written to ``[B]``, which slots it may attend ``[B, T]``)
    of a layer's cache of ``slots`` slots. Full attention: slot t holds position t, visible when
    ``t <= p``. Sliding: a ring, slot ``s`` holding the latest position ``q = p - ((p - s) mod
    W)``, which lies in ``(p - W, p]`` by construction, visible once written (``q >= 0``)."""
    slot = jnp.arange(slots)[None, :]
    p = positions[:, None]
    if kind == FULL:
        return positions, slot <= p
    return positions % window, p - jnp.mod(p - slot, window) >= 0


def attention_block(p: Mapping[str, jax.Array], cfg: GptOssDims, kind: str, x: jax.Array,
                    key_cache: jax.Array, value_cache: jax.Array, positions: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GptOssAttention for one token per row: ``p`` maps names relative to ``self_attn.`` to f32
    arrays, x is the normed hidden ``[B, H]``. Returns (output ``[B, H]``, key_cache,
    value_cache)."""
    b, hq, hkv, d = x.shape[0], cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    cos, sin = (t[:, None, :] for t in rope_cos_sin(cfg, positions))
    q = apply_rope(linear(x, p["q_proj.weight"], p["q_proj.bias"]).reshape(b, hq, d), cos, sin)
    k = apply_rope(linear(x, p["k_proj.weight"], p["k_proj.bias"]).reshape(b, hkv, d), cos, sin)
    v = linear(x, p["v_proj.weight"], p["v_proj.bias"]).reshape(b, hkv, d)
    slot, visible = cache_slots(kind, key_cache.shape[2], positions, cfg.sliding_window)
    rows = jnp.arange(b)
    key_cache = key_cache.at[rows, :, slot].set(k.astype(key_cache.dtype))
    value_cache = value_cache.at[rows, :, slot].set(v.astype(value_cache.dtype))
    attn = attend(q, key_cache.astype(jnp.float32), value_cache.astype(jnp.float32), visible,
                  p["sinks"])
    return linear(attn.reshape(b, hq * d), p["o_proj.weight"], p["o_proj.bias"]), key_cache, value_cache


def clamped_swiglu(gate_up: jax.Array, alpha: float, limit: float) -> jax.Array:
    """GptOssExperts' activation of the interleaved ``[..., 2I]`` gate/up product (gate at even
    indices, up at odd ones) -> ``[..., I]``: the gate clamped from above only, up on both
    sides, ``(up + 1) * gate * sigmoid(alpha * gate)``."""
    gate = jnp.minimum(gate_up[..., 0::2], limit)
    up = jnp.clip(gate_up[..., 1::2], -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(alpha * gate))


def route(logits: jax.Array, top_k: int) -> tuple[jax.Array, jax.Array]:
    """GptOssTopKRouter's choice from biased logits ``[..., E]`` -> (ids ``[..., k]``, weights
    ``[..., k]``), largest first: the k largest logits, their softmax over those k only."""
    top, ids = jax.lax.top_k(logits, top_k)
    return ids, jax.nn.softmax(top, axis=-1)


def picked_experts(p: Mapping[str, jax.Array], cfg: GptOssDims, matrix: str, ids: jax.Array
                   ) -> jax.Array:
    """The ``ids`` experts' ``matrix`` decoded from MXFP4: ``[..., out, in]`` f32."""
    blocks = jnp.asarray(p[f"experts.{matrix}_blocks"])[ids]
    codes = blocks.reshape(*blocks.shape[:-2], -1)               # 16 bytes a block, in order
    out, k = expert_shapes(cfg)[matrix]
    return mxfp4_dequantize_jax(codes, jnp.asarray(p[f"experts.{matrix}_scales"])[ids],
                                (*ids.shape, out, k))


def moe_block(p: Mapping[str, jax.Array], cfg: GptOssDims, x: jax.Array) -> jax.Array:
    """GptOssMLP for the normed ``x [B, H]``: ``p`` maps names relative to ``mlp.`` (f32 floats,
    uint8 expert blocks and scales)."""
    ids, weights = route(linear(x, p["router.weight"], p["router.bias"]), cfg.top_k)
    hidden = jnp.einsum("bh,bkoh->bko", x, picked_experts(p, cfg, "gate_up_proj", ids),
                        precision=_HIGHEST) + p["experts.gate_up_proj_bias"][ids]
    act = clamped_swiglu(hidden, cfg.swiglu_alpha, cfg.swiglu_limit)
    out = jnp.einsum("bki,bkoi->bko", act, picked_experts(p, cfg, "down_proj", ids),
                     precision=_HIGHEST) + p["experts.down_proj_bias"][ids]
    return jnp.einsum("bk,bko->bo", weights, out, precision=_HIGHEST)


def _sub_params(params: Mapping[str, Any], prefix: str) -> dict[str, jax.Array]:
    """Parameters under ``prefix``, renamed relative to it: floats upcast to f32, the MXFP4
    codes and scales kept as uint8."""
    def value(w: Any) -> jax.Array:
        w = jnp.asarray(w)
        return w if w.dtype == jnp.uint8 else w.astype(jnp.float32)
    return {name[len(prefix):]: value(w) for name, w in params.items() if name.startswith(prefix)}


def decode_step(params: Mapping[str, Any], cfg: GptOssDims, cache: Mapping[str, jax.Array],
                tokens: jax.Array, positions: jax.Array, rounding: Any = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One decode token per row: (logits f32 ``[B, vocab]``, new cache). jit with
    ``jax.jit(decode_step, static_argnums=1)``; ``params`` may be numpy arrays."""
    if rounding is not None:
        raise ValueError("gpt_oss has no kernel yet, so no kernel rounding emulation: pass rounding=None")
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    x = jnp.asarray(params["model.embed_tokens.weight"])[tokens].astype(jnp.float32)
    new_cache = dict(cache)
    for i, kind in enumerate(cfg.attention_types):
        lp = _sub_params(params, f"model.layers.{i}.")
        attn = {n[len("self_attn."):]: w for n, w in lp.items() if n.startswith("self_attn.")}
        keys, values = f"layers.{i}.key_cache", f"layers.{i}.value_cache"
        out, new_cache[keys], new_cache[values] = attention_block(
            attn, cfg, kind, rms_norm(x, lp["input_layernorm.weight"], cfg.rms_norm_eps),
            cache[keys], cache[values], positions)
        x = x + out
        mlp = {n[len("mlp."):]: w for n, w in lp.items() if n.startswith("mlp.")}
        x = x + moe_block(mlp, cfg, rms_norm(x, lp["post_attention_layernorm.weight"], cfg.rms_norm_eps))
    x = rms_norm(x, jnp.asarray(params["model.norm.weight"]).astype(jnp.float32), cfg.rms_norm_eps)
    return linear(x, jnp.asarray(params["lm_head.weight"]).astype(jnp.float32)), new_cache
