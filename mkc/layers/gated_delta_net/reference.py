"""The reference of `GatedDeltaNet` (transformers' `Qwen3_5GatedDeltaNet`) for one token per
row: a causal depthwise conv (no bias) and SiLU over ``[q | k | v]``, q and k L2-normalised
(``x * rsqrt(sum x^2 + 1e-6)``), q scaled by ``Dk**-0.5``, value head h reading key head
``h // (Hv // Hk)``, ``beta = sigmoid(b)``, ``g = -exp(A_log) * softplus(a + dt_bias)``, the
gated delta rule, the output norm ``Qwen3_5RMSNormGated`` (plain weight, NOT zero-centred:
``x * rsqrt(mean(x^2) + eps) * w * silu(z)``) and ``out_proj``. Parameters under the layer's
`s.prefix` (``linear_attn.``).

States (``init_cache``; B = batch):

* ``layers.{i}.conv_state``      bf16 ``[B, conv_dim, K-1]``, ``conv_dim = 2*Hk*Dk + Hv*Dv``
  with channels in ``in_proj_qkv`` row order ``[q | k | v]``; the last axis is time, oldest
  first: ``[..., K-2]`` is the previous token's ``in_proj_qkv`` output. The new token's window
  is ``concat(conv_state, x_t)`` and conv tap ``j`` multiplies window slot ``j`` (tap K-1
  multiplies the current token), as ``F.conv1d`` with left padding K-1 does.
* ``layers.{i}.recurrent_state`` f32 ``[B, Hv, Dk, Dv]``: per value head the matrix S with
  ``o = S^T q`` (sum over the key axis), exactly upstream's layout.

The conv input is stored in the state's dtype before the conv reads it. The states advance by
one token on every call, whatever the position: feed each row its tokens in order.

With a `Rounding` it rounds where the generated kernel does and sums in the kernel's f32
order (`mkc.numerics`): the delta rule and its gated norm head by head and row by row, the conv
tap by tap (its SiLU's two factors go to the delta rule, which fuses them into ``v - k S`` as
the kernel does), each jitted in the kernel's formulation and shapes; ``out_proj`` as per-rank
partial sums over the heads' ranks all-reduced as the schedule says.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers.gated_delta_net import GatedDeltaNet
from mkc.layers.reference import (NORM, delta_rule_update, kernel_conv_silu, kernel_delta_update,
                                  l2_normalize, linear, matmul, mm_input, out_projection)
from mkc.reference.rounding import Rounding, round_to

def gated_rms_norm(x: jax.Array, z: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """Qwen3_5RMSNormGated: plain (not zero-centred) weight, then the SiLU gate."""
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w * jax.nn.silu(z)


def gated_delta_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                     g: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the gated delta rule for any leading batch/head axes.

    state ``[..., Dk, Dv]``, q/k ``[..., Dk]`` (already normalised/scaled), v ``[..., Dv]``,
    g/beta ``[...]``. Returns (o ``[..., Dv]``, new state):
    ``S *= exp(g); S += k (x) ((v - S^T k) * beta); o = S^T q``.
    """
    return delta_rule_update(state * jnp.exp(g)[..., None, None], q, k, v, beta)


@jax.jit
def _decay_gate(a: jax.Array, a_log: jax.Array, dt_bias: jax.Array) -> jax.Array:
    """g = -exp(A_log) * softplus(a + dt_bias), softplus written as the kernel writes it."""
    x = a + dt_bias
    return -jnp.exp(a_log) * (jnp.maximum(x, 0.0) + jnp.log(1.0 + jnp.exp(-jnp.abs(x))))


@jax.jit
def _delta_rule_head(state, q, k, v_pre, v_gate, g, beta):
    """One row's and head's gated delta rule in the kernel's formulation and shapes: state
    [Dk, Dv]; q, k [1, Dk] before their l2 norm; the values [1, Dv] as their SiLU factors
    ``v = v_pre * v_gate`` (`kernel_delta_update`); g, beta [1, 1]."""
    q = l2_normalize(q) * q.shape[-1] ** -0.5
    k = l2_normalize(k)
    return kernel_delta_update(state * jnp.exp(g), q, k, v_pre, v_gate, beta)


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


