"""Pure-JAX reference decode for the Hugging Face ``qwen3_5_text`` family (Qwen3.5 / Qwen 3.8 dense).

This is the oracle the megakernels are checked against, so it deliberately shares no code with
them and favours plain, readable math over speed. It follows upstream transformers
``models/qwen3_5/modeling_qwen3_5.py`` (``Qwen3_5ForCausalLM``) for one decode token per row:

* residual stream, norms, projections, softmax and the recurrence are all f32; bf16 weights are
  upcast, and every dot uses ``Precision.HIGHEST`` so the result is f32 on any backend;
* ``Qwen3_5RMSNorm`` (input/post-attention/final norms, q_norm, k_norm) is zero-centred:
  ``x * rsqrt(mean(x^2) + eps) * (1 + w)``; the gated-delta-net output norm
  ``Qwen3_5RMSNormGated`` is NOT: ``x * rsqrt(mean(x^2) + eps) * w * silu(z)``;
* full attention: q_proj rows are per head ``[query(D) | gate(D)]``; q_norm/k_norm per head,
  then non-interleaved (rotate-half) RoPE on the first ``rotary_dim`` dims of each head; GQA with
  query head h reading KV head ``h // (Hq // Hkv)``; output multiplied by ``sigmoid(gate)``;
  M-RoPE sections are ignored because for text all three position axes are equal, which makes
  the interleaved M-RoPE identical to plain RoPE;
* gated delta net: causal depthwise conv (no bias) + SiLU over ``[q | k | v]``, q/k L2-normalised
  (``x * rsqrt(sum x^2 + 1e-6)``), q scaled by ``Dk**-0.5``, value head h uses key head
  ``h // (Hv // Hk)``, ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``.

State layouts (``init_cache``; B = batch, T = context):

* ``layers.{i}.conv_state``      bf16 ``[B, conv_dim, K-1]`` (linear layers), ``conv_dim =
  2*Hk*Dk + Hv*Dv`` with channels in ``in_proj_qkv`` row order ``[q | k | v]``; the last axis is
  time, oldest first: ``[..., K-2]`` is the previous token's ``in_proj_qkv`` output. The new
  token's window is ``concat(conv_state, x_t)`` and conv tap ``j`` multiplies window slot ``j``
  (tap K-1 multiplies the current token), as ``F.conv1d`` with left padding K-1 does.
* ``layers.{i}.recurrent_state`` f32  ``[B, Hv, Dk, Dv]``: per value head the matrix S with
  ``o = S^T q`` (sum over the key axis), exactly upstream's layout.
* ``layers.{i}.key_cache`` / ``layers.{i}.value_cache`` bf16 ``[B, Hkv, T, D]`` (full layers):
  slot t holds position t; keys are stored after k_norm and RoPE.

bf16 storage is applied where a value enters a cache (conv inputs, k, v), and the new token's
own entry is read back from the cache, so a token sees identical values whether it is the
current one or a past one. Row b attends to slots ``0..positions[b]`` inclusive; positions must
be < T (out-of-range writes are dropped by JAX scatter semantics). The conv and recurrent states
advance by one token on every call, whatever the position: feed each row its tokens in order.

Kernel rounding emulation: every function that computes takes an optional ``rounding``
(``mkc.reference.rounding.Rounding``, built from a compiled schedule by
``mkc.numerics.rounding_from_ir``). With it the step rounds where the generated kernel does:
matmul activations to bf16; ``out_proj``/``o_proj``/``down`` as per-rank partial sums (heads
and MLP columns split evenly over the ranks, ``per_rank`` sizes of the schedule) all-reduced
stage by stage on the spec's wire dtype; the embedding's exact all-reduce likewise; RoPE
tables computed in f32 as the kernel's host wrapper does; states in their storage dtype. It
also sums in the kernel's f32 order (``mkc.numerics``): attention as an online softmax over the
schedule's KV tiles, norms, rotary embedding, the delta rule and its gated norm head by head
and row by row, the conv tap by tap (its SiLU's two factors go to the delta rule, which fuses
them into ``v - k S`` as the kernel does), each jitted in the kernel's formulation and shapes.
Layer kinds are the schedule's names: linear attention is ``gdn``, full attention ``gqa``.
Without it (the default) the math is the plain f32 oracle above.
"""
from __future__ import annotations

