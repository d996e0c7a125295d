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
from mkc.model.config import in_range, upstream_config
from mkc.reference.rounding import Rounding, allreduce, bf16_weights, round_to, row_parallel

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


def linear(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x @ w.T`` for a PyTorch-layout ``[out, in]`` weight, in full f32."""
    return jnp.einsum("...i,oi->...o", x, w, precision=_HIGHEST)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Zero-centred Qwen3_5RMSNorm over the last axis."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)


def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen3_5RMSNormGated: plain (not zero-centred) weight, then the SiLU gate."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w * jax.nn.silu(z)


def l2_normalize(x: jax.Array) -> jax.Array:
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + _L2NORM_EPS)


def rope_cos_sin(cfg: Qwen35Config, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[..., rotary_dim]`` for integer positions, halves duplicated (rotate-half form).

    Frequencies are computed in f64 and rounded once (the emulation uses the kernels' f32
    table instead, ``_rope_table``)."""
    rot = cfg.rotary_dim
    inv_freq = jnp.asarray(cfg.rope_theta ** (-np.arange(0, rot, 2, dtype=np.float64) / rot),
                           jnp.float32)
    freqs = positions.astype(jnp.float32)[..., None] * inv_freq
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb), jnp.sin(emb)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``cos.shape[-1]`` dims of x (rotate-half convention); pass the rest."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


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


def _mm_input(x: jax.Array, rounding: Rounding | None) -> jax.Array:
    return x if rounding is None else rounding.mm_in(x)


def _linear(x: jax.Array, w: jax.Array, rounding: Rounding | None) -> jax.Array:
    """An activation times a weight: in f32, or as the kernel multiplies (``Rounding.linear``)."""
    return linear(x, w) if rounding is None else rounding.linear(x, w)


def _out_projection(x: jax.Array, w: jax.Array, rounding: Rounding | None, kind: str, op: str,
                    per_rank: int, cls: str) -> jax.Array:
    """A projection back to the hidden size whose input, of shard class ``cls``, is split in
    contiguous ``per_rank`` ranges: plain, or per-rank partial sums all-reduced as the schedule
    says."""
    if rounding is None:
        return linear(x, w)
    return row_parallel(x, w, rounding.rank_ranges(cls, x.shape[-1], per_rank), rounding.ranks,
                        rounding, rounding.reduce(kind, op))


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
    """Qwen3_5Attention (gated GQA) for one token per row at its own position.

    ``p`` maps names relative to ``self_attn.`` to f32 arrays. Writes k/v at ``positions[b]``,
    then attends over slots ``0..positions[b]``. Returns (output ``[B, H]``, key_cache, value_cache).
    """
    b = x.shape[0]
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    x = _mm_input(x, rounding)
    q_and_gate = _linear(x, p["q_proj.weight"], rounding).reshape(b, hq, 2 * d)
    q, gate = q_and_gate[..., :d], q_and_gate[..., d:]
    k = _linear(x, p["k_proj.weight"], rounding).reshape(b, hkv, d)
    v = _linear(x, p["v_proj.weight"], rounding).reshape(b, hkv, d)

    if rounding is not None:
        cos, sin = _rope_table(positions, cfg.rope_theta, cfg.rotary_dim, d)
        q, k = (_head_norm_rope(t, p[f"{n}_norm.weight"], cos, sin, cfg.rotary_dim, cfg.rms_norm_eps)
                for t, n in ((q, "q"), (k, "k")))
    else:
        cos, sin = rope_cos_sin(cfg, positions)
        q = rms_norm(q, p["q_norm.weight"], cfg.rms_norm_eps)
        k = rms_norm(k, p["k_norm.weight"], cfg.rms_norm_eps)
        q = apply_partial_rope(q, cos[:, None, :], sin[:, None, :])
        k = apply_partial_rope(k, cos[:, None, :], sin[:, None, :])

    rows = jnp.arange(b)
    if rounding is not None:   # the kernel's KV storage dtype, then the reference's container
        k, v = (round_to(t, rounding.stored("gqa", "kv")) for t in (k, v))
    key_cache = key_cache.at[rows, :, positions].set(k.astype(key_cache.dtype))
    value_cache = value_cache.at[rows, :, positions].set(v.astype(value_cache.dtype))

    if rounding is not None:
        attn = _tiled_attention(q, key_cache, value_cache, positions, rounding.kv_tile("gqa"),
                                rounding.size("nq"))
    else:
        # Query head h = kv * group + r reads KV head kv (upstream repeat_kv order).
        qg = q.reshape(b, hkv, hq // hkv, d)
        scores = jnp.einsum("bgrd,bgtd->bgrt", qg, key_cache.astype(jnp.float32),
                            precision=_HIGHEST) * d ** -0.5
        visible = jnp.arange(key_cache.shape[2])[None, :] <= positions[:, None]  # [B, T]
        scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1)
        attn = jnp.einsum("bgrt,bgtd->bgrd", probs, value_cache.astype(jnp.float32),
                          precision=_HIGHEST)
    attn = attn.reshape(b, hq * d) * jax.nn.sigmoid(gate.reshape(b, hq * d))
    per_rank = None if rounding is None else rounding.size("nq") * d
    out = _out_projection(attn, p["o_proj.weight"], rounding, "gqa", "o_proj", per_rank, "heads")
    return out, key_cache, value_cache


