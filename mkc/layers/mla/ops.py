"""The kernel math of `MLA`, weight-absorbed decode over streamed latent tiles (one batch row),
on 2-D values with only ops Mosaic lowers (no lane-splitting reshapes: a per-head product is
one 2-D matmul against a block-diagonal operand built with an iota mask).

The weights come in the kernel's layout (`mkc.layers.mla.weights`): q_b_proj split into
``[q_lora, heads * nope]`` and ``[q_lora, heads * rope]`` so both query parts come out as flat
rows, and kv_b_proj into ``w_uk [heads * nope, R]`` and ``w_uv [R, heads * v]``.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

F32 = jnp.float32


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