import functools
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.families.qwen3_5.config import LAYER_KINDS, AttentionDims, read_dims
from mkc.families.qwen3_5.graph import GATED_ATTENTION
from mkc.layers.gqa import reference as gqa
from mkc.layers.reference import embed, linear  # noqa: F401
from mkc.layers.reference import matmul as _linear
from mkc.layers.reference import mm_input as _mm_input
from mkc.layers.reference import out_projection as _out_projection
from mkc.layers.reference import rms_norm_zero_centred as rms_norm
from mkc.layers.reference import sub_params as _sub_params
from mkc.layers.swiglu.reference import block as mlp_block
from mkc.model.config import in_range, upstream_config
from mkc.reference.rounding import Rounding, bf16_weights, round_to

LINEAR = "linear_attention"
FULL = "full_attention"

_HIGHEST = jax.lax.Precision.HIGHEST
_L2NORM_EPS = 1e-6  # fixed inside upstream's l2norm, not tied to rms_norm_eps

@dataclass(frozen=True)
class Qwen35Config:
    """The fields the decode math needs; hashable so it can be a static jit argument."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    layer_kinds: tuple[str, ...]  # LINEAR or FULL per layer
    rms_norm_eps: float
    tie_word_embeddings: bool
    # full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    rotary_dim: int               # the rotated dims of each head (partial RoPE)
    # gated delta net (linear attention)
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def partial_rotary_factor(self) -> float:
        return self.rotary_dim / self.head_dim

    @property
    def linear_key_dim(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_dim(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_dim(self) -> int:
        return 2 * self.linear_key_dim + self.linear_value_dim

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == FULL)

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == LINEAR)


def load_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> Qwen35Config:
    """The config of a qwen3_5_text model (dict, config.json path, or checkpoint directory; a
    composite ``qwen3_5`` config's ``text_config``), read by the family's one config reader
    (``config.read_dims``: upstream defaults for omitted keys, ConfigError, a ValueError, for
    settings mkc does not compute)."""
    raw, name = upstream_config(path_or_dict)
    model_type = raw.get("model_type", "qwen3_5_text")
    if model_type != "qwen3_5_text":
        raise ValueError(f"expected model_type 'qwen3_5_text', got {model_type!r}")
    return config_of(in_range(read_dims(raw, name)))


def config_of(dims: AttentionDims, intermediate_size: int | None = None) -> Qwen35Config:
    """The reference's config of a model's dims (``intermediate_size``: the dense MLP's width,
    the dims' own if not given): its attention layers' kinds by their upstream names (an MoE
    model's dims list its ``moe`` sublayers too)."""
    upstream = {kind: t for t, kind in LAYER_KINDS.items()}
    return Qwen35Config(
        vocab_size=dims.vocab_size, hidden_size=dims.hidden_size,
        intermediate_size=getattr(dims, "intermediate_size", 0) if intermediate_size is None
        else intermediate_size,
        num_hidden_layers=dims.num_hidden_layers,
        layer_kinds=tuple(upstream[k] for k in dims.layer_kinds if k in upstream),
        rms_norm_eps=dims.rms_norm_eps, tie_word_embeddings=False,
        num_attention_heads=dims.num_attention_heads, num_key_value_heads=dims.num_key_value_heads,
        head_dim=dims.head_dim, rope_theta=dims.rope_theta, rotary_dim=dims.rotary_dim,
        linear_num_key_heads=dims.linear_num_key_heads,
        linear_num_value_heads=dims.linear_num_value_heads,
        linear_key_head_dim=dims.linear_key_head_dim,
        linear_value_head_dim=dims.linear_value_head_dim,
        linear_conv_kernel_dim=dims.linear_conv_kernel_dim)


def param_shapes(cfg: Qwen35Config) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every HF parameter name of ``Qwen3_5ForCausalLM`` -> (PyTorch shape, dtype name).

    Linear weights are ``[out, in]``; ``conv1d.weight`` is ``[conv_dim, 1, K]`` (depthwise).
    """
    h, d = cfg.hidden_size, cfg.head_dim
    bf16 = "bfloat16"
    shapes: dict[str, tuple[tuple[int, ...], str]] = {
        "model.embed_tokens.weight": ((cfg.vocab_size, h), bf16),
    }
    for i, kind in enumerate(cfg.layer_kinds):
        p = f"model.layers.{i}."
        if kind == LINEAR:
            hv = cfg.linear_num_value_heads
            shapes |= {
                p + "linear_attn.in_proj_qkv.weight": ((cfg.linear_conv_dim, h), bf16),
                p + "linear_attn.in_proj_z.weight": ((cfg.linear_value_dim, h), bf16),
                p + "linear_attn.in_proj_b.weight": ((hv, h), bf16),
                p + "linear_attn.in_proj_a.weight": ((hv, h), bf16),
                p + "linear_attn.conv1d.weight": ((cfg.linear_conv_dim, 1, cfg.linear_conv_kernel_dim), bf16),
                p + "linear_attn.dt_bias": ((hv,), bf16),
                p + "linear_attn.A_log": ((hv,), bf16),
                p + "linear_attn.norm.weight": ((cfg.linear_value_head_dim,), bf16),
                p + "linear_attn.out_proj.weight": ((h, cfg.linear_value_dim), bf16),
            }
        else:
            hq, hkv = cfg.num_attention_heads, cfg.num_key_value_heads
            shapes |= {
                p + "self_attn.q_proj.weight": ((2 * hq * d, h), bf16),
                p + "self_attn.k_proj.weight": ((hkv * d, h), bf16),
                p + "self_attn.v_proj.weight": ((hkv * d, h), bf16),
                p + "self_attn.o_proj.weight": ((h, hq * d), bf16),
                p + "self_attn.q_norm.weight": ((d,), bf16),
                p + "self_attn.k_norm.weight": ((d,), bf16),
            }
        shapes |= {
            p + "mlp.gate_proj.weight": ((cfg.intermediate_size, h), bf16),
            p + "mlp.up_proj.weight": ((cfg.intermediate_size, h), bf16),
            p + "mlp.down_proj.weight": ((h, cfg.intermediate_size), bf16),
            p + "input_layernorm.weight": ((h,), bf16),
            p + "post_attention_layernorm.weight": ((h,), bf16),
        }
    shapes["model.norm.weight"] = ((h,), bf16)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = ((cfg.vocab_size, h), bf16)
    return shapes


def init_params(cfg: Qwen35Config, seed: int) -> dict[str, np.ndarray]:
    """Random bf16 parameters scaled so the residual stream and logits stay O(1) at any depth.

    Projections are N(0, 1/fan_in); the projections that write into the residual stream are
    further scaled by 1/sqrt(2 * layers) so its variance stays bounded. Zero-centred norm weights
    are small noise around 0 (gain ~1) so the ``1 + w`` path is exercised; the gated norm weight
    is noise around 1. A_log and dt_bias follow the Mamba-2 style ranges of upstream init
    (A in [1, 16], dt in [1e-3, 1e-1]) so per-step decays spread over roughly (0.2, 1).
    """
    rng = np.random.default_rng(seed)
    residual_scale = 1.0 / math.sqrt(2 * cfg.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, (shape, _) in param_shapes(cfg).items():
        if name == "model.embed_tokens.weight":
            w = rng.normal(0.0, 1.0, shape)
        elif name.endswith("linear_attn.norm.weight"):
            w = 1.0 + rng.normal(0.0, 0.1, shape)
        elif name.endswith("norm.weight"):  # every zero-centred Qwen3_5RMSNorm
            w = rng.normal(0.0, 0.1, shape)
        elif name.endswith("A_log"):
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif name.endswith("dt_bias"):
            dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
            w = np.log(np.expm1(dt))  # inverse softplus, so softplus(dt_bias) == dt
        elif name.endswith("conv1d.weight"):
            w = rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), shape)
        else:
            fan_in = shape[-1]
            std = 1.0 / math.sqrt(fan_in)
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
                std *= residual_scale
            elif name.endswith("in_proj_a.weight"):
                std *= 0.5  # keep softplus(a + dt_bias) near dt rather than saturating
            w = rng.normal(0.0, std, shape)
        out[name] = bf16_weights(w)
    return out


def init_cache(cfg: Qwen35Config, batch: int, context: int) -> dict[str, jax.Array]:
    """Zeroed decode state; see the module docstring for the layouts."""
    cache: dict[str, jax.Array] = {}
    for i, kind in enumerate(cfg.layer_kinds):
        if kind == LINEAR:
            cache[f"layers.{i}.conv_state"] = jnp.zeros(
                (batch, cfg.linear_conv_dim, cfg.linear_conv_kernel_dim - 1), jnp.bfloat16)
            cache[f"layers.{i}.recurrent_state"] = jnp.zeros(
                (batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim),
                jnp.float32)
        else:
            kv_shape = (batch, cfg.num_key_value_heads, context, cfg.head_dim)
            cache[f"layers.{i}.key_cache"] = jnp.zeros(kv_shape, jnp.bfloat16)
            cache[f"layers.{i}.value_cache"] = jnp.zeros(kv_shape, jnp.bfloat16)
    return cache


# ---------------------------------------------------------------------------------------------
# Building blocks (public so tests can check them in isolation).


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen3_5RMSNormGated: plain (not zero-centred) weight, then the SiLU gate."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w * jax.nn.silu(z)


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2NORM_EPS)


def gated_delta_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                     g: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule for any leading batch/head axes.

    state ``[..., Dk, Dv]``, q/k ``[..., Dk]`` (already normalised/scaled), v ``[..., Dv]``,
    g/beta ``[...]``. Returns (o ``[..., Dv]``, new state):
    ``S *= exp(g); S += k (x) ((v - S^T k) * beta); o = S^T q``.
    """
    state = state * jnp.exp(g)[..., None, None]
    predicted = jnp.einsum("...kv,...k->...v", state, k, precision=_HIGHEST)
    delta = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * delta[..., None, :]
    o = jnp.einsum("...kv,...k->...v", state, q, precision=_HIGHEST)
    return o, state


@jax.jit
def _conv_silu(window: jax.Array, taps: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The depthwise causal conv and SiLU of one step as the kernel sums it: window [B, C, K]
    oldest first, taps [C, 1, K]; tap by tap, ``acc + window_j * tap_j`` (one FMA each), where
    a sum over the tap axis adds in another order. Returns (``silu(acc)``, and its two factors
    ``acc`` and ``sigmoid(acc)``: the values enter the delta rule as the factors,
    ``_delta_rule_head``)."""
    acc = window[:, :, 0] * taps[None, :, 0, 0]
    for j in range(1, window.shape[-1]):
        acc = acc + window[:, :, j] * taps[None, :, 0, j]
    gate = jax.nn.sigmoid(acc)
    return acc * gate, acc, gate


@jax.jit
def _decay_gate(a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """g = -exp(A_log) * softplus(a + dt_bias), softplus written as the kernel writes it."""
    x = a + dt_bias
    return -jnp.exp(a_log) * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))


@jax.jit
def _delta_rule_head(state, q, k, v_pre, v_gate, g, beta):
    """One row's and head's gated delta rule in the kernel's formulation and shapes: state
    [Dk, Dv]; q, k [1, Dk] before their l2 norm; the values [1, Dv] as their SiLU factors
    ``v = v_pre * v_gate``; g, beta [1, 1]. The kernel's conv SiLU is fused into its
    ``v - k S``, one multiply-add: a rounded v there is an ulp off in about 1/6 of the state
    from step 1 on (where ``k S`` is not zero)."""
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    state = state * jnp.exp(g)
    predicted = jnp.dot(k, state, preferred_element_type=jnp.float32)
    state = state + jnp.transpose(k) * ((v_pre * v_gate - predicted) * beta)
    return jnp.dot(q, state, preferred_element_type=jnp.float32), state


@functools.partial(jax.jit, static_argnames=("eps",))
def _gated_norm_heads(o: jax.Array, z: jax.Array, w: jax.Array, *, eps: float) -> jax.Array:
    """``gated_rms_norm`` as the kernel runs it, jitted: head by head on ``[B, Dv]`` (o, z
    ``[B, Hv, Dv]``). Eager over all heads at once it rounds otherwise: measured, Qwen MINI
    from position 141, batch 2, step 1, 9.5e-7 apart, which flipped a bf16 input of layer 4's
    out_proj (logits up to 7.1e-3 from the kernel's)."""
    return jnp.stack([gated_rms_norm(o[:, h], z[:, h], w, eps) for h in range(o.shape[1])], axis=1)


def _delta_rule_rows(state: jax.Array, q: jax.Array, k: jax.Array, v_pre: jax.Array,
                     v_gate: jax.Array, g: jax.Array, beta: jax.Array
                     ) -> tuple[jax.Array, jax.Array]:
    """The gated delta rule row by row and value head by value head, as the kernel runs it (a
    batched product sums in another f32 order once there are more than 2 rows). state
    [B, Hv, Dk, Dv]; q, k [B, Hk, Dk] (value head h reads key head h // (Hv / Hk)); the values
    v_pre, v_gate [B, Hv, Dv] (their SiLU factors); g, beta [B, Hv] -> (o [B, Hv, Dv], new
    state)."""
    b, hv = v_pre.shape[:2]
    group = hv // q.shape[1]
    outs, states = [], []
    for row in range(b):
        for h in range(hv):
            o, s = _delta_rule_head(state[row, h], q[row, h // group][None],
                                    k[row, h // group][None], v_pre[row, h][None],
                                    v_gate[row, h][None], g[row, h].reshape(1, 1),
                                    beta[row, h].reshape(1, 1))
            outs.append(o[0])
            states.append(s)
    return (jnp.stack(outs).reshape(b, hv, -1),
            jnp.stack(states).reshape(b, hv, *state.shape[2:]))


def linear_attention_block(p: Mapping[str, jax.Array], cfg: Qwen35Config, x: jax.Array,
                           conv_state: jax.Array, recurrent_state: jax.Array,
                           rounding: Rounding | None = None
                           ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Qwen3_5GatedDeltaNet for one token per row.

    ``p`` maps names relative to ``linear_attn.`` (e.g. ``"in_proj_qkv.weight"``) to f32 arrays;
    x is the normed hidden ``[B, H]``. Returns (output ``[B, H]``, new conv_state, new recurrent_state).
    """
    b = x.shape[0]
    x = _mm_input(x, rounding)
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim

    mixed = _linear(x, p["in_proj_qkv.weight"], rounding)
    if rounding is not None:   # the kernel rounds conv inputs to bf16 whatever holds the state
        mixed = round_to(mixed, "bf16")
    mixed = mixed.astype(conv_state.dtype)
    window = jnp.concatenate([conv_state, mixed[:, :, None]], axis=-1)  # [B, C, K], oldest first
    if rounding is not None:
        conv, pre, gate = _conv_silu(window.astype(jnp.float32),
                                     jnp.asarray(p["conv1d.weight"], jnp.float32))
    else:
        conv = jnp.sum(window.astype(jnp.float32) * p["conv1d.weight"][:, 0, :], axis=-1)
        conv = jax.nn.silu(conv)

    q, k, v = jnp.split(conv, [cfg.linear_key_dim, 2 * cfg.linear_key_dim], axis=-1)
    if rounding is not None:
        a = _linear(x, p["in_proj_a.weight"], rounding)
        beta = jax.nn.sigmoid(_linear(x, p["in_proj_b.weight"], rounding))
        g = _decay_gate(a, jnp.asarray(p["A_log"], jnp.float32)[None],
                        jnp.asarray(p["dt_bias"], jnp.float32)[None])
        values = 2 * cfg.linear_key_dim
        o, recurrent_state = _delta_rule_rows(recurrent_state, q.reshape(b, hk, dk),
                                              k.reshape(b, hk, dk),
                                              pre[:, values:].reshape(b, hv, dv),
                                              gate[:, values:].reshape(b, hv, dv), g, beta)
    else:
        q = l2_normalize(q.reshape(b, hk, dk)) * dk ** -0.5
        k = l2_normalize(k.reshape(b, hk, dk))
        v = v.reshape(b, hv, dv)
        # Consecutive grouping, as torch.repeat_interleave: value head h reads key head h // group.
        group = hv // hk
        q, k = jnp.repeat(q, group, axis=1), jnp.repeat(k, group, axis=1)
        beta = jax.nn.sigmoid(linear(x, p["in_proj_b.weight"]))
        g = -jnp.exp(p["A_log"]) * jax.nn.softplus(linear(x, p["in_proj_a.weight"]) + p["dt_bias"])
        o, recurrent_state = gated_delta_step(recurrent_state, q, k, v, g, beta)

    z = _linear(x, p["in_proj_z.weight"], rounding).reshape(b, hv, dv)
    if rounding is None:
        o = gated_rms_norm(o, z, p["norm.weight"], cfg.rms_norm_eps)
    else:
        o = _gated_norm_heads(o, z, jnp.asarray(p["norm.weight"], jnp.float32), eps=cfg.rms_norm_eps)
    conv_state = window[:, :, 1:]
    if rounding is not None:
        conv_state = round_to(conv_state.astype(jnp.float32),
                              rounding.stored("gdn", "conv")).astype(conv_state.dtype)
        recurrent_state = round_to(recurrent_state, rounding.stored("gdn", "recurrent"))
    per_rank = None if rounding is None else rounding.size("nv") * dv
    out = _out_projection(o.reshape(b, hv * dv), p["out_proj.weight"], rounding, "gdn", "out_proj",
                          per_rank, "heads")
    return out, conv_state, recurrent_state


def full_attention_block(p: Mapping[str, jax.Array], cfg: Qwen35Config, x: jax.Array,
                         key_cache: jax.Array, value_cache: jax.Array, positions: jax.Array,
                         rounding: Rounding | None = None
                         ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Qwen3_5Attention (the layer library's GQA with its output gate and zero-centred q/k
    norms): ``p`` maps names relative to ``self_attn.`` to f32 arrays; returns (output
    ``[B, H]``, key_cache, value_cache)."""
    return gqa.block(GATED_ATTENTION, p, cfg, x, key_cache, value_cache, positions, rounding)


def _dense_mlp(mlp: Mapping[str, jax.Array], cfg: Qwen35Config, x: jax.Array,
               rounding: Rounding | None, kind: str) -> jax.Array:
    return mlp_block(mlp, x, rounding, LAYER_KINDS[kind])


def decode_hidden(params: Mapping[str, Any], cfg: Qwen35Config, cache: Mapping[str, jax.Array],
                  tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None,
                  mlp: Any = _dense_mlp, mlp_residual: Any = None
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """All decoder layers for one token per row: (residual stream ``[B, H]`` before the final
    norm, new cache). ``decode_step`` adds the final norm and the LM head. ``mlp(params under
    mlp., cfg, normed x, rounding, layer type)`` is each layer's MLP (a family with another MLP,
    such as Qwen3.5 MoE, passes its own), added to the residual stream; or, when given,
    ``mlp_residual(params under mlp., cfg, residual, normed x, rounding, layer type)`` returns
    the residual stream after the MLP (for a kernel that adds the MLP's parts to it one by one)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.asarray(positions, jnp.int32)
    x = embed(params, tokens, rounding)
    new_cache = dict(cache)
    eps = cfg.rms_norm_eps
    for i, kind in enumerate(cfg.layer_kinds):
        lp = _sub_params(params, f"model.layers.{i}.")
        h = rms_norm(x, lp["input_layernorm.weight"], eps)
        if kind == LINEAR:
            sub = {n[len("linear_attn."):]: w for n, w in lp.items() if n.startswith("linear_attn.")}
            out, new_cache[f"layers.{i}.conv_state"], new_cache[f"layers.{i}.recurrent_state"] = (
                linear_attention_block(sub, cfg, h, cache[f"layers.{i}.conv_state"],
                                       cache[f"layers.{i}.recurrent_state"], rounding))
        else:
            sub = {n[len("self_attn."):]: w for n, w in lp.items() if n.startswith("self_attn.")}
            out, new_cache[f"layers.{i}.key_cache"], new_cache[f"layers.{i}.value_cache"] = (
                full_attention_block(sub, cfg, h, cache[f"layers.{i}.key_cache"],
                                     cache[f"layers.{i}.value_cache"], positions, rounding))
        x = x + out
        sub = {n[len("mlp."):]: w for n, w in lp.items() if n.startswith("mlp.")}
        h = rms_norm(x, lp["post_attention_layernorm.weight"], eps)
        x = (x + mlp(sub, cfg, h, rounding, kind) if mlp_residual is None
             else mlp_residual(sub, cfg, x, h, rounding, kind))
    return x, new_cache


def decode_step(params: Mapping[str, Any], cfg: Qwen35Config, cache: Mapping[str, jax.Array],
                tokens: jax.Array, positions: jax.Array, rounding: Rounding | None = None
                ) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One decode token per row: (logits f32 ``[B, vocab]``, new cache).

    jit with ``jax.jit(decode_step, static_argnums=(1, 5))``; ``params`` may be numpy bf16
    arrays. ``rounding`` switches on the kernel rounding emulation (module docstring).
    """
    x, new_cache = decode_hidden(params, cfg, cache, tokens, positions, rounding)
    x = rms_norm(x, jnp.asarray(params["model.norm.weight"]).astype(jnp.float32), cfg.rms_norm_eps)
    head = params["model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]
    return _linear(x, jnp.asarray(head).astype(jnp.float32), rounding), new_cache
