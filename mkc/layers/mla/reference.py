"""The reference of `MLA`, as transformers' `DeepseekV3Attention` computes it for one decode
token per row (and Kimi K3's gated NoPE variant), all f32 with ``Precision.HIGHEST`` dots:

* ``q = q_b_proj(rms(q_a_proj(x), q_a_layernorm))`` per head ``[nope | rope]``;
  ``[c | k_rope] = kv_a_proj_with_mqa(x)``, ``c = rms(c, kv_a_layernorm)``; with `rope`, q's
  rope part and ``k_rope`` rotated at the row's position (rotate-half; with `rope_interleave`
  upstream's `apply_rotary_pos_emb_interleave`: pairs ``(2i, 2i + 1)`` rotated, the output
  evens first, then odds); the cache row ``[c | k_rope]`` written at the position and read
  back (bf16 as stored);
* ``kv_b_proj(c)`` per head ``[k_nope | v]``; key ``[k_nope | k_rope]`` (k_rope shared by all
  heads); softmax over slots ``0..position`` of the scores times `softmax_scale`; output
  ``* sigmoid(g_proj(x))`` with the output gate; o_proj.

Parameters are named under the layer's `s.prefix` (`self_attn.`); the pre-norm weight is the
layer's `input_layernorm.weight`. Cache: ``layers.{i}.latent_cache`` ``[B, T, kv_lora_rank +
qk_rope_head_dim]``, slot t holding position t as ``[rms(c) | k_rope]`` (rotated).

With a `Rounding` it rounds and sums as the kernel: weight-absorbed, rank by rank (each rank's
heads), an online softmax over the schedule's KV tiles (`_kernel_mla_rank`), every matmul tile
by tile where its matrix streams, RoPE from the host's f32 table on the rope dims as packing
permutes them, o_proj as per-rank partial sums all-reduced.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers import rope as rope_lib
from mkc.layers.mla import MLA, interleaved, softmax_scale
from mkc.layers.mla.weights import rope_permutation
from mkc.layers.reference import HIGHEST, linear, matmul, mm_input, out_projection, own_norm, rms_norm
from mkc.reference.rounding import Rounding, round_to

_rope_table = jax.jit(rope_lib.rope_table, static_argnums=0)


def inv_freq(d: Any) -> np.ndarray:
    """The rope part's frequencies [qk_rope_head_dim / 2] (f64, rounded once): upstream's
    default `theta^(-2i/R)` or its YaRN blend (`mkc.layers.rope.frequencies`)."""
    return rope_lib.frequencies(d).astype(np.float32)


def rotate(x: jax.Array, cos: jax.Array, sin: jax.Array, interleave: bool) -> jax.Array:
    """Upstream's rotation of x [..., R] at cos, sin [..., R / 2] (the pair angles):
    `apply_rotary_pos_emb_interleave` (pairs (2i, 2i + 1), output evens first) or
    `apply_rotary_pos_emb` (rotate-half pairs (i, i + R/2))."""
    half = x.shape[-1] // 2
    x1, x2 = (x[..., 0::2], x[..., 1::2]) if interleave else (x[..., :half], x[..., half:])
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def _rotation(r: int) -> np.ndarray:
    """R with y @ R == rotate_half(y) ([-y2, y1]), as the kernel builds it."""
    half = r // 2
    i, j = np.arange(r)[:, None], np.arange(r)[None, :]
    return np.where((j >= half) & (i == j - half), 1.0, np.where((j < half) & (i == j + half), -1.0, 0.0)
                    ).astype(np.float32)


@jax.jit
def _kernel_rotate(y: jax.Array, cos: jax.Array, sin: jax.Array, rotation: jax.Array) -> jax.Array:
    """The kernel's rotation of y [B, R] at its rows' cos, sin [B, R]: ``y * cos + (y @ R) *
    sin``, jitted as the kernel's body is compiled."""
    return y * cos + jnp.dot(y, rotation, preferred_element_type=jnp.float32) * sin


def _head_mask(heads: int, width: int) -> jax.Array:
    """``[heads, heads * width]``: lane l belongs to row l // width (a block diagonal)."""
    lane = jax.lax.broadcasted_iota(jnp.int32, (heads, heads * width), 1)
    return lane // width == jax.lax.broadcasted_iota(jnp.int32, (heads, heads * width), 0)


