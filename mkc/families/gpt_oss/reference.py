"""Pure-JAX reference decode for the Hugging Face ``gpt_oss`` family (gpt-oss-120b / -20b), one
decode token per row: the oracle a kernel will be judged against, so it shares no code with one
and favours plain math over speed. It follows upstream transformers
``models/gpt_oss/modeling_gpt_oss.py`` (``GptOssForCausalLM``) in f32, every dot at
``Precision.HIGHEST``, bf16 weights upcast and MXFP4 experts decoded exactly; the package
docstring lists the facts and where they were read. Per layer, on the residual ``x [B, H]``:

* ``h = rms_norm(x) * input_layernorm.weight`` (plain weight, not zero-centred), then attention
  (the layer library's GQA with biases and sinks, sliding on sliding layers:
  `mkc.layers.gqa.reference.block`): q, k, v projections with biases; RoPE with YaRN
  frequencies on whole heads in the halves convention (pair ``(i, i + D/2)``), cos and sin
  multiplied by the YaRN attention factor; scores ``q.k * D^-0.5`` over the visible positions,
  query head h reading KV head ``h // (Hq/Hkv)``; the head's sink logit joins the softmax's
  denominator only; ``o_proj`` with its bias;
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
``p % W`` holds position p; the slots a new row has not yet written are masked). A sliding
cache of N > W slots (a kernel's `kv ring N slots`, gathered by ``weights.reference_states``)
is the same ring with slot ``p % N``, each slot masked by the position it holds. Keys are stored
after RoPE. The new token's k and v are written first and read back, so a token sees the same
bf16 values whether it is the current one or a past one. Positions must be < T.

Kernel rounding emulation (``rounding``, ``mkc.reference.rounding.Rounding`` from a compiled
schedule, as in the Qwen3.5 references): the step rounds and sums where the generated kernel
(``mkc.families.gpt_oss.lowering``) does, each piece written in the kernel's expression and
shapes and jitted, since XLA's f32 order depends on both (``mkc.numerics``):

* the embedding's exact vocab all-reduce (Qwen3.5's ``embed``); norms as
  ``x * rsqrt(mean(x^2) + eps) * w`` (``_kernel_norm``);
* every matmul's activation rounded to bf16 and multiplied by the bf16 dot the kernel issues
  (``Rounding.linear``); q, k, v, the router and the experts' biases added to the f32 product;
* RoPE from the host's f32 table (`mkc.layers.rope.rope_table`: the YaRN angles' cos and sin
  times the attention factor) head by head as ``x cos + (x R) sin`` with the rotate-half matrix R;
* keys and values stored in the KV cache's dtype; attention per row and group of a rank's query
  heads sharing a KV head as an online softmax over the schedule's KV tiles, the queries and
  probabilities split in three bf16 parts (the layer library's ``tiled_attention``), whose
  carry starts from the heads' sinks (max = sink, denominator 1, accumulator 0); a sliding layer's
  cache as the kernel's ring (its slots, up to all of them once wrapped), each slot masked by
  the position it holds (written, causal, within the window);
* ``o_proj`` as per-rank partial sums over the heads all-reduced as the schedule says, then
  its bias added to the reduced sum, which is added to x;
* the router's top k of the biased logits, the weights ``exp(logit - max)`` of the picks
  divided by their sum over all E lanes (``_kernel_route_weights``); the routed experts per
  rank (``local_experts`` whole experts each, in id order), gate|up de-interleaved into the
  kernel's padded ``[gate | up]`` halves, each matrix pack group by pack group
  (``graph.pack_groups``), bias, clamped SwiGLU, down and its bias, each expert added as one
  fused ``acc + weight * out`` (`mkc.layers.moe.reference.expert_parallel_sum`); the partial
  sums all-reduced, then added to x.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.families.gpt_oss.config import FAMILY_NAME, GptOssDims, read_dims
from mkc.families.gpt_oss.graph import ATTENTION, pack_groups
from mkc.layers.gqa import GQA
from mkc.layers.gqa import reference as gqa_reference
from mkc.layers.gqa.reference import attend, tiled_attention  # noqa: F401  (the library's, as GPT-OSS runs them)
from mkc.layers.moe.reference import expert_parallel_sum
from mkc.layers.reference import rms_norm   # GptOssRMSNorm: a plain weight
from mkc.layers.reference import embed
from mkc.model.config import in_range, upstream_config
from mkc.model.mxfp4 import BLOCK_SIZE, mxfp4_dequantize_jax, mxfp4_quantize
from mkc.reference.rounding import Rounding, bf16_weights

SLIDING = "sliding_attention"
FULL = "full_attention"
ATTENTION_KINDS = {SLIDING: "swa", FULL: "gqa"}     # the schedule's layer kinds
MOE_KIND = "moe"
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
    """Zeroed decode state (module docstring): the library GQA's caches of each layer's kind."""
    cache: dict[str, jax.Array] = {}
    for i, kind in enumerate(cfg.attention_types):
        cache |= gqa_reference.init_cache(_attention(kind), cfg, i, batch, context)
    return cache


def _attention(kind: str) -> GQA:
    """The layer library's GQA of an upstream layer type (`graph.ATTENTION`)."""
    return ATTENTION[ATTENTION_KINDS[kind]][0]


