"""The Qwen3.5 text decode graph: gated delta net (`gdn`) and gated attention (`gqa`) layers,
each followed by a SwiGLU MLP, tensor parallel. Each class (attention heads, MLP width,
vocabulary) splits over its own rank group and is replicated across the rest
(`mkc.model.sharding`): 24 heads over 8 ranks of a 16-rank mesh, the MLP over all 16."""
from __future__ import annotations

from mkc.families.qwen3_5.config import Qwen35Dims
from mkc.layers.decoder import vocab_globals
from mkc.layers.gated_delta_net import GatedDeltaNet
from mkc.layers.gqa import GQA
from mkc.layers.sublayer import layer_kinds
from mkc.layers.swiglu import SwiGLU
from mkc.model.graph import FamilyGraph

SHARD_CLASSES = ("heads", "mlp", "vocab")
# Qwen3.5's attention kinds (its RMS norms zero-centred, `1 + w`), each with a SwiGLU MLP.
DELTA_NET = GatedDeltaNet()
GATED_ATTENTION = GQA(norm="zero_centred", qk_norm="zero_centred", output_gate="q_proj")
LAYERS = {"gdn": (DELTA_NET, SwiGLU(norm="zero_centred")),
          "gqa": (GATED_ATTENTION, SwiGLU(norm="zero_centred"))}


def build(d: Qwen35Dims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0], "mlp": rules["mlp"][0]})
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank)
