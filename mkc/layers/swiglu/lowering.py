"""The compute bodies of `SwiGLU` (`op(s, c, *values)`, as `mkc.layers.gqa.lowering`'s)."""
from __future__ import annotations

import jax

from mkc.layers import ops
from mkc.layers.swiglu import SwiGLU
from mkc.runtime.context import Layer


def post_norm(s: SwiGLU, c: Layer) -> jax.Array:
    return ops.pre_norm(s.norm, c, "post_norm")


def gate_up(s: SwiGLU, c: Layer, h: jax.Array) -> jax.Array:
    return ops.activation(s.activation, c.matmul("gate_up", h), c.per_rank["inter"], c.dims)


def down(s: SwiGLU, c: Layer, act: jax.Array) -> jax.Array:
    return c.matmul("down", act)[:, :c.dims.hidden_size]


def mlp_residual(s: SwiGLU, c: Layer, mlp_out: jax.Array) -> None:
    c.refs.x[...] = c.refs.x[...] + mlp_out