@jax.jit
def _norm_rope(x, w, cos, sin, rotation, eps):
    """One head's zero-centred RMS norm and rotary embedding in the kernel's formulation and
    shapes: x [B, D]; cos, sin [B, D] (1 and 0 past the rotary dims); the rotation as a product
    with the rotate-half matrix, ``y * cos + (y @ R) * sin``, which XLA fuses into FMAs."""
    y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * (1.0 + w)
    return y * cos + jnp.dot(y, rotation, preferred_element_type=jnp.float32) * sin


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _rope_table(positions: jax.Array, theta: float, rot: int, d: int):
    """cos, sin [B, d] (1 and 0 past the ``rot`` rotary dims) in f32 as the kernel's host wrapper
    computes them, jitted as it is: XLA's fused cos and sin differ from the eager ones in the
    last bit for some angles."""
    inv_freq = 1.0 / (theta ** (jnp.arange(0, rot, 2, dtype=jnp.float32) / rot))
    ang = positions.astype(jnp.float32)[:, None] * inv_freq[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    ones = jnp.ones((positions.shape[0], d - rot), jnp.float32)
    return (jnp.concatenate([jnp.cos(ang), ones], axis=-1),
            jnp.concatenate([jnp.sin(ang), 0 * ones], axis=-1))


def _head_norm_rope(t: jax.Array, w: jax.Array, cos: jax.Array, sin: jax.Array, rot: int,
                    eps: float) -> jax.Array:
    """``_norm_rope`` head by head, as the kernel applies it (a norm over one head's [B, D]
    reduces in another f32 order than over [B, heads, D]). t [B, heads, D]; cos, sin [B, D]
    from ``_rope_table``."""
    d, half = t.shape[-1], rot // 2
    i, j = np.arange(d)[:, None], np.arange(d)[None, :]   # y @ R == rotate_half(y[:rot]), 0...
    rotation = np.where((j >= half) & (j < rot) & (i == j - half), 1.0,
                        np.where((j < half) & (i == j + half), -1.0, 0.0)).astype(np.float32)
    w = jnp.asarray(w, jnp.float32)[None, :]
    return jnp.stack([_norm_rope(t[:, h], w, cos, sin, rotation, eps) for h in range(t.shape[1])],
                     axis=1)


@jax.jit
def _attention_tile(q, k, v, visible, m, denom, acc):
    """One KV tile's online-softmax update for one query row and head, in the kernel's
    formulation and shapes (GPT-OSS's; q [1, D] f32; k, v [T, D] bf16; visible [1, T]; m,
    denom [1, 1]; acc [1, D]): jitted, so XLA fuses it as it fuses the kernel's (the rescaling ``alpha * acc
    + p @ v`` is one FMA there)."""
    d = q.shape[-1]
    s = jax.lax.dot_general(q, k.astype(jnp.float32), (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * d ** -0.5
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = alpha * acc + jnp.dot(p, v.astype(jnp.float32), preferred_element_type=jnp.float32)
    return m_new, denom_new, acc_new


def _split_bf16x3(x):
    """f32 [n, D] -> its high, middle and low bf16 parts stacked on rows [3n, D], as the
    kernel feeds an f32 operand against a bf16 one."""
    hi = x.astype(jnp.bfloat16)
    rest = x - hi.astype(jnp.float32)
    mid = rest.astype(jnp.bfloat16)
    lo = (rest - mid.astype(jnp.float32)).astype(jnp.bfloat16)
    return jnp.concatenate([hi, mid, lo], axis=0)


@jax.jit
def _attention_tile_bf16x3(q, k, v, visible, m, denom, acc):
    """`_attention_tile` as the Qwen kernel computes it: the bf16 tile fed as it is, the f32
    queries (q [n, D]) and probabilities split in three bf16 parts whose products are summed
    high + middle + low in f32."""
    n, d = q.shape
    s3 = jax.lax.dot_general(_split_bf16x3(q), k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32)
    s = ((s3[:n] + s3[n:2 * n]) + s3[2 * n:]) * d ** -0.5
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    alpha = jnp.exp(m - m_new)
    p = jnp.exp(s - m_new)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    pv3 = jnp.dot(_split_bf16x3(p), v, preferred_element_type=jnp.float32)
    acc_new = alpha * acc + ((pv3[:n] + pv3[n:2 * n]) + pv3[2 * n:])
    return m_new, denom_new, acc_new


def _tiled_attention(q: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                     positions: jax.Array, tile: int, per_rank: int | None = None) -> jax.Array:
    """Gated GQA's softmax(q k^T / sqrt(D)) v as the kernel sums it: per row and group of a
    rank's query heads sharing a KV head (``per_rank`` heads a rank) an online softmax over the
    cache in tiles of ``tile`` tokens (`_attention_tile_bf16x3`), every row over the tiles up to
    the largest position of the batch (a tile past a row's position changes nothing). A
    softmax over the whole cache at once sums in another f32 order, and a bf16 rounding
    downstream can flip (measured before: Qwen MINI batch 2, one weight draw, 1.5e-3 in the
    logits at step 0). q [B, Hq, D] -> [B, Hq, D]."""
    b, hq, d = q.shape
    hkv = key_cache.shape[1]
    n_tiles = int(jnp.max(positions)) // tile + 1
    keys = key_cache.astype(jnp.bfloat16)
    values = value_cache.astype(jnp.bfloat16)
    # a rank's query heads (`per_rank` of them, consecutive) that read one KV head go through
    # each tile together, as the kernel's do
    per_rank = per_rank or hq
    groups = [[h for h in range(r, min(r + per_rank, hq)) if (h * hkv) // hq == g]
              for r in range(0, hq, per_rank) for g in range(hkv)]
    rows = []
    for row in range(b):
        heads = []
        for group in groups:
            if not group:
                continue
            kvh = (group[0] * hkv) // hq
            n = len(group)
            carry = (jnp.full((n, 1), -1e30, jnp.float32), jnp.zeros((n, 1), jnp.float32),
                     jnp.zeros((n, d), jnp.float32))
            for t in range(n_tiles):
                tokens = t * tile + jnp.arange(tile)[None, :]
                carry = _attention_tile_bf16x3(q[row, group[0]:group[-1] + 1],
                                               keys[row, kvh, t * tile:(t + 1) * tile],
                                               values[row, kvh, t * tile:(t + 1) * tile],
                                               tokens <= positions[row], *carry)
            heads.append(carry[2] / carry[1])
        rows.append(jnp.concatenate(heads, axis=0))
    return jnp.stack(rows)


def mlp_block(p: Mapping[str, jax.Array], x: jax.Array, rounding: Rounding | None = None,
              kind: str = "") -> jax.Array:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``p`` keys are relative to ``mlp.``. With
    ``rounding``, ``kind`` names the layer kind whose ``down`` all-reduce applies."""
    x = _mm_input(x, rounding)
    act = (jax.nn.silu(_linear(x, p["gate_proj.weight"], rounding))
           * _linear(x, p["up_proj.weight"], rounding))
    per_rank = None if rounding is None else rounding.size("inter")
    return _out_projection(act, p["down_proj.weight"], rounding, kind, "down", per_rank, "mlp")


def _sub_params(params: Mapping[str, Any], prefix: str) -> dict[str, jax.Array]:
    """Parameters under ``prefix``, renamed relative to it and upcast to f32."""
    return {name[len(prefix):]: jnp.asarray(w).astype(jnp.float32)
            for name, w in params.items() if name.startswith(prefix)}


def embed(params: Mapping[str, Any], tokens: jax.Array, rounding: Rounding | None = None
          ) -> jax.Array:
    """Token embeddings ``[B, H]`` f32. With ``rounding``: as the vocab-sharded kernel forms
    them, each rank contributing the rows it owns (zeros elsewhere) to the embedding all-reduce
    (exact for bf16 rows on a bf16 or f32 wire, emulated all the same)."""
    table = jnp.asarray(params["model.embed_tokens.weight"])
    x = table[tokens].astype(jnp.float32)
    if rounding is None:
        return x
    owner = tokens // rounding.size("vocab")
    partials = [jnp.where((owner == rounding.part("vocab", r))[:, None], x, 0.0)
                for r in range(rounding.ranks)]
    return allreduce(partials, rounding.reduce("embed", "embed"))


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