# ---------------------------------------------------------------------------------------------
# Building blocks (public so tests can check them in isolation).


def linear(x: jax.Array, w: jax.Array, b: jax.Array | None = None) -> jax.Array:
    """``x @ w.T + b`` for a PyTorch-layout ``[out, in]`` weight, in full f32."""
    y = jnp.einsum("...i,oi->...o", x, w, precision=_HIGHEST)
    return y if b is None else y + b


def cache_slots(kind: str, slots: int, positions: jax.Array, window: int) -> tuple[jax.Array, jax.Array]:
    """(the slot each row's new token is written to, which slots it may attend) of a layer of
    upstream type `kind` (`mkc.layers.gqa.reference.cache_slots`)."""
    return gqa_reference.cache_slots(kind == SLIDING, slots, positions, window)


def attention_block(p: Mapping[str, jax.Array], cfg: GptOssDims, kind: str, x: jax.Array,
                    key_cache: jax.Array, value_cache: jax.Array, positions: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """GptOssAttention for the normed hidden ``[B, H]``: the layer library's GQA with biases and
    sinks, sliding on a ``sliding_attention`` layer (`mkc.layers.gqa.reference.block`), plus
    o_proj's bias. ``p`` maps names relative to ``self_attn.``. Returns (output ``[B, H]``,
    key_cache, value_cache)."""
    out, key_cache, value_cache = gqa_reference.block(_attention(kind), p, cfg, x, key_cache, value_cache,
                                                      positions)
    return out + p["o_proj.bias"], key_cache, value_cache


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


def selection_scores(logits: jax.Array, top_k: int) -> tuple[jax.Array, int]:
    """What ``route`` (same arguments) takes the top k of, and that k: the biased logits. The
    harness's near-tie rule reads it (``examples/generated_module``)."""
    return logits, top_k


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
                tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One decode token per row: (logits f32 ``[B, vocab]``, new cache). jit with
    ``jax.jit(decode_step, static_argnums=(1, 5))``; ``params`` may be numpy arrays.
    ``rounding`` switches on the kernel rounding emulation (module docstring)."""
    if rounding is not None:
        return _emulated_step(params, cfg, cache, tokens, positions, rounding)
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


# ---------------------------------------------------------------------------------------------
# The kernel rounding emulation (module docstring): each piece in the kernel's expression and
# shapes, jitted.


@jax.jit
def _kernel_norm(x: jax.Array, w: jax.Array, eps: jax.Array) -> jax.Array:
    """The kernel's RMS norm: ``x * rsqrt(mean(x^2) + eps) * w``; x [B, H], w [1, H]."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


@jax.jit
def _kernel_attn_residual(x: jax.Array, out: jax.Array, bias: jax.Array) -> jax.Array:
    """``x + (o_proj's reduced product + bias)``, as ``attn_residual`` adds it."""
    return x + (out + bias)


@jax.jit
def _kernel_route_weights(logits: jax.Array, ids: jax.Array) -> jax.Array:
    """Routing weights over every expert ``[B, E]`` as the kernel forms them
    (``mkc.layers.moe.lowering.top_k_softmax_weights``): ``exp(logit - row max)`` at the picked
    ``ids``, zero elsewhere, divided by their sum over all E lanes."""
    scaled = jnp.exp(logits - jnp.max(logits, axis=-1, keepdims=True))
    rows = jnp.arange(logits.shape[0])[:, None]
    kept = jnp.zeros_like(scaled).at[rows, ids].set(jnp.take_along_axis(scaled, ids, axis=-1))
    return kept / jnp.sum(kept, axis=-1, keepdims=True)


@functools.partial(jax.jit, static_argnums=(2, 3, 4))
def _kernel_swiglu(gate_up: jax.Array, bias: jax.Array, half: int, alpha: float,
                   limit: float) -> jax.Array:
    """The kernel's gate|up product plus its bias, then the clamped SwiGLU on its halves
    ``[B, 2 * half]`` -> ``[B, half]``."""
    gate_up = gate_up + bias
    gate = jnp.minimum(gate_up[:, :half], limit)
    up = jnp.clip(gate_up[:, half:2 * half], -limit, limit)
    return (up + 1.0) * (gate * jax.nn.sigmoid(gate * alpha))


def _kernel_expert(p: Mapping[str, jax.Array], cfg: GptOssDims, e: int) -> dict[str, jax.Array]:
    """Expert e as the kernel's slot holds it, decoded, in ``[out, in]``: gate_up's rows
    de-interleaved into ``[gate | up]`` halves of ``lane_pad(I)`` rows each (zero padded), its
    bias likewise; down's input columns padded to the same width."""
    inter, half = cfg.intermediate_size, -(-cfg.intermediate_size // 128) * 128
    w = {}
    for matrix in EXPERT_MATRICES:
        out, k = expert_shapes(cfg)[matrix]
        codes = jnp.asarray(p[f"experts.{matrix}_blocks"][e]).reshape(out, -1)
        w[matrix] = mxfp4_dequantize_jax(codes, jnp.asarray(p[f"experts.{matrix}_scales"][e]), (out, k))
    gu, bias = w["gate_up_proj"], p["experts.gate_up_proj_bias"][e]
    pad = half - inter
    return {"gate_up": jnp.concatenate([jnp.pad(gu[0::2], ((0, pad), (0, 0))),
                                        jnp.pad(gu[1::2], ((0, pad), (0, 0)))]),
            "gate_up_bias": jnp.concatenate([jnp.pad(bias[0::2], (0, pad)),
                                             jnp.pad(bias[1::2], (0, pad))])[None, :],
            "down": jnp.pad(w["down_proj"], ((0, 0), (0, pad))),
            "down_bias": p["experts.down_proj_bias"][e][None, :]}


def _emulated_moe(p: Mapping[str, jax.Array], cfg: GptOssDims, h: jax.Array,
                  rounding: Rounding) -> jax.Array:
    """The MoE sublayer's all-reduced routed sum (module docstring): the layer library's
    expert-parallel sum (`mkc.layers.moe.reference.expert_parallel_sum`; whole experts on every
    rank) of each expert as its slot holds it."""
    half = -(-cfg.intermediate_size // 128) * 128
    xin = rounding.mm_in(h)
    logits = rounding.linear(xin, p["router.weight"]) + p["router.bias"]
    ids, _ = route(logits, cfg.top_k)
    groups = pack_groups(cfg)

    def expert(e: int, cols: slice) -> jax.Array:
        w = _kernel_expert(p, cfg, e)
        act = _kernel_swiglu(rounding.linear(xin, w["gate_up"], groups["gate_up"]),
                             w["gate_up_bias"], half, cfg.swiglu_alpha, cfg.swiglu_limit)
        return rounding.linear(act, w["down"], groups["down"]) + w["down_bias"]

    return expert_parallel_sum(rounding, cfg.experts, _kernel_route_weights(logits, ids), cfg.hidden_size,
                               expert, MOE_KIND)


def _emulated_step(params: Mapping[str, Any], cfg: GptOssDims, cache: Mapping[str, jax.Array],
                   tokens: jax.Array, positions: jax.Array, rounding: Rounding
                   ) -> tuple[jax.Array, dict[str, jax.Array]]:
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    eps = jnp.float32(cfg.rms_norm_eps)
    x = embed(params, tokens, rounding)
    new_cache = dict(cache)
    for i, kind in enumerate(cfg.attention_types):
        lp = _sub_params(params, f"model.layers.{i}.")
        attn = {n[len("self_attn."):]: w for n, w in lp.items() if n.startswith("self_attn.")}
        keys, values = f"layers.{i}.key_cache", f"layers.{i}.value_cache"
        h = _kernel_norm(x, lp["input_layernorm.weight"][None, :], eps)
        out, new_cache[keys], new_cache[values] = gqa_reference.block(
            _attention(kind), attn, cfg, h, cache[keys], cache[values], positions, rounding,
            ATTENTION_KINDS[kind])
        x = _kernel_attn_residual(x, out, attn["o_proj.bias"][None, :])
        mlp = {n[len("mlp."):]: w for n, w in lp.items() if n.startswith("mlp.")}
        h = _kernel_norm(x, lp["post_attention_layernorm.weight"][None, :], eps)
        x = x + _emulated_moe(mlp, cfg, h, rounding)
    x = _kernel_norm(x, jnp.asarray(params["model.norm.weight"]).astype(jnp.float32)[None, :], eps)
    return rounding.linear(x, jnp.asarray(params["lm_head.weight"]).astype(jnp.float32)), new_cache
