"""The Qwen3.5 MoE decode graph: each layer runs as two sublayers of the layer loop, its
attention (Qwen3.5's gated delta net `gdn` or gated attention `gqa`, up to the residual add),
then the layer library's sparse MoE (`moe`: router, routed experts and a sigmoid-gated shared
expert, zero-centred norm; `mkc.layers.moe`).

Sharding: attention heads, the shared expert's width (`mlp`) and the vocabulary each over their
rank group, as Qwen3.5 does; routed experts expert-parallel over every core. Routed experts
are stored as the spec's `format expert.gate_up|expert.down` says: bf16, the checkpoint's, or
`fp8 block N rounded` (`mkc.layers.moe`).
"""
from __future__ import annotations

from mkc.families.qwen3_5_moe.config import Qwen35MoeDims
from mkc.layers.decoder import vocab_globals
from mkc.layers.gated_delta_net import GatedDeltaNet
from mkc.layers.gqa import GQA
from mkc.layers.moe import MoE, expert_ways
from mkc.layers.sublayer import layer_kinds
from mkc.model.graph import FamilyGraph

SHARD_CLASSES = ("heads", "mlp", "vocab", "experts")
# Qwen3.5's attention kinds (RMS norms zero-centred, `1 + w`), each up to its residual add,
# then the MoE as a loop layer of its own.
DELTA_NET = GatedDeltaNet()
GATED_ATTENTION = GQA(norm="zero_centred", qk_norm="zero_centred", output_gate="q_proj")
LAYERS = {"gdn": (DELTA_NET,), "gqa": (GATED_ATTENTION,),
          "moe": (MoE(norm="zero_centred", shared_expert=True),)}


def build(d: Qwen35MoeDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    experts = expert_ways(rules, ranks, "Qwen3.5 MoE")
    kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0], "mlp": rules["mlp"][0],
                                              "experts": experts})
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank,
                       **LAYERS["moe"][0].graph_fields(d, formats))
