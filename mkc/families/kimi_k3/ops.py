"""Compute bodies for the Kimi K3 family, as functions over in-kernel values.

Generated Kimi kernels call these between the DMAs mkc schedules; nothing here touches a
semaphore or decides when memory moves. Everything computes in f32 on 2-D values ([rows,
lanes]) with only ops Mosaic lowers: no ``lax.top_k``, ``cumsum``, outer-product dots, vector
gathers or lane reshapes that split a 128-lane vreg. The math is that of
``mkc.families.kimi_k3.reference`` (KDA, NoPE gated MLA, latent MoE with sigmoid routing, SiTU, block
attention residuals).

Two weights are streamed in a kernel layout of their own; the numpy packers at the end of
this module build it from checkpoint tensors at load time (the routed experts' formats are the
layer library's, `mkc.layers.expert_formats`):

* MLA runs weight-absorbed. ``q_b_proj`` is split into ``[q_lora, heads * nope]`` and
  ``[q_lora, heads * extra]`` (``split_q_b_proj``) so both query parts come out as flat rows,
  and ``kv_b_proj`` into ``w_uk [heads * nope, R]`` and ``w_uv [R, heads * v]``
  (``split_kv_b_proj``). Each per-head product then becomes one 2-D matmul against a
  block-diagonal operand built with an iota mask, with no in-kernel reshape of head rows.
* KDA's per-head ``A_log`` is repeated over each head's key channels (``expand_a_log``).
"""
from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from mkc.layers.ops import l2_normalize, rms_norm  # noqa: F401  (KimiRMSNorm: a plain weight)
from mkc.runtime import experts

F32 = jnp.float32


# ---------------------------------------------------------------------------------------------
# Norms and activations


def situ(gate: jax.Array, up: jax.Array, beta: float = 4.0, linear_beta: float = 25.0) -> jax.Array:
    """SiTU GLU: beta tanh(g/beta) sigmoid(g) * linear_beta tanh(u/linear_beta); any equal shapes."""
    return (beta * jnp.tanh(gate / beta) * jax.nn.sigmoid(gate)
            * linear_beta * jnp.tanh(up / linear_beta))


def situ_packed(gate_up: jax.Array, width: int, beta: float = 4.0,
                linear_beta: float = 25.0) -> jax.Array:
    """gate_up [B, 2*width] packed as [gate | up] (one fused projection) -> SiTU [B, width]."""
    return situ(gate_up[:, :width], gate_up[:, width:2 * width], beta, linear_beta)


# ---------------------------------------------------------------------------------------------
# KDA (Kimi delta attention), one token


def kda_decay(gate: jax.Array, a_log: jax.Array, dt_bias: jax.Array, lower_bound: float) -> jax.Array:
    """Per-key-channel log decay a = lower_bound * sigmoid(exp(A_log) * (gate + dt_bias)) <= 0.

    gate [B, H*Dk] is the ``f_b_proj`` output; a_log [1, H*Dk] is ``A_log`` repeated over each
    head's channels (``expand_a_log``); dt_bias [1, H*Dk]. Head h owns lanes [h*Dk, (h+1)*Dk).
    """
    return lower_bound * jax.nn.sigmoid(jnp.exp(a_log) * (gate + dt_bias))


