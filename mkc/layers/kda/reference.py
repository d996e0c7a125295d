"""The reference of `KDA` (upstream Kimi Linear's `KimiDeltaAttention`) for one token per row,
all f32 with ``Precision.HIGHEST`` dots:

* ``q|k|v = {q,k,v}_proj(x)``; a causal depthwise conv (K taps, ``{q,k,v}_conv1d``, no bias)
  then SiLU; ``q = l2(q) * D**-0.5, k = l2(k)`` (``l2(x) = x * rsqrt(sum x^2 + 1e-6)``);
* the decay per key channel ``a = gate_lower_bound * sigmoid(exp(A_log[h]) *
  (f_b_proj(f_a_proj(x)) + dt_bias))`` (<= 0, the bounded form of the KDA gate); ``beta =
  sigmoid(b_proj(x))``;
* per head ``S = diag(exp(a)) S; S += k (x) beta * (v - S^T k); o = S^T q``; then
  ``rms(o, o_norm) * sigmoid(g_proj(x))`` (the full-rank output gate, a plain RMS weight) and
  ``o_proj``.

Parameters are named under the layer's `s.prefix` (``self_attn.``); with `residual` the
pre-norm weight is the layer's ``input_layernorm.weight``. ``A_log``, ``dt_bias`` (per
channel), the conv filters and ``o_norm`` are f32 in the checkpoint.

States (``init_cache``; B = batch, P = heads * head_dim):

* ``layers.{i}.conv_state``      bf16 ``[B, 3P, K-1]``: channels ``[q | k | v]`` in projection
  order, time oldest first: ``[..., K-2]`` is the previous token's projection. The new token's
  window is ``concat(conv_state, x_t)`` and tap j multiplies slot j (tap K-1 = current); the
  conv inputs are stored as bf16 before the conv reads them.
* ``layers.{i}.recurrent_state`` f32  ``[B, heads, D, D]``: per head S with ``o = S^T q`` (key
  axis first).

The states advance by one token on every call, whatever the position: feed each row its tokens
in order.

With a `Rounding` it rounds where the generated kernel does and sums in the kernel's f32 order
(`mkc.numerics`): every matmul's input to bf16 (so ``f_b_proj`` sees a bf16 ``f_a_proj``
output), ring tile by ring tile where its matrix streams; the conv tap by tap and the delta
rule unfused, row by row and head by head with the l2 norms of each head, the gated norm head by
head, each jitted in the kernel's formulation and shapes; ``o_proj`` as per-rank partial sums
over the heads' ranks all-reduced as the schedule says; the states in their storage dtypes.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers.kda import KDA
from mkc.layers.reference import (delta_rule_update, kernel_conv_silu, kernel_delta_update, l2_normalize,
                                  matmul, mm_input, out_projection, own_norm, rms_norm)
from mkc.reference.rounding import Rounding, round_to


def delta_rule_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                    decay: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the KDA delta rule for any leading axes.

    state ``[..., Dk, Dv]``, q/k ``[..., Dk]`` (normalised), v ``[..., Dv]``, decay ``[..., Dk]``
    (log-space, per key channel), beta ``[...]``. Returns (o ``[..., Dv]``, new state):
    ``S = diag(exp(decay)) S; S += k (x) beta (v - S^T k); o = S^T q``.
    """
    return delta_rule_update(state * jnp.exp(decay)[..., :, None], q, k, v, beta)


