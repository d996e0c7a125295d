"""The GPT-OSS decode graph: each model layer runs as two sublayers of the layer loop, its
attention (`swa` on `sliding_attention` layers, `gqa` on `full_attention` ones), up to the
residual add, then its MoE (`moe`): a biased router and biased MXFP4 experts.

The two attention kinds are the layer library's GQA with biases and sinks (`LAYERS`), the same
ops and tensors; they differ in what their KV cache holds
(`cache_slots`): a full layer's holds every position of the context, a sliding layer's only its
window. The graph's cache tensors are per token, like every family's; the sliding kind declares
its window (`LayerKind.window`), and the spec keeps its cache as the window's KV ring (`kv ring
N slots` in the swa phase, the core's mechanism: position p in slot p % N, N >= W, checked by
`mkc.checks.kv_ring`). Without the ring the kind's `ContextLimit` of the window holds
(`window_limit`): its cache is then the per-token cache of a context at most the window.

Sharding (three classes, all split over their own rank group):

* `heads`: query heads, with their sinks, their q columns and their part of o_proj's rows
  (a partial sum over the heads group, all-reduced before the residual add, so o_proj's bias
  is added once, there); KV heads split with them, or, with fewer KV heads than parts, each
  part holds the one its query heads read (`mkc.layers.gqa.kv_heads_per_part` / `kv_heads_of`);
* `vocab`: the embedding and lm_head rows (`mkc.layers.decoder.vocab_globals`);
* `experts`: routed experts expert-parallel over every core, whole experts (`experts / ranks`
  each, in id order), fetched into a pool's expert slots as routing picks them, as Qwen3.5
  MoE's are. The router (and its bias) is replicated: every core scores every expert.

One routed expert as its slot holds it (`expert_families`), K-major (`[in, out]`):
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
from mkc.layers import expert_formats as expert_formats_lib
from mkc.layers.decoder import vocab_globals
from mkc.layers.gqa import GQA
from mkc.layers.sublayer import layer_kinds
from mkc.model.graph import (ContextLimit, FamilyGraph, LayerKind, Op, ShardingError, Tensor,
                             lane_pad, split)

SHARD_CLASSES = ("heads", "vocab", "experts")
ATTENTION_KINDS = ("swa", "gqa")      # config.LAYER_KINDS' values: sliding, full
# A routed expert's matrix classes and the formats they take (`format CLASS NAME [block N]`),
# the checkpoint's first: MXFP4 decoded in the kernel, or FP8 e4m3 codes (every e2m1 value is
# an e4m3 value: exact at the checkpoint's 32-row scales; a larger block folds the 32-row
# scales into one, exact where they span at most 8 octaves, which packing checks).
WEIGHT_FORMATS = (("expert.gate_up", ("mxfp4", "fp8")), ("expert.down", ("mxfp4", "fp8")))
# The attention sublayers, the layer library's GQA with biases and sinks, sliding or full; the
# `moe` sublayer is the family's own.
LAYERS = {"swa": (GQA(bias=True, sinks=True, sliding=True),), "gqa": (GQA(bias=True, sinks=True),)}


def _v(name: str, *shape: int) -> Tensor:
    return Tensor(name, "vector", tuple(shape), "f32")


def window_limit(d: GptOssDims) -> ContextLimit:
    """Without the window's KV ring a sliding layer's cache is the core's per-token cache of the
    whole context: it computes upstream's window only while no position reaches past it (slot t
    holds position t and every written slot is inside the window). A longer context needs the
    ring (`kv ring N slots`), which lifts this limit."""
    W = d.sliding_window
    return ContextLimit(
        W, f"without a KV ring its per-token KV cache computes its {W}-token window only while "
           "the context is within it",
        f"keep the swa phase's KV cache as the window's ring (`kv ring {max(W, 16)} slots`, a "
        f"multiple of its KV tile; {W} + R - 1 with a verify step of R rows), or write "
        f"`context {W}` or less")


def cache_slots(d: GptOssDims, kind: str, context: int) -> int:
    """Token slots of a layer's KV cache: the context on a full layer, the window on a sliding
    one, whatever the context (the reference's `init_cache`; a verify step's R rows of a
    sequence need a ring of W + R - 1, or the last row would overwrite slots the first still
    reads)."""
    if kind not in ATTENTION_KINDS:
        raise KeyError(f"{kind!r} is not an attention kind of {d.family} ({ATTENTION_KINDS})")
    return d.sliding_window if kind == "swa" else context


def expert_rows(d: GptOssDims) -> dict[str, int]:
    """Input rows of the expert matrices as a slot holds them: gate|up takes the hidden size,
    down the lane-padded half width."""
    return {"gate_up": d.hidden_size, "down": lane_pad(d.intermediate_size)}


def pack_groups(d: GptOssDims) -> dict[str, int]:
    """Input rows an expert matrix is decoded and multiplied in at a time: 320 for gate_up's
    2880 hidden rows, 128 for down's lane-padded rows (`dividing_pack_groups`)."""
    return expert_formats_lib.dividing_pack_groups(expert_rows(d))