def kda_head_step(state: jax.Array, q: jax.Array, k: jax.Array, v: jax.Array,
                  decay: jax.Array, beta: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One token of the KDA delta rule for one head and one batch row -> (o [1, Dv], state).

    state [Dk, Dv] f32 (key axis first, the cache layout); q, k [1, Dk] (l2-normalised, q
    scaled by Dk**-0.5); v [1, Dv]; decay [1, Dk] log-decay; beta [1, 1].
    S = diag(exp(decay)) S; S += k^T (beta (v - k S)); o = q S.
    """
    # Rows of S are key channels, so per-channel factors act as [Dk, 1] columns: a transposed
    # [1, Dk] row lowers, and a rank-1 update is a column times a row (no outer-product dot).
    state = state * jnp.transpose(jnp.exp(decay))
    predicted = jnp.dot(k, state, preferred_element_type=F32)            # [1, Dv]
    delta = (v - predicted) * beta
    state = state + jnp.transpose(k) * delta
    return jnp.dot(q, state, preferred_element_type=F32), state


def kda_gated_output(o: jax.Array, g: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """KDA head output before o_proj: rms(o, o_norm) * sigmoid(g_proj(x)); o, g, w [1, Dv]."""
    return rms_norm(o, w, eps) * jax.nn.sigmoid(g)


# ---------------------------------------------------------------------------------------------
# MLA, weight-absorbed decode over streamed latent tiles (one batch row)


def _head_blocks(num_heads: int, head_dim: int) -> jax.Array:
    """[num_heads, num_heads * head_dim] mask: lane l belongs to head row l // head_dim."""
    shape = (num_heads, num_heads * head_dim)
    # lax.div, not //: jnp's floor division emits lax.sign, whose Mosaic rule needs a live TPU.
    return (lax.div(lax.broadcasted_iota(jnp.int32, shape, 1), jnp.int32(head_dim))
            == lax.broadcasted_iota(jnp.int32, shape, 0))


def mla_absorb_query(q_nope: jax.Array, q_extra: jax.Array, w_uk: jax.Array,
                     num_heads: int) -> tuple[jax.Array, jax.Array]:
    """Absorb the key up-projection into the query -> (q_lat [nh, R], q_extra [nh, extra]).

    q_nope [1, nh*nope] and q_extra [1, nh*extra] are one row's flat query parts (from
    ``split_q_b_proj``); w_uk [nh*nope, R] (``split_kv_b_proj``; bf16 or f32). Head h's absorbed
    query q_nope_h @ W_uk[h] is row h of one matmul: the flat row broadcast to nh rows and masked
    to head h's lanes (block-diagonal), times w_uk: the zero blocks add MXU rows, not weight passes.
    """
    nope = q_nope.shape[1] // num_heads
    extra = q_extra.shape[1] // num_heads
    blocks = jnp.where(_head_blocks(num_heads, nope),
                       jnp.broadcast_to(q_nope, (num_heads, num_heads * nope)), 0.0)
    q_lat = jnp.dot(blocks, w_uk.astype(F32), preferred_element_type=F32)
    # [1, nh*64] -> [nh, 64] is a lane-splitting reshape Mosaic rejects; stacking static lane
    # slices lowers and is exact.
    q_ext = jnp.concatenate([q_extra[:, h * extra:(h + 1) * extra] for h in range(num_heads)], axis=0)
    return q_lat, q_ext


def mla_tile(q_lat: jax.Array, q_extra: jax.Array, latent: jax.Array, extra: jax.Array,
             visible: jax.Array, m: jax.Array, denom: jax.Array, acc: jax.Array, scale: float
             ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Online-softmax update with one tile of T cached latents -> (m, denom, acc).

    q_lat [nh, R], q_extra [nh, extra] from ``mla_absorb_query``; latent [T, R] (the normed
    ``c`` part of the cache rows) and extra [T, extra] (the shared extra key), bf16 or f32;
    visible [1, T] bool; running max m and denominator [nh, 1]; acc [nh, R] accumulates the
    probability-weighted latents (values are up-projected once, in ``mla_value_up``). Start
    from m = -inf, denom = acc = 0; a fully masked tile leaves the state unchanged.
    """
    nt = (((1,), (1,)), ((), ()))
    latent = latent.astype(F32)
    s = (lax.dot_general(q_lat, latent, nt, preferred_element_type=F32)
         + lax.dot_general(q_extra, extra.astype(F32), nt, preferred_element_type=F32)) * scale
    s = jnp.where(visible, s, -jnp.inf)
    m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
    # While nothing is visible yet m_new is -inf; shifting by 0 then keeps exp() NaN-free.
    shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
    alpha = jnp.exp(m - shift)
    p = jnp.exp(s - shift)
    denom_new = alpha * denom + jnp.sum(p, axis=-1, keepdims=True)
    acc_new = alpha * acc + jnp.dot(p, latent, preferred_element_type=F32)
    return m_new, denom_new, acc_new


def mla_value_up(acc: jax.Array, denom: jax.Array, w_uv: jax.Array, num_heads: int) -> jax.Array:
    """Attention output [1, nh*v] (head-major, o_proj's input order) from the final tile state.

    acc [nh, R], denom [nh, 1]; w_uv [R, nh*v] (``split_kv_b_proj``). Row h of the full product
    holds every head's up-projection of head h's latent average; the block diagonal is the
    answer, kept by a mask and summed down the rows (adding zeros, so exact).
    """
    full = jnp.dot(acc / denom, w_uv.astype(F32), preferred_element_type=F32)   # [nh, nh*v]
    v_dim = w_uv.shape[1] // num_heads
    return jnp.sum(jnp.where(_head_blocks(num_heads, v_dim), full, 0.0), axis=0, keepdims=True)


# ---------------------------------------------------------------------------------------------
# MoE routing


def route(logits: jax.Array, bias: jax.Array, top_k: int,
          scaling: float = 1.0) -> tuple[jax.Array, jax.Array]:
    """Sigmoid top-k routing per row -> (weights [B, E], ids [B, top_k] int32).

    logits [B, E] f32, bias [1, E] (``e_score_correction_bias``, used only to pick). weights is
    zero except at the chosen experts, where it holds the sigmoid scores renormalised over the
    chosen and times ``scaling`` (``routed_scaling_factor``). ids lists the picks best first,
    ties to the lowest index (``mkc.runtime.experts.top_k``). DMAs need scalar ids in SMEM: store
    ``mkc.runtime.experts.expert_id(ids, b, j)`` into an SMEM ref; ``expert_weight`` there
    reads a dynamic expert's column.
    """
    scores = jax.nn.sigmoid(logits)
    kept, ids = experts.top_k(scores + bias, scores, top_k)
    return kept / jnp.sum(kept, axis=-1, keepdims=True) * scaling, ids


# ---------------------------------------------------------------------------------------------
# Block attention residuals


def residual_mix(sources: Sequence[jax.Array], count: jax.Array | int, norm_w: jax.Array,
                 proj_w: jax.Array, eps: float) -> jax.Array:
    """Softmax mixture of the first ``count`` (a traced scalar) of the residual ``sources``
    ([B, H] f32 blocks: completed block sums, then the partial sum) -> [B, H], with score_i =
    proj . rms(v_i, norm); norm_w, proj_w [1, H]. The other sources are masked out before they
    can touch the result (they may hold stale memory)."""
    scores = [jnp.where(i < count, jnp.sum(rms_norm(v, norm_w, eps) * proj_w, axis=-1, keepdims=True),
                        -jnp.inf) for i, v in enumerate(sources)]
    top = scores[0]
    for sc in scores[1:]:
        top = jnp.maximum(top, sc)
    exps = [jnp.exp(sc - top) for sc in scores]
    total = sum(exps[1:], exps[0])
    mixed = jnp.zeros_like(sources[0])
    for i, (e, v) in enumerate(zip(exps, sources)):
        mixed = mixed + jnp.where(i < count, (e / total) * v, 0.0)
    return mixed


# ---------------------------------------------------------------------------------------------
# Host-side packing (numpy, at weight-load time)


def expand_a_log(a_log: np.ndarray, head_dim: int) -> np.ndarray:
    """KDA ``A_log`` [H] -> [1, H*head_dim] f32, each head's value over its key channels."""
    return np.repeat(np.asarray(a_log, np.float32), head_dim)[None, :]


def _heads(w: np.ndarray, num_heads: int, heads: Sequence[int] | None) -> np.ndarray:
    """PyTorch [num_heads * per_head, in] -> [len(heads), per_head, in]."""
    w = np.asarray(w).reshape(num_heads, -1, np.asarray(w).shape[-1])
    return w if heads is None else w[list(heads)]


def split_q_b_proj(w: np.ndarray, num_heads: int, nope_dim: int,
                   heads: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``q_b_proj.weight`` [num_heads*(nope+extra), q_lora] -> K-major (w_q_nope
    [q_lora, nh*nope], w_q_extra [q_lora, nh*extra]) for the selected heads (a rank's share)."""
    w = _heads(w, num_heads, heads)
    nh = w.shape[0]
    return (w[:, :nope_dim].reshape(nh * nope_dim, -1).T.copy(),
            w[:, nope_dim:].reshape(nh * (w.shape[1] - nope_dim), -1).T.copy())


def split_kv_b_proj(w: np.ndarray, num_heads: int, nope_dim: int,
                    heads: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``kv_b_proj.weight`` [num_heads*(nope+v), R] -> (w_uk [nh*nope, R], w_uv [R, nh*v]):
    the layouts ``mla_absorb_query`` and ``mla_value_up`` multiply by, for the selected heads."""
    w = _heads(w, num_heads, heads)
    nh, v_dim = w.shape[0], w.shape[1] - nope_dim
    return (w[:, :nope_dim].reshape(nh * nope_dim, -1).copy(),
            w[:, nope_dim:].reshape(nh * v_dim, -1).T.copy())
