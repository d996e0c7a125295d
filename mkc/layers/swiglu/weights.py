"""Where `SwiGLU`'s per-rank tensors come from: gate_proj and up_proj rows of an `mlp` part
side by side (`[gate | up]`), down_proj's columns of it, the post-attention norm."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mkc.layers.swiglu import SwiGLU
from mkc.layers.weights import padded_block, rows_of_part, tensor
from mkc.layers.weights import no_kernel_states as kernel_states  # noqa: F401  (no state)
from mkc.layers.weights import no_reference_states as reference_states  # noqa: F401
from mkc.model.sharding import ShardTable


def tensor_names(s: SwiGLU, d: Any) -> tuple[str, ...]:
    return ("gate_up", "down", *(("post_norm",) if s.residual else ()))


def matrix(s: SwiGLU, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    if s.padded:
        return padded_mlp_matrix(hf, prefix + s.prefix, name, shards.part("mlp", rank),
                                 s.width(d, {"mlp": shards.ways("mlp")}))
    return mlp_matrix(hf, prefix + s.prefix, d.intermediate_size, name, rank, shards)


def padded_mlp_matrix(hf: Mapping, p: str, name: str, part: int, width: int) -> np.ndarray:
    """`mlp_matrix` of a width split into `width`-wide parts, the last ones zero padded."""
    if name == "gate_up":
        return np.concatenate([padded_block(tensor(hf, p + f"{x}_proj.weight"), 0, part, width)
                               for x in ("gate", "up")], axis=0).T
    return padded_block(tensor(hf, p + "down_proj.weight").T, 0, part, width)


def mlp_matrix(hf: Mapping, p: str, width: int, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """`gate_up` (`[gate | up]`) or `down` of the SwiGLU MLP whose `gate_proj`, `up_proj` and
    `down_proj` are under `p`, `width` wide, cut to `rank`'s part of the `mlp` class."""
    cols = rows_of_part(width, "mlp", rank, shards)
    if name == "gate_up":
        return np.concatenate([tensor(hf, p + "gate_proj.weight", cols).T,
                               tensor(hf, p + "up_proj.weight", cols).T], axis=1)
    return tensor(hf, p + "down_proj.weight", (slice(None), cols)).T


def vector(s: SwiGLU, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    return tensor(hf, prefix + "post_attention_layernorm.weight")[None, :]