def expert_formats(d: GptOssDims, formats: dict[str, WeightFormat] | None = None
                   ) -> dict[str, WeightFormat]:
    """Each expert matrix class's format, its block resolved to input rows (32 for MXFP4 and
    plain FP8; a block past the matrix's rows is the whole matrix); FormatError for a block the
    kernel cannot use (`mkc.layers.expert_formats.resolve`)."""
    return expert_formats_lib.resolve(WEIGHT_FORMATS, expert_rows(d), pack_groups(d), formats)


def expert_families(d: GptOssDims, formats: dict[str, WeightFormat]) -> dict[str, Tensor]:
    """One routed expert as its slot holds it (module docstring), in the resolved formats."""
    H, half = d.hidden_size, lane_pad(d.intermediate_size)
    return {
        **expert_formats_lib.tensors("gate_up", H, 2 * half, formats["expert.gate_up"]),
        "gate_up_bias": Tensor("gate_up_bias", "matrix", (1, 2 * half), "bf16"),
        **expert_formats_lib.tensors("down", half, H, formats["expert.down"]),
        "down_bias": Tensor("down_bias", "matrix", (1, H), "bf16"),
    }


def moe_kind(d: GptOssDims) -> LayerKind:
    """The MoE sublayer: the biased router, top-k, the picked experts (each with its biases,
    weighted and summed on the rank holding it: a partial sum over the experts group)."""
    H, E = d.hidden_size, d.experts
    return LayerKind(MOE_KIND, ops=(
        Op("post_norm", reads=("x", "post_norm"), writes=("h",)),
        Op("router", reads=("h", "router_bias"), writes=("router_logits",), matmul="router"),
        Op("route", reads=("router_logits",), writes=("expert_ids", "expert_weights"),
           picks_experts=True),
        Op("routed_experts", reads=("h", "expert_ids", "expert_weights"), writes=("routed_out",),
           partial=("experts",), width=H, runs_experts=True),
        Op("mlp_residual", reads=("routed_out", "x"), writes=("x",)),
    ), tensors={
        "router": Tensor("router", "matrix", (H, E), "bf16"),      # replicated
        "post_norm": _v("post_norm", H),
        "router_bias": _v("router_bias", E),
    })


def build(d: GptOssDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict[str, WeightFormat] | None = None) -> FamilyGraph:
    """The family graph under the spec's shard rules {class: (ways, stride)} over `ranks`;
    ShardingError names the rule that does not fit, FormatError the expert format."""
    if rules["experts"] != (ranks, 1):
        raise ShardingError("the GPT-OSS graph holds whole experts, split over every core: "
                            "write `shard experts over tp`", "experts")
    kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0]},
                                  swa={"context_limit": window_limit(d), "window": d.sliding_window})
    kinds[MOE_KIND] = moe_kind(d)
    resolved = expert_formats(d, formats)
    glob, vocab = vocab_globals(d, rules["vocab"][0])
    groups = pack_groups(d)
    per_rank |= {"vocab": vocab, "window": d.sliding_window,
                 "local_experts": split(d.experts, ranks, "num_local_experts", "experts"),
                 "expert_width": d.intermediate_size, "expert_half": lane_pad(d.intermediate_size),
                 "expert_tp": 1, "gate_up_group": groups["gate_up"], "down_group": groups["down"]}
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank,
                       experts=expert_families(d, resolved), experts_total=d.experts,
                       top_k=d.top_k, formats=resolved)