def block(p: Mapping[str, jax.Array], d: Any, x: jax.Array, conv_state: jax.Array,
          recurrent_state: jax.Array, rounding: Rounding | None = None, kind: str = "gdn"
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Qwen3_5GatedDeltaNet for one token per row.

    ``p`` maps names relative to ``linear_attn.`` (e.g. ``"in_proj_qkv.weight"``) to f32 arrays;
    x is the normed hidden ``[B, H]``; with ``rounding``, ``kind`` names the layer kind whose
    storage dtypes and ``out_proj`` all-reduce apply. Returns (output ``[B, H]``, new
    conv_state, new recurrent_state).
    """
    b = x.shape[0]
    x = mm_input(x, rounding)
    hk, hv = d.linear_num_key_heads, d.linear_num_value_heads
    dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
    key_dim = hk * dk

    mixed = matmul(x, p["in_proj_qkv.weight"], rounding, kind, "in_proj", by_tiles=True)
    if rounding is not None:   # the kernel rounds conv inputs to bf16 whatever holds the state
        mixed = round_to(mixed, "bf16")
    mixed = mixed.astype(conv_state.dtype)
    window = jnp.concatenate([conv_state, mixed[:, :, None]], axis=-1)  # [B, C, K], oldest first
    if rounding is not None:
        conv, pre, gate = kernel_conv_silu(window.astype(jnp.float32),
                                     jnp.asarray(p["conv1d.weight"], jnp.float32))
    else:
        conv = jnp.sum(window.astype(jnp.float32) * p["conv1d.weight"][:, 0, :], axis=-1)
        conv = jax.nn.silu(conv)

    q, k, v = jnp.split(conv, [key_dim, 2 * key_dim], axis=-1)
    if rounding is not None:
        a = matmul(x, p["in_proj_a.weight"], rounding, kind, "in_proj", by_tiles=True)
        beta = jax.nn.sigmoid(matmul(x, p["in_proj_b.weight"], rounding, kind, "in_proj", by_tiles=True))
        g = _decay_gate(a, jnp.asarray(p["A_log"], jnp.float32)[None],
                        jnp.asarray(p["dt_bias"], jnp.float32)[None])
        values = 2 * key_dim
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

    z = matmul(x, p["in_proj_z.weight"], rounding, kind, "in_proj", by_tiles=True).reshape(b, hv, dv)
    if rounding is None:
        o = gated_rms_norm(o, z, p["norm.weight"], d.rms_norm_eps)
    else:
        o = _gated_norm_heads(o, z, jnp.asarray(p["norm.weight"], jnp.float32), eps=d.rms_norm_eps)
    conv_state = window[:, :, 1:]
    if rounding is not None:
        conv_state = round_to(conv_state.astype(jnp.float32),
                              rounding.stored(kind, "conv")).astype(conv_state.dtype)
        recurrent_state = round_to(recurrent_state, rounding.stored(kind, "recurrent"))
    per_rank = None if rounding is None else rounding.size("nv") * dv
    out = out_projection(o.reshape(b, hv * dv), p["out_proj.weight"], rounding, kind, "out_proj",
                          per_rank, "heads", by_tiles=True)
    return out, conv_state, recurrent_state


def forward(s: GatedDeltaNet, lp: Mapping[str, jax.Array], d: Any, x: jax.Array, cache: dict,
            layer: int, positions: jax.Array, rounding: Rounding | None, kind: str) -> jax.Array:
    """The residual stream after the layer's gated delta net (its pre-norm, the block, the
    residual add); updates `cache` (this layer's conv and recurrent states) in place."""
    h = NORM[s.norm](x, lp["input_layernorm.weight"], d.rms_norm_eps)
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    names = f"layers.{layer}.conv_state", f"layers.{layer}.recurrent_state"
    out, cache[names[0]], cache[names[1]] = block(sub, d, h, cache[names[0]], cache[names[1]],
                                                  rounding, kind)
    return x + out


def param_shapes(s: GatedDeltaNet, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Its upstream parameters under layer prefix `prefix` -> (PyTorch shape, dtype):
    ``conv1d.weight`` is ``[conv_dim, 1, K]`` (depthwise)."""
    H, hv, p, bf16 = d.hidden_size, d.linear_num_value_heads, prefix + s.prefix, "bfloat16"
    value_dim = hv * d.linear_value_head_dim
    return {
        p + "in_proj_qkv.weight": ((d.linear_conv_dim, H), bf16),
        p + "in_proj_z.weight": ((value_dim, H), bf16),
        p + "in_proj_b.weight": ((hv, H), bf16),
        p + "in_proj_a.weight": ((hv, H), bf16),
        p + "conv1d.weight": ((d.linear_conv_dim, 1, d.linear_conv_kernel_dim), bf16),
        p + "dt_bias": ((hv,), bf16),
        p + "A_log": ((hv,), bf16),
        p + "norm.weight": ((d.linear_value_head_dim,), bf16),
        p + "out_proj.weight": ((H, value_dim), bf16),
        prefix + "input_layernorm.weight": ((H,), bf16),
    }


def init_weight(s: GatedDeltaNet, name: str, shape: tuple[int, ...], rng: np.random.Generator,
                residual_scale: float) -> np.ndarray | None:
    """Random values for the tensors a generic draw does not suit (None for the others): the
    gated norm's plain weight near 1; A_log and dt_bias in the Mamba-2 ranges of upstream's
    init (A in [1, 16], dt in [1e-3, 1e-1]) so per-step decays spread over about (0.2, 1);
    conv taps N(0, 1/K); ``in_proj_a`` at half the fan-in scale, keeping ``softplus(a +
    dt_bias)`` near dt rather than saturating."""
    if name.endswith(s.prefix + "norm.weight"):
        return 1.0 + rng.normal(0.0, 0.1, shape)
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(1e-1), shape))
        return np.log(np.expm1(dt))  # inverse softplus, so softplus(dt_bias) == dt
    if name.endswith("conv1d.weight"):
        return rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), shape)
    if name.endswith("in_proj_a.weight"):
        return rng.normal(0.0, 0.5 / math.sqrt(shape[-1]), shape)
    return None


def init_cache(s: GatedDeltaNet, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    """Zeroed states (module docstring); the recurrent state is f32 whatever `dtype` says."""
    return {f"layers.{layer}.conv_state": jnp.zeros(
                (batch, d.linear_conv_dim, d.linear_conv_kernel_dim - 1), jnp.bfloat16),
            f"layers.{layer}.recurrent_state": jnp.zeros(
                (batch, d.linear_num_value_heads, d.linear_key_head_dim, d.linear_value_head_dim),
                jnp.float32)}
