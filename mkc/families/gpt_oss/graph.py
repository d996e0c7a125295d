"""The GPT-OSS decode graph: each model layer runs as two sublayers of the layer loop, its
attention (`swa` on `sliding_attention` layers, `gqa` on `full_attention` ones), up to the
residual add, then its MoE (`moe`): a biased router and biased MXFP4 experts, the layer
library's `MoE` with GPT-OSS's options (`MOE`).

The two attention kinds are the layer library's GQA with biases and sinks (`LAYERS`), the same
ops and tensors; they differ in what their KV cache holds
(`cache_slots`): a full layer's holds every position of the context, a sliding layer's only its
window. The graph's cache tensors are per token, like every family's; the sliding kind declares
its window (`LayerKind.window`), and the spec keeps its cache as the window's KV ring (`kv ring
N slots` in the swa phase, the core's mechanism: position p in slot p % N, N >= W, checked by
`mkc.checks.kv_ring`). Without the ring the kind's `ContextLimit` of the window holds
(`mkc.layers.gqa.window_limit`): its cache is then the per-token cache of a context at most the window.

Sharding (three classes, all split over their own rank group):

* `heads`: query heads, with their sinks, their q columns and their part of o_proj's rows
  (a partial sum over the heads group, all-reduced before the residual add, so o_proj's bias
  is added once, there); KV heads split with them, or, with fewer KV heads than parts, each
  part holds the one its query heads read (`mkc.layers.gqa.kv_heads_per_part` / `kv_heads_of`);
* `vocab`: the embedding and lm_head rows (`mkc.layers.decoder.vocab_globals`);
* `experts`: routed experts expert-parallel over every core, whole experts (`experts / ranks`
  each, in id order), fetched into a pool's expert slots as routing picks them, as Qwen3.5
  MoE's are. The router (and its bias) is replicated: every core scores every expert.

One routed expert as its slot holds it (`mkc.layers.moe.MoE.expert_tensors`), K-major (`[in, out]`):
gate_up's output columns de-interleaved from the checkpoint's (gate = even rows of
`gate_up_proj`, up = odd ones) into `[gate | up]`, each half padded with zero columns to whole
128-lane tiles (`expert_half` = lane_pad(I): 2944 for I = 2880), so the clamped SwiGLU reads
two lane-aligned halves; down's input rows padded to match (zero codes). A padded column is
zero with a zero bias, so its activation `(up + 1) * gate * sigmoid(alpha * gate)` is zero
and multiplies zero rows of down: the padding changes no value. The codes and E8M0 scales
are the layer library's (`mkc.layers.expert_formats`: MXFP4 two input rows a byte, a scale per
32 rows) in the format the spec chooses (`format expert.gate_up fp8`); the biases are one bf16
row each (the checkpoint's dtype: exact).
"""
from __future__ import annotations

from mkc.families.gpt_oss.config import MOE_KIND, GptOssDims
from mkc.ir import WeightFormat
from mkc.layers.decoder import vocab_globals
from mkc.layers.gqa import GQA, window_limit
from mkc.layers.moe import MoE
from mkc.layers.moe.options import TOP_K_SOFTMAX, Activation, Checkpoint
from mkc.layers.sublayer import layer_kinds
from mkc.model.graph import FamilyGraph, ShardingError, split

SHARD_CLASSES = ("heads", "vocab", "experts")
ATTENTION_KINDS = ("swa", "gqa")      # config.LAYER_KINDS' values: sliding, full
# The attention sublayers, the layer library's GQA with biases and sinks, sliding or full
# (their weights are the library's too: `weights`), then the library's MoE with GPT-OSS's
# options.
ATTENTION = {"swa": (GQA(bias=True, o_bias=True, sinks=True, sliding=True),),
             "gqa": (GQA(bias=True, o_bias=True, sinks=True),)}
MOE = MoE(router_bias=True, routing=TOP_K_SOFTMAX, activation=Activation.CLAMPED, expert_bias=True,
          checkpoint=Checkpoint.MXFP4, router_prefix="router.", gate_up_interleaved=True)
LAYERS = ATTENTION | {MOE_KIND: (MOE,)}
# A routed expert's matrix classes and the formats they take (`format CLASS NAME [block N]`),
# the checkpoint's first: MXFP4 decoded in the kernel, or FP8 e4m3 codes (every e2m1 value is
# an e4m3 value: exact at the checkpoint's 32-row scales; a larger block folds the 32-row
# scales into one, exact where they span at most 8 octaves, which packing checks).
WEIGHT_FORMATS = MOE.weight_formats()
# Input rows an expert matrix is decoded and multiplied in at a time (320 for gate_up's 2880
# hidden rows, 128 for down's lane-padded rows), and each expert class's resolved format.
pack_groups, expert_formats = MOE.pack_groups, MOE.expert_formats


def cache_slots(d: GptOssDims, kind: str, context: int) -> int:
    """Token slots of a layer's KV cache: the context on a full layer, the window on a sliding
    one, whatever the context (the reference's `init_cache`; a verify step's R rows of a
    sequence need a ring of W + R - 1, or the last row would overwrite slots the first still
    reads)."""
    if kind not in ATTENTION_KINDS:
        raise KeyError(f"{kind!r} is not an attention kind of {d.family} ({ATTENTION_KINDS})")
    return d.sliding_window if kind == "swa" else context


def build(d: GptOssDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict[str, WeightFormat] | None = None) -> FamilyGraph:
    """The family graph under the spec's shard rules {class: (ways, stride)} over `ranks`;
    ShardingError names the rule that does not fit, FormatError the expert format."""
    if rules["experts"] != (ranks, 1):
        raise ShardingError("the GPT-OSS graph holds whole experts, split over every core: "
                            "write `shard experts over tp`", "experts")
    split(d.experts, ranks, "num_local_experts", "experts")      # refused in upstream's name
    kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0], "experts": ranks},
                                  swa={"context_limit": window_limit(d), "window": d.sliding_window})
    glob, vocab = vocab_globals(d, rules["vocab"][0])
    per_rank |= {"vocab": vocab, "window": d.sliding_window}
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank, **MOE.graph_fields(d, formats))
