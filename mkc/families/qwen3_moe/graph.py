"""The Qwen3-MoE decode graph: each layer runs as two sublayers of the layer loop, its GQA
attention (q/k RMS-normed per head, plain weights, before RoPE) up to the residual add, then
the sparse MoE (`moe`: router and routed experts, no shared expert). Heads and the vocabulary
split over their rank groups; routed experts expert-parallel over every core."""
from __future__ import annotations

from mkc.families.qwen3_moe.config import Qwen3MoeDims
from mkc.layers.decoder import vocab_globals
from mkc.layers.gqa import GQA
from mkc.layers.moe import MoE, expert_ways
from mkc.layers.sublayer import layer_kinds
from mkc.model.graph import FamilyGraph

SHARD_CLASSES = ("heads", "vocab", "experts")
LAYERS = {"gqa": (GQA(qk_norm="plain"),), "moe": (MoE(),)}


def build(d: Qwen3MoeDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    experts = expert_ways(rules, ranks, "Qwen3-MoE")
    kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0], "experts": experts})
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank,
                       **LAYERS["moe"][0].graph_fields(d, formats))