@functools.partial(jax.jit, static_argnames=("scale",))
def _kernel_delta_rule(state: jax.Array, q: jax.Array, k: jax.Array, v_pre: jax.Array,
                       v_gate: jax.Array, decay: jax.Array, beta: jax.Array, *, scale: float
                       ) -> tuple[jax.Array, jax.Array]:
    """`delta_rule_step` with the l2 norms (q scaled by ``scale``) as the kernel runs it: row by
    row and head by head, on ``[1, D]`` rows and the ``[D, D]`` state (key axis first), the
    values as their SiLU factors and the decayed state fused into the update
    (`kernel_delta_update`). state ``[B, nh, D, D]``; q, k, v_pre, v_gate, decay ``[B, nh,
    D]`` (q, k not yet normalised); beta ``[B, nh]`` -> (o ``[B, nh, D]``, new state)."""
    b, n, d = q.shape

    def head(carry, xs):
        s, qh, kh, vp, vg, dh, bh = xs
        qh = l2_normalize(qh) * scale
        kh = l2_normalize(kh)
        return carry, kernel_delta_update(s * jnp.transpose(jnp.exp(dh)), qh, kh, vp, vg, bh)

    def rows(a: jax.Array) -> jax.Array:
        return a.reshape(b * n, 1, a.shape[-1])

    _, (o, state) = jax.lax.scan(head, 0, (state.reshape(b * n, d, d), rows(q), rows(k),
                                           rows(v_pre), rows(v_gate), rows(decay),
                                           beta.reshape(b * n, 1, 1)))
    return o.reshape(b, n, d), state.reshape(b, n, d, d)


@functools.partial(jax.jit, static_argnames=("eps",))
def _kernel_gated_norm(o: jax.Array, g: jax.Array, w: jax.Array, *, eps: float) -> jax.Array:
    """``rms(o, o_norm) * sigmoid(g)`` head by head on ``[B, D]`` (o, g ``[B, nh, D]``)."""
    return jnp.stack([rms_norm(o[:, h], w, eps) * jax.nn.sigmoid(g[:, h]) for h in range(o.shape[1])],
                     axis=1)


