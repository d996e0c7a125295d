"""The DeepSeek-V3 decode graph: each model layer runs as two sublayers of the layer loop, its
MLA (`mla`: the layer library's, RoPE on the rope part, up to the residual add), then its MLP:
a dense SwiGLU (`dense`) in the first `first_k_dense_replace` layers, the layer library's MoE
(`moe`: sigmoid router with the correction bias and group-limited picks, routed SwiGLU
experts, one ungated shared expert) after.

Sharding: attention heads, the dense and shared experts' widths (`mlp`) and the vocabulary
each over their rank group; routed experts over groups of ranks, each expert's width split
within its group (`shard experts over tp / N` with `shard expert_mlp over N`: an expert's
width slice is what a slot of the pool holds, as a whole expert is 84 MiB in bf16, 42 MiB in
the checkpoint's FP8, too much for a core's VMEM), or whole experts on every core (`shard
experts over tp`).
"""
from __future__ import annotations

from mkc.families.deepseek_v3.config import DeepseekV3Dims
from mkc.layers.decoder import vocab_globals
from mkc.layers.mla import MLA
from mkc.layers.moe import MoE, expert_split
from mkc.layers.moe.options import SIGMOID
from mkc.layers.sublayer import layer_kinds
from mkc.layers.swiglu import SwiGLU
from mkc.model.graph import FamilyGraph

SHARD_CLASSES = ("heads", "mlp", "vocab", "experts", "expert_mlp")
MOE = MoE(routing=SIGMOID, shared_expert=True, shared_gate=False, shared_prefix="shared_experts.")
LAYERS = {"mla": (MLA(rope=True),), "dense": (SwiGLU(),), "moe": (MOE,)}


def build(d: DeepseekV3Dims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    experts = expert_split(rules, ranks, "DeepSeek-V3")
    present = {kind: subs for kind, subs in LAYERS.items() if kind in d.layer_kinds}
    kinds, per_rank = layer_kinds(present, d, {"heads": rules["heads"][0], "mlp": rules["mlp"][0], **experts})
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank,
                       **MOE.graph_fields(d, formats, experts["expert_mlp"]))
