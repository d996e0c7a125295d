"""The reference of `SwiGLU` (transformers' `LlamaMLP`, `Qwen3_5MLP`): ``down(silu(gate(x)) *
up(x))`` from the post-attention norm of the residual stream, added to it. Parameters under
the layer's `s.prefix` (`mlp.`); with a `Rounding`, `down` is per-rank partial sums over the
`mlp` ranks all-reduced as the schedule says."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from mkc.layers.reference import NORM, matmul, mm_input, out_projection
from mkc.layers.swiglu import SwiGLU
from mkc.reference.rounding import Rounding


def block(p: Mapping[str, jax.Array], x: jax.Array, rounding: Rounding | None = None,
          kind: str = "") -> jax.Array:
    """SwiGLU: ``down(silu(gate(x)) * up(x))``; ``p`` keys are relative to ``mlp.``. With
    ``rounding``, ``kind`` names the layer kind whose ``down`` all-reduce applies."""
    x = mm_input(x, rounding)
    act = (jax.nn.silu(matmul(x, p["gate_proj.weight"], rounding, kind, "gate_up"))
           * matmul(x, p["up_proj.weight"], rounding, kind, "gate_up"))
    per_rank = None if rounding is None else rounding.size("inter")
    return out_projection(act, p["down_proj.weight"], rounding, kind, "down", per_rank, "mlp")


def forward(s: SwiGLU, lp: Mapping[str, jax.Array], d: Any, x: jax.Array, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> jax.Array:
    """The residual stream after the layer's MLP (its pre-norm, the block, the residual add)."""
    h = NORM[s.norm](x, lp["post_attention_layernorm.weight"], d.rms_norm_eps)
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    return x + block(sub, h, rounding, kind)


def param_shapes(s: SwiGLU, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    H, inter, p, bf16 = d.hidden_size, d.intermediate_size, prefix + s.prefix, "bfloat16"
    return {p + "gate_proj.weight": ((inter, H), bf16), p + "up_proj.weight": ((inter, H), bf16),
            p + "down_proj.weight": ((H, inter), bf16),
            prefix + "post_attention_layernorm.weight": ((H,), bf16)}


def init_cache(s: SwiGLU, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    return {}
