"""The reference of `SwiGLU` (transformers' `LlamaMLP`, `Qwen3_5MLP`; Kimi K3's SiTU MLP):
``down(act(gate(x), up(x)))`` from the post-attention norm of the residual stream, added to it
(`act`: its `Activation`, ``silu(gate) * up`` by default). Parameters under the layer's
`s.prefix` (`mlp.`); with a `Rounding`, gate and up are multiplied ring tile by ring tile where
they stream, and `down` is per-rank partial sums over the `mlp` ranks all-reduced as the
schedule says."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax

from mkc.layers.activation import Activation
from mkc.layers.reference import NORM, matmul, mm_input, out_projection, own_norm
from mkc.layers.reference import activation as activate
from mkc.layers.swiglu import SwiGLU
from mkc.reference.rounding import Rounding


def block(p: Mapping[str, jax.Array], x: jax.Array, rounding: Rounding | None = None,
          kind: str = "", d: Any = None, activation: Activation = Activation.SILU,
          ops: tuple[str, str, str] = ("gate_up", "down", "inter")) -> jax.Array:
    """A gated MLP: ``down(act(gate(x), up(x)))``; ``p`` keys are relative to its prefix. With
    ``rounding``, ``kind`` names the layer kind and ``ops`` its gate|up and down matrix
    families and the shard size its width splits by (a shared expert's are its own)."""
    gate_up, down, shard = ops
    x = mm_input(x, rounding)
    act = activate(activation, d, matmul(x, p["gate_proj.weight"], rounding, kind, gate_up, by_tiles=True),
                   matmul(x, p["up_proj.weight"], rounding, kind, gate_up, by_tiles=True))
    per_rank = None if rounding is None else rounding.size(shard)
    return out_projection(act, p["down_proj.weight"], rounding, kind, down, per_rank, "mlp", by_tiles=True)


def forward(s: SwiGLU, lp: Mapping[str, jax.Array], d: Any, x: jax.Array, cache: dict, layer: int,
            positions: jax.Array, rounding: Rounding | None, kind: str) -> jax.Array:
    """The residual stream after the layer's MLP (its pre-norm, the block, the residual add)."""
    h = NORM[s.norm](x, lp["post_attention_layernorm.weight"], d.rms_norm_eps) if s.residual else x.h
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    out = block(sub, h, rounding, kind, d, s.activation)
    return x + out if s.residual else x.leave(out)


def param_shapes(s: SwiGLU, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
    H, inter, p, bf16 = d.hidden_size, d.intermediate_size, prefix + s.prefix, "bfloat16"
    return {p + "gate_proj.weight": ((inter, H), bf16), p + "up_proj.weight": ((inter, H), bf16),
            p + "down_proj.weight": ((H, inter), bf16),
            **own_norm(s, d, prefix + "post_attention_layernorm.weight")}


def init_cache(s: SwiGLU, d: Any, layer: int, batch: int, context: int, dtype: Any = None
               ) -> dict[str, jax.Array]:
    return {}
