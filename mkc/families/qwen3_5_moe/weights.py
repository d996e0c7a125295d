"""Where each per-rank weight family of Qwen3.5 MoE comes from in the HF checkpoint.

The layer loop runs two sublayers per model layer (attention, then MoE), so `layer` here is a
sublayer index; model layer = layer // 2. Attention families and the norms are Qwen3.5's
(`mkc.families.qwen3_5.weights`). Routed experts come fused, as upstream declares them:
`mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) and `mlp.experts.down_proj [E, H, I]`
(`mkc.checkpoint` fuses a per-expert checkpoint's into these; with a lazy load each
`hf[name][e]` reads one expert).
"""
from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from mkc.families.qwen3_5 import weights as qwen
from mkc.families.qwen3_5_moe.config import Qwen35MoeDims
from mkc.model.sharding import ShardTable

global_tensor = qwen.global_tensor
head_vectors, embedding = qwen.head_vectors, qwen.embedding


def _w(hf: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(hf[name]).astype(np.float32)


def family_matrix(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, layer: int, family: str,
                  rank: int, shards: ShardTable) -> np.ndarray:
    """The [in, out] matrix `family` of sublayer `layer` (-1: the tail) on `rank`."""
    if layer < 0:
        return qwen.family_matrix(hf, d, layer, family, rank, shards)
    p = f"model.layers.{layer // 2}.mlp."
    if family == "router":
        return _w(hf, p + "gate.weight").T                                   # [H, E]
    n = d.shared_expert_intermediate_size // shards.ways("mlp")
    part = shards.part("mlp", rank)
    cols = slice(part * n, (part + 1) * n)
    if family == "shared_gate_up":
        return np.concatenate([_w(hf, p + "shared_expert.gate_proj.weight")[cols].T,
                               _w(hf, p + "shared_expert.up_proj.weight")[cols].T], axis=1)
    if family == "shared_down":
        return _w(hf, p + "shared_expert.down_proj.weight")[:, cols].T
    return qwen.family_matrix(hf, d, layer // 2, family, rank, shards)


def vector(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, layer: int, family: str,
           rank: int, shards: ShardTable) -> np.ndarray:
    if family == "shared_gate":
        return _w(hf, f"model.layers.{layer // 2}.mlp.shared_expert_gate.weight")   # [1, H]
    return qwen.vector(hf, d, layer // 2, family, rank, shards)


def expert_matrix(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, layer: int, local: int,
                  name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """Local expert `local` of `rank`'s share ([in, out]): experts split evenly over the ranks."""
    e = shards.part("experts", rank) * (d.experts // shards.ways("experts")) + local
    p = f"model.layers.{layer // 2}.mlp.experts."
    if name == "gate_up":
        return np.asarray(hf[p + "gate_up_proj"][e]).astype(np.float32).T   # [H, 2I]: gate | up
    if name == "down":
        return np.asarray(hf[p + "down_proj"][e]).astype(np.float32).T      # [I, H]
    raise KeyError(f"no HF source for expert matrix {name!r}")


def matrix(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, per_rank: dict[str, int], layer: int,
           kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    return family_matrix(hf, d, layer, name, rank, shards)


def layer_vector(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, per_rank: dict[str, int], layer: int,
                 kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    return vector(hf, d, layer, name, rank, shards)


def expert(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, per_rank: dict[str, int], layer: int,
           local: int, rank: int, shards: ShardTable,
           formats: Mapping[str, str] | None = None) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank` as the pool holds it: bf16 [in, out] matrices by name
    (the family offers no other format)."""
    return {name: expert_matrix(hf, d, layer, local, name, rank, shards).astype(ml_dtypes.bfloat16)
            for name in ("gate_up", "down")}


def reference_states(state, d: Qwen35MoeDims, per_rank: dict[str, int], shards: ShardTable,
                     kind_layers: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Qwen3.5's state layouts, keyed by model layer (sublayer // 2)."""
    by_model_layer = {k: [i // 2 for i in v] for k, v in kind_layers.items()}
    return qwen.reference_states(state, d, per_rank, shards, by_model_layer)
