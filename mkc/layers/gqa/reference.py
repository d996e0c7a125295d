"""The reference of `GQA`, as transformers computes grouped-query attention for one decode
token per row (`modeling_llama.py`'s `LlamaAttention`, `eager_attention_forward`, `repeat_kv`;
Qwen3.5's `Qwen3_5Attention` with its output gate; Qwen3-MoE's q/k norms; GPT-OSS's
`GptOssAttention` with biases, sinks and a sliding window; transformers 5.25's
`MuseSparkTextAttention` with weightless q/k norms, `qk_scale_factor`, NoPE layers and its
normed output gate):

* q, k, v = x W^T (+ their biases; q_proj rows per head `[query | gate]` with Qwen3.5's output
  gate, Muse Spark's gate `gate_proj(x)`); with a q/k norm, an RMS norm over each head's dims
  (weighted, or not); q times the dims' `qk_scale_factor` where they have one; rotate-half
  RoPE on each head's first `rotary_dim` dims (YaRN's cos and sin times its attention factor),
  none on a NoPE kind; k and v written to the cache at the row's slot (bf16, as stored) and
  read back;
* query head h reads KV head `h // (Hq // Hkv)`; softmax(q k^T / sqrt(D)) over the visible
  slots (`cache_slots`), a head's sink logit joining its denominator only; output
  `* sigmoid(gate)` with Qwen3.5's gate, `rms(output) * sigmoid(gate)` per head with Muse
  Spark's; o_proj, its bias added to the reduced product.

Parameters are named under the layer's `s.prefix` (`self_attn.`); the pre-norm weight is the
layer's `input_layernorm.weight`. Caches: `layers.{i}.key_cache` / `value_cache` bf16
`[B, Hkv, T, D]`, slot t holding position t, keys after norm and RoPE; a sliding kind's a
ring of `sliding_window` slots (slot `p % W` holds position p; a kernel's KV ring of N > W
slots, gathered by `weights.reference_states`, is read the same way with slot `p % N`).

With a `Rounding` it rounds and sums as the kernel (`mkc.layers.reference`): RoPE from the
host's f32 table (`mkc.layers.rope.rope_table`, jitted as the host runs it), norm and rotation
head by head, the attention an online softmax over the schedule's KV tiles by group of a
rank's query heads (`tiled_attention`) with the scores scaled by `softmax_scale`, Muse Spark's
output norm and gate head by head (`_rms_gate`), o_proj as per-rank partial sums all-reduced.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers import rope
from mkc.layers.gqa import GQA, softmax_scale
from mkc.layers.reference import (HIGHEST, NORM, attention_tile_bf16x3, matmul, mm_input,
                                  out_projection, own_norm, rms_norm_weightless)
from mkc.reference.rounding import Rounding, round_to


def rope_cos_sin(d: Any, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """cos/sin ``[..., rotary_dim]`` for integer positions, halves duplicated (rotate-half form).

    Frequencies are computed in f64 and rounded once (the emulation uses the kernels' f32
    table instead, ``_rope_table``)."""
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(rope.frequencies(d), jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    if getattr(d, "rope_type", "default") == "yarn":     # YaRN scales cos and sin
        return jnp.cos(emb) * d.yarn_attention_factor, jnp.sin(emb) * d.yarn_attention_factor
    return jnp.cos(emb), jnp.sin(emb)


def apply_partial_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first ``cos.shape[-1]`` dims of x (rotate-half convention); pass the rest."""
    rot = cos.shape[-1]
    x_rot, x_pass = x[..., :rot], x[..., rot:]
    x1, x2 = x_rot[..., : rot // 2], x_rot[..., rot // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)


@functools.partial(jax.jit, static_argnames=("norm", "rotate"))
def _norm_rope(x, w, cos, sin, rotation, eps, norm: str = "", rotate: bool = True):
    """One head's RMS norm (`norm`'s weight, or "weightless"; none for "") and rotary embedding
    (none unless `rotate`) in the kernel's formulation and shapes: x [B, D]; cos, sin [B, D] (1
    and 0 past the rotary dims); the rotation as a product with the rotate-half matrix,
    ``y * cos + (y @ R) * sin``, which XLA fuses into FMAs."""
    if norm == "weightless":
        y = rms_norm_weightless(x, eps)
    else:
        y = NORM[norm](x, w, eps) if norm else x
    if not rotate:
        return y
    return y * cos + jnp.dot(y, rotation, preferred_element_type=jnp.float32) * sin


_rope_table = jax.jit(rope.rope_table, static_argnums=0)


def _head_norm_rope(t: jax.Array, w: jax.Array | None, cos: jax.Array | None, sin: jax.Array | None,
                    rot: int, eps: float, norm: str) -> jax.Array:
    """``_norm_rope`` head by head, as the kernel applies it (a norm over one head's [B, D]
    reduces in another f32 order than over [B, heads, D]). t [B, heads, D]; cos, sin [B, D]
    from ``_rope_table``, None for a NoPE kind (no rotation)."""
    d, half = t.shape[-1], rot // 2
    i, j = np.arange(d)[:, None], np.arange(d)[None, :]   # y @ R == rotate_half(y[:rot]), 0...
    rotation = np.where((j >= half) & (j < rot) & (i == j - half), 1.0,
                        np.where((j < half) & (i == j + half), -1.0, 0.0)).astype(np.float32)
    w = jnp.zeros((1, d), jnp.float32) if w is None else jnp.asarray(w, jnp.float32)[None, :]
    return jnp.stack([_norm_rope(t[:, h], w, cos, sin, rotation, eps, norm=norm, rotate=cos is not None)
                      for h in range(t.shape[1])], axis=1)


@jax.jit
def _rms_gate(o: jax.Array, gate: jax.Array, eps: float) -> jax.Array:
    """Muse Spark's output gate as the kernel computes it: each head's weightless RMS norm over
    its [B, D] (`_head_norm_rope`'s reason) times the sigmoid of its gate; o, gate [B, heads, D]."""
    normed = jnp.stack([rms_norm_weightless(o[:, h], eps) for h in range(o.shape[1])], axis=1)
    return normed * jax.nn.sigmoid(gate)


def _tile(a: jax.Array, t: int | jax.Array, tile: int) -> jax.Array:
    """Tile t (of `tile` tokens) of a [T, D] cache: a slice, or under `jit` a dynamic one."""
    if isinstance(t, int):
        return a[t * tile:(t + 1) * tile]
    return jax.lax.dynamic_slice_in_dim(a, t * tile, tile, 0)


def tiled_attention(q: jax.Array, key_cache: jax.Array, value_cache: jax.Array,
                    positions: jax.Array, tile: int, per_rank: int | None = None,
                    sinks: jax.Array | None = None, window: int | None = None,
                    scale: float | None = None) -> jax.Array:
    """softmax(q k^T * scale) v (``scale`` None: 1/sqrt(D)) as the kernel sums it: per row and
    group of a rank's query heads sharing a KV head (``per_rank`` heads a rank) an online
    softmax over the cache in tiles of ``tile`` tokens (`attention_tile_bf16x3`), every row over
    the tiles up to the largest position of the batch (a tile past a row's position changes
    nothing), its carry started from the heads' ``sinks [Hq]`` when given. A softmax over the
    whole cache at once sums in another f32 order, and a bf16 rounding downstream can flip
    (measured before: Qwen MINI batch 2, one weight draw, 1.5e-3 in the logits at step 0). With
    a ``window`` the cache is a sliding layer's ring of its slots (`mkc.runtime.kv`: slot s holds
    ``q = p - ((p - s) mod slots)``, read at most once), masked by q: written, causal and within
    the window. q [B, Hq, D] -> [B, Hq, D]. Under `jit` (traced positions) the tiles are a
    `fori_loop` of as many: bit-equal to the eager loop (measured on Qwen MINI, 8 steps)."""
    b, hq, d = q.shape
    hkv, slots = key_cache.shape[1], key_cache.shape[2]
    traced = isinstance(positions, jax.core.Tracer)
    n_tiles = (jnp.max(positions) if traced else int(jnp.max(positions))) // tile + 1
    if window is not None:
        n_tiles = jnp.minimum(n_tiles, slots // tile) if traced else min(n_tiles, slots // tile)
    keys = key_cache.astype(jnp.bfloat16)
    values = value_cache.astype(jnp.bfloat16)
    # a rank's query heads (`per_rank` of them, consecutive) that read one KV head go through
    # each tile together, as the kernel's do
    per_rank = per_rank or hq
    groups = [[h for h in range(r, min(r + per_rank, hq)) if (h * hkv) // hq == g]
              for r in range(0, hq, per_rank) for g in range(hkv)]
    rows = []
    for row in range(b):
        p = positions[row]
        heads = []
        for group in groups:
            if not group:
                continue
            kvh = (group[0] * hkv) // hq
            n = len(group)
            if sinks is None:
                carry = (jnp.full((n, 1), -1e30, jnp.float32), jnp.zeros((n, 1), jnp.float32),
                         jnp.zeros((n, d), jnp.float32))
            else:
                carry = (jnp.asarray(sinks, jnp.float32)[group[0]:group[-1] + 1, None],
                         jnp.ones((n, 1), jnp.float32), jnp.zeros((n, d), jnp.float32))

            def visit(t, carry, row=row, p=p, group=group, kvh=kvh):
                tokens = t * tile + jnp.arange(tile)[None, :]
                if window is None:
                    visible = tokens <= p
                else:
                    held = p - jnp.mod(p - tokens, slots)
                    visible = (held >= 0) & (held <= p) & (held > p - window)
                return attention_tile_bf16x3(q[row, group[0]:group[-1] + 1],
                                             _tile(keys[row, kvh], t, tile),
                                             _tile(values[row, kvh], t, tile), visible, *carry,
                                             scale=scale)
            if traced:
                carry = jax.lax.fori_loop(0, n_tiles, visit, carry)
            else:
                for t in range(n_tiles):
                    carry = visit(t, carry)
            heads.append(carry[2] / carry[1])
        rows.append(jnp.concatenate(heads, axis=0))
    return jnp.stack(rows)


def cache_slots(sliding: bool, slots: int, positions: jax.Array, window: int | None
                ) -> tuple[jax.Array, jax.Array]:
    """(the slot each row's new token is written to ``[B]``, which slots it may attend ``[B, T]``)
    of a layer's cache of ``slots`` slots. Full attention: slot t holds position t, visible when
    ``t <= p``. Sliding: a ring of ``slots >= W`` slots (``init_cache`` keeps W; a kernel's ring
    may keep more, `kv ring N slots`), slot ``s`` holding the latest position ``q = p - ((p - s)
    mod slots)``, visible once written (``q >= 0``) and within the window (``q > p - W``, always
    true when ``slots == W``)."""
    slot = jnp.arange(slots)[None, :]
    p = positions[:, None]
    if not sliding:
        return positions, slot <= p
    held = p - jnp.mod(p - slot, slots)
    return positions % slots, (held >= 0) & (held > p - window)


def attend(q: jax.Array, keys: jax.Array, values: jax.Array, visible: jax.Array,
           sinks: jax.Array | None = None) -> jax.Array:
    """Softmax attention in f32: q ``[B, Hq, D]``, keys and values ``[B, Hkv, T, D]``, visible
    ``[B, T]`` -> ``[B, Hq, D]``; query head h reads KV head ``h // (Hq / Hkv)`` (upstream's
    repeat_kv order). With ``sinks [Hq]`` a head's sink logit joins the softmax over its scores
    ``q.k * D^-0.5`` and is dropped after it, so the weights of the visible positions sum to
    less than one."""
    b, hq, d = q.shape
    hkv = keys.shape[1]
    qg = q.reshape(b, hkv, hq // hkv, d)
    scores = jnp.einsum("bgrd,bgtd->bgrt", qg, keys, precision=HIGHEST) * d ** -0.5
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    if sinks is None:
        probs = jax.nn.softmax(scores, axis=-1)
    else:
        sink = jnp.broadcast_to(sinks.reshape(1, hkv, hq // hkv, 1), (b, hkv, hq // hkv, 1))
        probs = jax.nn.softmax(jnp.concatenate([scores, sink], axis=-1), axis=-1)[..., :-1]
    return jnp.einsum("bgrt,bgtd->bgrd", probs, values, precision=HIGHEST).reshape(b, hq, d)


def _project(s: GQA, p: Mapping[str, jax.Array], d: Any, x: jax.Array, rounding: Rounding | None,
             kind: str) -> tuple[jax.Array, jax.Array | None, jax.Array, jax.Array]:
    """(q ``[B, Hq, D]``, the output gate's logits ``[B, Hq, D]`` or None, k, v ``[B, Hkv, D]``)
    of the normed input: Qwen3.5's gate from q_proj's rows `[query | gate]` per head, Muse
    Spark's from `gate_proj` (no bias, `MuseSparkTextAttention.__init__`)."""
    b, hq, hkv, hd = x.shape[0], d.num_attention_heads, d.num_key_value_heads, d.head_dim

    def project(n: str, bias: bool = s.bias) -> jax.Array:
        y = matmul(x, p[f"{n}_proj.weight"], rounding, kind, s.projection, by_tiles=True)
        return y + p[f"{n}_proj.bias"] if bias else y

    q, gate = project("q"), None
    if s.output_gate == "q_proj":
        q_and_gate = q.reshape(b, hq, 2 * hd)
        q, gate = q_and_gate[..., :hd], q_and_gate[..., hd:]
    else:
        q = q.reshape(b, hq, hd)
    if s.output_gate == "rms_gate_proj":
        gate = project("gate", bias=False).reshape(b, hq, hd)
    return q, gate, project("k").reshape(b, hkv, hd), project("v").reshape(b, hkv, hd)


def _norm_rotate(s: GQA, p: Mapping[str, jax.Array], d: Any, q: jax.Array, k: jax.Array,
                 positions: jax.Array, rounding: Rounding | None) -> tuple[jax.Array, jax.Array]:
    """q and k after their per-head norm (if any) and rotation (unless NoPE). The f32 oracle in
    upstream's order (`MuseSparkTextAttention.forward`): norm, q times `qk_scale_factor` where the
    dims have one, then RoPE; the kernel's applies the factor to the scores instead
    (`softmax_scale`), the norm and rotation head by head."""
    eps = d.rms_norm_eps
    if rounding is not None:
        cos, sin = _rope_table(d, positions) if s.rope else (None, None)
        return tuple(_head_norm_rope(t, p[f"{n}_norm.weight"] if s.qk_weights else None, cos, sin,
                                     d.rotary_dim, eps, s.qk_norm) for t, n in ((q, "q"), (k, "k")))
    if s.qk_norm == "weightless":
        q, k = rms_norm_weightless(q, eps), rms_norm_weightless(k, eps)
    elif s.qk_norm:
        q, k = NORM[s.qk_norm](q, p["q_norm.weight"], eps), NORM[s.qk_norm](k, p["k_norm.weight"], eps)
    if hasattr(d, "qk_scale_factor"):
        q = q * d.qk_scale_factor
    if s.rope:
        cos, sin = rope_cos_sin(d, positions)
        q = apply_partial_rope(q, cos[:, None, :], sin[:, None, :])
        k = apply_partial_rope(k, cos[:, None, :], sin[:, None, :])
    return q, k


def _gated(s: GQA, d: Any, attn: jax.Array, gate: jax.Array | None, rounding: Rounding | None
           ) -> jax.Array:
    """The attention output ``[B, Hq, D]`` gated -> ``[B, Hq * D]``: times sigmoid(gate)
    (Qwen3.5's); Muse Spark's, ``o_norm(o) * sigmoid(gate_proj(h))`` with `o_norm` a
    weightless RMS norm of eps `rms_norm_eps` over each head (`MuseSparkTextAttention`; the
    hand kernel's `attention_layer` likewise, in f32, before o_proj)."""
    b = attn.shape[0]
    if s.output_gate == "rms_gate_proj":
        attn = (_rms_gate(attn, gate, d.rms_norm_eps) if rounding is not None
                else rms_norm_weightless(attn, d.rms_norm_eps) * jax.nn.sigmoid(gate))
    elif s.output_gate:
        attn = attn * jax.nn.sigmoid(gate)
    return attn.reshape(b, -1)


def block(s: GQA, p: Mapping[str, jax.Array], d: Any, x: jax.Array, key_cache: jax.Array,
          value_cache: jax.Array, positions: jax.Array, rounding: Rounding | None = None,
          kind: str = "gqa") -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention of one token per row at its own position, from its normed input x, up to
    o_proj's (all-reduced) product: its bias is the residual add's (`forward`).

    ``p`` maps names relative to ``s.prefix`` to f32 arrays. Writes k/v at the row's slot
    (`cache_slots`), then attends over the visible slots. Returns (output ``[B, H]``,
    key_cache, value_cache). ``kind`` names the layer kind whose KV tiles and o_proj
    all-reduce apply."""
    b, hd = x.shape[0], d.head_dim
    q, gate, k, v = _project(s, p, d, mm_input(x, rounding), rounding, kind)
    q, k = _norm_rotate(s, p, d, q, k, positions, rounding)

    rows = jnp.arange(b)
    window = d.sliding_window if s.sliding else None
    slot, visible = cache_slots(s.sliding, key_cache.shape[2], positions, window)
    if rounding is not None:   # the kernel's KV storage dtype, then the reference's container
        k, v = (round_to(t, rounding.stored(kind, "kv")) for t in (k, v))
    key_cache = key_cache.at[rows, :, slot].set(k.astype(key_cache.dtype))
    value_cache = value_cache.at[rows, :, slot].set(v.astype(value_cache.dtype))

    sinks = p["sinks"] if s.sinks else None
    if rounding is not None:
        attn = tiled_attention(q, key_cache, value_cache, positions, rounding.kv_tile(kind),
                               rounding.size("nq"), sinks, window, softmax_scale(d))
    else:
        attn = attend(q, key_cache.astype(jnp.float32), value_cache.astype(jnp.float32), visible, sinks)
    attn = _gated(s, d, attn, gate, rounding)
    per_rank = None if rounding is None else rounding.size("nq") * hd
    out = out_projection(attn, p["o_proj.weight"], rounding, kind, "o_proj", per_rank, "heads",
                         by_tiles=True)
    return out, key_cache, value_cache


def forward(s: GQA, lp: Mapping[str, jax.Array], d: Any, x: jax.Array, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> jax.Array:
    """The residual stream after the layer's attention (its pre-norm, the block, the residual
    add; without `residual`, from the stream's `h` to its `leave`); updates `cache` (this
    layer's KV caches) in place."""
    h = NORM[s.norm](x, lp["input_layernorm.weight"], d.rms_norm_eps) if s.residual else x.h
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    names = f"layers.{layer}.key_cache", f"layers.{layer}.value_cache"
    out, cache[names[0]], cache[names[1]] = block(s, sub, d, h, cache[names[0]], cache[names[1]],
                                                  positions, rounding, kind)
    if s.o_bias:
        out = out + sub["o_proj.bias"]
    return x + out if s.residual else x.leave(out)


def param_shapes(s: GQA, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    """Its upstream parameters under layer prefix `prefix` -> (PyTorch shape, dtype), in
    upstream's module order."""
    H, hd, hq, hkv = d.hidden_size, d.head_dim, d.num_attention_heads, d.num_key_value_heads
    p, bf16 = prefix + s.prefix, "bfloat16"
    shapes: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, out, cols in (("q_proj", (2 if s.output_gate == "q_proj" else 1) * hq * hd, H),
                            ("k_proj", hkv * hd, H), ("v_proj", hkv * hd, H), ("o_proj", H, hq * hd)):
        shapes[p + f"{name}.weight"] = ((out, cols), bf16)
        if s.o_bias if name == "o_proj" else s.bias:
            shapes[p + f"{name}.bias"] = ((out,), bf16)
    if s.output_gate == "rms_gate_proj":     # declared after o_proj upstream; never a bias
        shapes[p + "gate_proj.weight"] = ((hq * hd, H), bf16)
    if s.sinks:
        shapes[p + "sinks"] = ((hq,), bf16)
    if s.qk_weights:
        shapes |= {p + "q_norm.weight": ((hd,), bf16), p + "k_norm.weight": ((hd,), bf16)}
    return shapes | own_norm(s, d, prefix + "input_layernorm.weight")


def init_weight(s: GQA, name: str, shape: tuple[int, ...], rng: np.random.Generator, residual_scale: float
                ) -> np.ndarray | None:
    """Sinks N(0, 1), like a score; projection biases N(0, 0.1) (o_proj's times
    `residual_scale`: it writes the residual stream), so every bias path is exercised
    (upstream initialises them to zero); the rest as the decoder draws them (None): Muse
    Spark's gate_proj like q_proj, N(0, 1/hidden), gate logits O(1)."""
    if s.sinks and name.endswith(s.prefix + "sinks"):
        return rng.normal(0.0, 1.0, shape)
    if name.endswith("_proj.bias"):           # one of its own: present only where declared
        return rng.normal(0.0, 0.1 * (residual_scale if name.endswith("o_proj.bias") else 1.0), shape)
    return None


def init_cache(s: GQA, d: Any, layer: int, batch: int, context: int, dtype: Any = jnp.bfloat16
               ) -> dict[str, jax.Array]:
    """Zeroed KV caches of `context` slots, a sliding kind's of its window's."""
    kv_shape = (batch, d.num_key_value_heads, d.sliding_window if s.sliding else context, d.head_dim)
    return {f"layers.{layer}.key_cache": jnp.zeros(kv_shape, dtype),
            f"layers.{layer}.value_cache": jnp.zeros(kv_shape, dtype)}