@functools.partial(jax.jit, static_argnames=("heads", "tile", "kv_lora", "scale"))
def _kernel_mla_rank(q_nope: jax.Array, q_extra: jax.Array, w_uk: jax.Array, w_uv: jax.Array,
                     cache: jax.Array, positions: jax.Array, n_tiles: jax.Array, rope: jax.Array | None,
                     *, heads: int, tile: int, kv_lora: int, scale: float) -> jax.Array:
    """MLA attention of one rank's ``heads`` heads for every row, as the kernel runs it: weight
    absorbed (the key up-projection applied to the query through a block-diagonal operand, the
    value up-projection to the probability-weighted latent average), the query's rope part
    rotated by ``rope`` (cos, sin ``[B, R]`` and the rotation matrix; None: NoPE), with an
    online softmax over ``n_tiles`` cache tiles of ``tile`` tokens.

    q_nope ``[B, heads * nope]``, q_extra ``[B, heads * extra]`` (head-major), w_uk
    ``[heads * nope, kv_lora]``, w_uv ``[kv_lora, heads * v]``, cache ``[B, T, kv_lora + extra]``
    (stored values, f32), positions ``[B]`` -> ``[B, heads * v]``."""
    nope, extra = q_nope.shape[-1] // heads, q_extra.shape[-1] // heads
    vd = w_uv.shape[-1] // heads
    f32 = jnp.float32
    contract = (((1,), (1,)), ((), ()))
    def row(carry, xs):
        qn, qe, rows, pos = xs[:4]
        blocks = jnp.where(_head_mask(heads, nope), jnp.broadcast_to(qn[None], (heads, heads * nope)), 0.0)
        q_lat = jnp.dot(blocks, w_uk, preferred_element_type=f32)
        q_ext = jnp.stack([qe[h * extra:(h + 1) * extra] for h in range(heads)])
        if rope is not None:
            cos, sin = xs[4:]
            q_ext = q_ext * cos[None] + jnp.dot(q_ext, rope[2], preferred_element_type=f32) * sin[None]

        def step(t, state):
            m, denom, acc = state
            part = jax.lax.dynamic_slice_in_dim(rows, t * tile, tile, 0)
            latent, ext = part[:, :kv_lora], part[:, kv_lora:kv_lora + extra]
            tok = t * tile + jax.lax.broadcasted_iota(jnp.int32, (1, tile), 1)
            s = (jax.lax.dot_general(q_lat, latent, contract, preferred_element_type=f32)
                 + jax.lax.dot_general(q_ext, ext, contract, preferred_element_type=f32)) * scale
            s = jnp.where(tok <= pos, s, -jnp.inf)
            m_new = jnp.maximum(m, jnp.max(s, axis=-1, keepdims=True))
            shift = jnp.where(m_new == -jnp.inf, 0.0, m_new)
            alpha = jnp.exp(m - shift)
            p = jnp.exp(s - shift)
            return (m_new, alpha * denom + jnp.sum(p, axis=-1, keepdims=True),
                    alpha * acc + jnp.dot(p, latent, preferred_element_type=f32))

        init = (jnp.full((heads, 1), -jnp.inf, f32), jnp.zeros((heads, 1), f32),
                jnp.zeros((heads, kv_lora), f32))
        _, denom, acc = jax.lax.fori_loop(0, n_tiles, step, init)
        full = jnp.dot(acc / denom, w_uv, preferred_element_type=f32)
        return carry, jnp.sum(jnp.where(_head_mask(heads, vd), full, 0.0), axis=0)

    xs = (q_nope, q_extra, cache, positions) + (() if rope is None else tuple(rope[:2]))
    _, out = jax.lax.scan(row, 0, xs)
    return out


