"""The Muse Spark decode graph: each model layer runs as two sublayers of the layer loop, its
attention (`swa` on sliding layers, `full` on full ones), then its MoE (`moe`; `moe_bf16` in
the layers whose experts the NVFP4 release keeps bf16, held so), each between
the gated residuals' centred pre-norm and gated update (`mkc.layers.gated_residuals`).

The attention is the layer library's GQA with Muse Spark's options: a weightless per-head RMS
norm of q and k, the scores scaled by `qk_scale_factor / sqrt(head_dim)`, the output
`rms(o) * sigmoid(gate_proj(h))` per head; rotary embedding and a window on the sliding
layers, neither on the full ones. The MoE is the library's latent MoE (`MoE` with a `Latent`
normed at its input and a norm of each pick's output, the scaled sigmoid router with its f32
weight held as a bf16 pair). The sliding kind declares its window; the spec keeps its cache as
the window's KV ring (`kv ring N slots`, as GPT-OSS's), without which its `ContextLimit`
holds (`mkc.layers.gqa.window_limit`).

Sharding (`SHARD_CLASSES`): attention heads and the vocabulary over their rank groups; routed
experts expert-parallel over groups of ranks and each expert's width over a group
(`mkc.layers.moe.expert_split`: the hand kernel splits every expert's width over all 8 cores,
`shard experts over tp / 8` with `shard expert_mlp over 8`); the latent projections' output
columns over `latent_down` and `latent_up`, all-gathered. The router is whole on every core
(its f32 weight's bf16 pair is not split).
"""
from __future__ import annotations

from mkc.families.muse_spark.config import MOE_BF16, MuseSparkDims
from mkc.ir import WeightFormat
from mkc.layers.decoder import vocab_globals
from mkc.layers.gated_residuals import GatedAdd, GatedPre
from mkc.layers.gqa import GQA, window_limit
from mkc.layers.moe import MoE, expert_split
from mkc.layers.moe.options import SCALED_SIGMOID, Latent
from mkc.layers.sublayer import layer_kinds
from mkc.model.graph import FamilyGraph

SHARD_CLASSES = ("heads", "vocab", "experts", "expert_mlp", "latent_down", "latent_up")
_ATTENTION = dict(qk_norm="weightless", output_gate="rms_gate_proj", residual=False)
ATTENTION = {"swa": GQA(sliding=True, **_ATTENTION), "full": GQA(rope=False, **_ATTENTION)}
LATENT = Latent(width="moe_hidden_size", down="pre_expert_proj.weight", up="post_expert_proj.weight",
                norm="pre_expert_norm.weight", norm_at="input", norm_weight="zero_centred",
                expert_norm="experts.post_expert_norm.weight")
MOE = MoE(routing=SCALED_SIGMOID, latent=LATENT, residual=False, bf16_kind=MOE_BF16)
LAYERS = {
    **{kind: (GatedPre("attn"), sub, GatedAdd("attn", ("attn_out",))) for kind, sub in ATTENTION.items()},
    **{kind: (GatedPre("mlp"), MOE, GatedAdd("mlp", ("mlp_out",))) for kind in ("moe", MOE_BF16)},
}
# The routed experts' classes and formats, the bf16 checkpoint's (the NVFP4 release's: the
# family asks the model, `MOE.weight_formats(dims)`).
WEIGHT_FORMATS = MOE.weight_formats()


def build(d: MuseSparkDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict[str, WeightFormat] | None = None) -> FamilyGraph:
    """The family graph under the spec's shard rules {class: (ways, stride)} over `ranks`;
    ShardingError names the rule that does not fit, FormatError the expert format."""
    ways = {"heads": rules["heads"][0], **expert_split(rules, ranks, "muse_spark"),
            "latent_down": rules["latent_down"][0], "latent_up": rules["latent_up"][0]}
    run = {k: v for k, v in LAYERS.items() if k in d.layer_kinds}     # moe_bf16 in an NVFP4 model's
    kinds, per_rank = layer_kinds(run, d, ways,
                                  swa={"context_limit": window_limit(d), "window": d.sliding_window})
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    per_rank["window"] = d.sliding_window
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank,
                       activations=MOE.activations(d),
                       **MOE.graph_fields(d, formats, ways["expert_mlp"]))
