"""The Llama decode graph: one layer kind, `gqa` (GQA attention then a SwiGLU MLP, RMS norms
with a plain weight), tensor parallel: heads, MLP width and vocabulary each split over their
rank group (`mkc.model.sharding`)."""
from __future__ import annotations

from mkc.families.llama.config import LlamaDims
from mkc.layers.decoder import vocab_globals
from mkc.layers.gqa import GQA
from mkc.layers.sublayer import layer_kinds
from mkc.layers.swiglu import SwiGLU
from mkc.model.graph import FamilyGraph

SHARD_CLASSES = ("heads", "mlp", "vocab")
LAYERS = {"gqa": (GQA(), SwiGLU())}


def build(d: LlamaDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0], "mlp": rules["mlp"][0]})
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank)