def block(s: MLA, p: Mapping[str, jax.Array], d: Any, x: jax.Array, latent_cache: jax.Array,
          positions: jax.Array, rounding: Rounding | None = None, kind: str = "mla"
          ) -> tuple[jax.Array, jax.Array]:
    """The attention of one token per row at its own position, from its normed input x.

    ``p`` maps names relative to ``s.prefix`` to f32 arrays. Writes the latent row at
    ``positions[b]``, then attends over slots ``0..positions[b]``; plainly by expanding every
    cached latent through ``kv_b_proj`` (not weight-absorbed, for readability). Returns
    (output ``[B, H]``, new latent_cache); ``kind`` names the layer kind whose KV tiles and
    all-reduces apply."""
    b, nh = x.shape[0], d.num_attention_heads
    nope, rd, vd, kvl = d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim, d.kv_lora_rank
    eps, scale = d.rms_norm_eps, softmax_scale(d)
    x = mm_input(x, rounding)
    q_latent = rms_norm(matmul(x, p["q_a_proj.weight"], rounding, kind, "q_down", by_tiles=True),
                        p["q_a_layernorm.weight"], eps)
    q = matmul(mm_input(q_latent, rounding), p["q_b_proj.weight"], rounding, kind, "q_up", by_tiles=True)
    q = q.reshape(b, nh, nope + rd)
    q_nope, q_extra = q[..., :nope], q[..., nope:]

    compressed = matmul(x, p["kv_a_proj_with_mqa.weight"], rounding, kind, "kv_down", by_tiles=True)
    k_rope = compressed[:, kvl:]
    table = None
    if s.rope and rounding is None:
        angles = positions.astype(jnp.float32)[:, None] * jnp.asarray(inv_freq(d))[None, :]
        cos, sin = (f(angles) * getattr(d, "yarn_attention_factor", 1.0) for f in (jnp.cos, jnp.sin))
        q_extra = rotate(q_extra, cos[:, None, :], sin[:, None, :], interleaved(d))
        k_rope = rotate(k_rope, cos, sin, interleaved(d))
    elif s.rope:    # the kernel's: the rope dims as packing permutes them, the host's table
        perm = rope_permutation(rd) if interleaved(d) else np.arange(rd)
        cos, sin = _rope_table(d, positions)
        table = (cos, sin, jnp.asarray(_rotation(rd)))
        q_extra = q_extra[..., perm]
        k_rope = _kernel_rotate(k_rope[:, perm], *table)
    row = jnp.concatenate([rms_norm(compressed[:, :kvl], p["kv_a_layernorm.weight"], eps), k_rope], axis=-1)
    if rounding is not None:
        row = round_to(row, rounding.stored(kind, "kv"))
    latent_cache = latent_cache.at[jnp.arange(b), positions].set(row.astype(latent_cache.dtype))

    cached = latent_cache.astype(jnp.float32)  # [B, T, kvl + rope]
    if rounding is None:
        kv = linear(cached[..., :kvl], p["kv_b_proj.weight"]).reshape(b, -1, nh, nope + vd)
        k_nope, values = kv[..., :nope], kv[..., nope:]
        scores = (jnp.einsum("bhd,bthd->bht", q_nope, k_nope, precision=HIGHEST)
                  + jnp.einsum("bhd,btd->bht", q_extra, cached[..., kvl:], precision=HIGHEST))
        visible = jnp.arange(latent_cache.shape[1])[None, :] <= positions[:, None]  # [B, T]
        probs = jax.nn.softmax(jnp.where(visible[:, None, :], scores * scale, -jnp.inf), axis=-1)
        attn = jnp.einsum("bht,bthd->bhd", probs, values, precision=HIGHEST).reshape(b, nh * vd)
    else:   # the kernel's weight-absorbed form, rank by rank, tile by tile
        heads, tile = rounding.size("heads"), rounding.kv_tile(kind)
        kv_b = p["kv_b_proj.weight"].reshape(nh, nope + vd, kvl)
        n_tiles = jnp.max(positions) // tile + 1
        parts = []
        for first in range(0, nh, heads):
            hs = slice(first, first + heads)
            parts.append(_kernel_mla_rank(
                q_nope[:, hs].reshape(b, heads * nope), q_extra[:, hs].reshape(b, heads * rd),
                kv_b[hs, :nope].reshape(heads * nope, kvl), kv_b[hs, nope:].reshape(heads * vd, kvl).T,
                cached, positions, n_tiles, table, heads=heads, tile=tile, kv_lora=kvl, scale=scale))
        attn = jnp.concatenate(parts, axis=-1)
    if s.output_gate:
        attn = attn * jax.nn.sigmoid(matmul(x, p["g_proj.weight"], rounding, kind, "gate", by_tiles=True))
    per_rank = None if rounding is None else rounding.size("heads") * vd
    return out_projection(attn, p["o_proj.weight"], rounding, kind, "o_proj", per_rank, "heads",
                          by_tiles=True), latent_cache


def forward(s: MLA, lp: Mapping[str, jax.Array], d: Any, x: jax.Array, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> jax.Array:
    """The residual stream after the layer's attention (its pre-norm, the block, the residual
    add); updates `cache` (this layer's latent cache) in place."""
    h = rms_norm(x, lp["input_layernorm.weight"], d.rms_norm_eps) if s.residual else x.h
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    name = f"layers.{layer}.latent_cache"
    out, cache[name] = block(s, sub, d, h, cache[name], positions, rounding, kind)
    return x + out if s.residual else x.leave(out)


def block_shapes(s: MLA, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Its attention's upstream parameters, in upstream module order, under layer prefix
    `prefix` (`model.layers.{i}.`)."""
    H, nh, a, bf16 = d.hidden_size, d.num_attention_heads, prefix + s.prefix, "bfloat16"
    qk = d.qk_nope_head_dim + d.qk_rope_head_dim
    return {
        a + "q_a_proj.weight": ((d.q_lora_rank, H), bf16),
        a + "q_a_layernorm.weight": ((d.q_lora_rank,), bf16),
        a + "q_b_proj.weight": ((nh * qk, d.q_lora_rank), bf16),
        a + "kv_a_proj_with_mqa.weight": ((d.kv_lora_rank + d.qk_rope_head_dim, H), bf16),
        a + "kv_a_layernorm.weight": ((d.kv_lora_rank,), bf16),
        a + "kv_b_proj.weight": ((nh * (d.qk_nope_head_dim + d.v_head_dim), d.kv_lora_rank), bf16),
        **({a + "g_proj.weight": ((nh * d.v_head_dim, H), bf16)} if s.output_gate else {}),
        a + "o_proj.weight": ((H, nh * d.v_head_dim), bf16),
    }


def param_shapes(s: MLA, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    return block_shapes(s, d, prefix) | own_norm(s, d, prefix + "input_layernorm.weight")


def init_cache(s: MLA, d: Any, layer: int, batch: int, context: int, dtype: Any = jnp.bfloat16
               ) -> dict[str, jax.Array]:
    return {f"layers.{layer}.latent_cache": jnp.zeros(
        (batch, context, d.kv_lora_rank + d.qk_rope_head_dim), dtype)}