def block(s: KDA, p: Mapping[str, jax.Array], d: Any, x: jax.Array, conv_state: jax.Array,
          recurrent_state: jax.Array, rounding: Rounding | None = None, kind: str = "kda"
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """KDA for one token per row.

    ``p`` maps names relative to ``s.prefix`` to f32 arrays; x is the normed input ``[B, H]``;
    with ``rounding``, ``kind`` names the layer kind whose matrices, storage dtypes and
    ``o_proj`` all-reduce apply. Returns (output ``[B, H]``, new conv_state, new
    recurrent_state).
    """
    b, nh, hd = x.shape[0], d.kda_num_heads, d.kda_head_dim
    x = mm_input(x, rounding)

    def projected(name: str, y: jax.Array = x, family: str = "projection") -> jax.Array:
        return matmul(y, p[f"{name}.weight"], rounding, kind, family, by_tiles=True)

    mixed = jnp.concatenate([projected(f"{n}_proj") for n in "qkv"], axis=-1)
    if rounding is not None:   # q|k|v enter the conv state as bf16, then its storage dtype
        mixed = round_to(round_to(mixed, "bf16"), rounding.stored(kind, "conv"))
    mixed = mixed.astype(conv_state.dtype)
    window = jnp.concatenate([conv_state, mixed[:, :, None]], axis=-1)  # [B, 3P, K], oldest first
    taps = jnp.concatenate([p[f"{n}_conv1d.weight"] for n in "qkv"], axis=0)   # [3P, 1, K]
    if rounding is None:
        conv = jax.nn.silu(jnp.sum(window.astype(jnp.float32) * taps[:, 0, :], axis=-1))
    else:   # SiLU as x * sigmoid(x), both factors kept for the values (_kernel_delta_rule)
        conv, pre, gates = kernel_conv_silu(window.astype(jnp.float32), taps)
        v_pre, v_gate = (t.reshape(b, nh, hd) for t in (pre[:, 2 * nh * hd:], gates[:, 2 * nh * hd:]))
    q, k, v = (t.reshape(b, nh, hd) for t in jnp.split(conv, 3, axis=-1))

    gate = projected("f_b_proj", projected("f_a_proj", family="gate_down"), "gate_up")
    gate = gate + p["dt_bias"]
    rate = jnp.exp(p["A_log"])[None, :, None]
    decay = d.gate_lower_bound * jax.nn.sigmoid(rate * gate.reshape(b, nh, hd))
    beta = jax.nn.sigmoid(projected("b_proj"))
    g = projected("g_proj").reshape(b, nh, hd)
    if rounding is None:
        q = l2_normalize(q) * hd ** -0.5
        k = l2_normalize(k)
        o, recurrent_state = delta_rule_step(recurrent_state, q, k, v, decay, beta)
        o = rms_norm(o, p["o_norm.weight"], d.rms_norm_eps) * jax.nn.sigmoid(g)
    else:
        o, recurrent_state = _kernel_delta_rule(recurrent_state, q, k, v_pre, v_gate, decay, beta,
                                                scale=hd ** -0.5)
        o = _kernel_gated_norm(o, g, p["o_norm.weight"], eps=d.rms_norm_eps)
        recurrent_state = round_to(recurrent_state, rounding.stored(kind, "recurrent"))
    per_rank = None if rounding is None else rounding.size("heads") * hd
    out = out_projection(o.reshape(b, nh * hd), p["o_proj.weight"], rounding, kind, "o_proj",
                         per_rank, "heads", by_tiles=True)
    return out, window[:, :, 1:], recurrent_state


def forward(s: KDA, lp: Mapping[str, jax.Array], d: Any, x: jax.Array, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> jax.Array:
    """The residual stream after the layer's KDA (its pre-norm, the block, the residual add);
    updates `cache` (this layer's conv and recurrent states) in place."""
    h = rms_norm(x, lp["input_layernorm.weight"], d.rms_norm_eps) if s.residual else x.h
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    names = f"layers.{layer}.conv_state", f"layers.{layer}.recurrent_state"
    out, cache[names[0]], cache[names[1]] = block(s, sub, d, h, cache[names[0]], cache[names[1]],
                                                  rounding, kind)
    return x + out if s.residual else x.leave(out)


def block_shapes(s: KDA, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Its upstream parameters under layer prefix `prefix` (`model.layers.{i}.`) -> (PyTorch
    shape, dtype); ``{q,k,v}_conv1d.weight`` are ``[P, 1, K]`` (depthwise)."""
    H, nh, hd, a = d.hidden_size, d.kda_num_heads, d.kda_head_dim, prefix + s.prefix
    width, bf16, f32 = nh * hd, "bfloat16", "float32"
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for x in "qkv":
        shapes[a + f"{x}_proj.weight"] = ((width, H), bf16)
        shapes[a + f"{x}_conv1d.weight"] = ((width, 1, d.conv_kernel_size), f32)
    return shapes | {
        a + "f_a_proj.weight": ((hd, H), bf16),
        a + "f_b_proj.weight": ((width, hd), bf16),
        a + "b_proj.weight": ((nh, H), bf16),
        a + "g_proj.weight": ((width, H), bf16),
        a + "A_log": ((nh,), f32),
        a + "dt_bias": ((width,), f32),
        a + "o_norm.weight": ((hd,), f32),
        a + "o_proj.weight": ((H, width), bf16),
    }


def param_shapes(s: KDA, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return block_shapes(s, d, prefix) | own_norm(s, d, prefix + "input_layernorm.weight")


def init_weight(s: KDA, name: str, shape: tuple[int, ...], rng: np.random.Generator,
                residual_scale: float = 1.0) -> np.ndarray | None:
    """Random values for the tensors a generic draw does not suit (None for the others): A =
    exp(A_log) in [1, 16] as upstream's init, dt_bias in [-1, 0] and the decay gate's up
    projection at a fifth of the fan-in scale, so ``A * (gate + dt_bias)`` does not saturate and
    per-step decays spread over about (0.08, 1); conv taps N(0, 1/K)."""
    if name.endswith("A_log"):
        return np.log(rng.uniform(1.0, 16.0, shape))
    if name.endswith("dt_bias"):
        return rng.uniform(-1.0, 0.0, shape)
    if name.endswith("conv1d.weight"):
        return rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), shape)
    if name.endswith("f_b_proj.weight"):
        return rng.normal(0.0, 1.0 / math.sqrt(shape[-1]) * 0.2, shape)
    return None


def init_cache(s: KDA, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    """Zeroed states (module docstring); the conv state is bf16 and the recurrent state f32
    whatever `dtype` says."""
    width = d.kda_num_heads * d.kda_head_dim
    return {f"layers.{layer}.conv_state": jnp.zeros((batch, 3 * width, d.conv_kernel_size - 1), jnp.bfloat16),
            f"layers.{layer}.recurrent_state": jnp.zeros(
                (batch, d.kda_num_heads, d.kda_head_dim, d.kda_head_dim), jnp.float32)}
