"""The Kimi K3 decode graph: its composition of library kinds and the shard rules it takes.

A K3 layer runs as two sublayers of the kernel's layer loop: attention (`kda` or `mla`), then
the MLP (`dense` for layer 0, `moe` after), as the reference decodes it. Per-rank shapes (the
library kinds') follow the hand-written reference kernel's layout (`docs/k3-reference-notes.md`,
section 1): attention heads, shared experts, the dense MLP, `latent_down` and the vocabulary
over every core; routed experts expert-parallel over groups of cores and tensor-parallel
inside a group; `latent_up` split within a host and replicated across hosts; the router's
columns split between the cores of a chip. Routed experts stay MXFP4 in HBM and in VMEM (codes
and E8M0 scales, K-major).
"""
from __future__ import annotations

import dataclasses

from mkc.families.kimi_k3.config import KimiDims
from mkc.ir import WeightFormat
from mkc.layers.expert_formats import MX_BLOCK
from mkc.layers.decoder import vocab_globals
from mkc.layers.kda import KDA
from mkc.layers.mla import MLA
from mkc.layers.activation import Activation
from mkc.layers.block_residuals import BlockAdd, BlockMix, mix_vectors
from mkc.layers.block_residuals import activations as block_activations
from mkc.layers.moe import MoE
from mkc.layers.moe.options import SIGMOID, Checkpoint, Latent
from mkc.layers.sublayer import layer_kinds
from mkc.layers.swiglu import SwiGLU
from mkc.model.graph import FamilyGraph, LayerKind, ShardingError

SHARD_CLASSES = ("heads", "mlp", "vocab", "latent_down", "experts", "expert_mlp",
                      "latent_up", "router")
# Its layer kinds composed from the layer library: KDA, MLA gated and NoPE, the dense SiTU MLP
# (its width lane padded) and the latent MoE (a sigmoid router split over sibling cores, SiTU
# experts on the checkpoint's MXFP4, ungated shared experts), each between the block attention
# residuals' input mix and residual add.
ATTENTION = {"kda": KDA(residual=False), "mla": MLA(output_gate=True, residual=False)}
MOE = MoE(prefix="block_sparse_moe.", routing=SIGMOID, activation=Activation.SITU,
          checkpoint=Checkpoint.MXFP4_PACKED, shared_expert=True, shared_gate=False,
          shared_prefix="shared_experts.", latent=Latent(), router_split=True, residual=False)
DENSE = SwiGLU(activation=Activation.SITU, residual=False, padded=True)
LAYERS = {
    **{kind: (BlockMix("attn"), sub, BlockAdd("attn", ("attn_out",))) for kind, sub in ATTENTION.items()},
    "dense": (BlockMix("mlp"), DENSE, BlockAdd("mlp", ("mlp_out",))),
    "moe": (BlockMix("mlp"), MOE, BlockAdd("mlp", ("mlp_out", "shared_out"))),
}
# Classes the K3 lowering splits over every core (a rule for them must be `over tp`).
_WHOLE_MESH = ("mlp", "vocab", "latent_down")


def shard_ways(rules: dict[str, tuple[int, int]], ranks: int) -> dict[str, int]:
    """The ways K3's shard classes split, as the library's kinds take them, from a spec's shard
    rules {class: (ways, stride)}; ShardingError says which rule the K3 lowering does not take
    and how to write it. Attention heads split over groups of consecutive ranks, replicated
    across the groups (96 heads over 32 of 64 cores)."""
    heads, heads_stride = rules["heads"]
    if heads_stride != 1 or ranks % heads:
        raise ShardingError(f"the kimi_k3 lowering splits heads over consecutive ranks (a "
                            f"number dividing {ranks}, replicated across the rest), not "
                            f"{heads} ways of stride {heads_stride}", "heads")
    for cls in _WHOLE_MESH:
        if rules[cls] != (ranks, 1):
            raise ShardingError(f"the kimi_k3 lowering splits {cls} over every core: write "
                                f"`shard {cls} over tp`", cls)
    (ep, ep_stride), (tp, tp_stride) = rules["experts"], rules["expert_mlp"]
    if ep * tp != ranks or ep_stride != tp or tp_stride != 1:
        raise ShardingError(
            f"experts over {ep} groups and expert_mlp over {tp} ways must tile the {ranks} "
            f"ranks: expert group = rank // {tp}, width slice = rank % {tp}; write "
            f"`shard experts over tp / {tp}` with `shard expert_mlp over {tp}`", "experts")
    for cls in ("latent_up", "router"):
        ways, stride = rules[cls]
        if stride != 1 or ranks % ways:
            raise ShardingError(f"{cls} must split over consecutive ranks (a chip, a host or "
                                f"a number dividing {ranks}), not {ways} ways of stride {stride}",
                                cls)
    return {"heads": heads, **dict.fromkeys(_WHOLE_MESH, ranks), "experts": ep, "expert_mlp": tp,
            "latent_up": rules["latent_up"][0], "router": rules["router"][0]}


# The formats a routed expert's matrices take (`format expert.gate_up fp8 [block N]`,
# `mkc.layers.expert_formats`): the checkpoint's MXFP4, decoded in the kernel; or FP8 e4m3
# codes, with an E8M0 scale per 32 input rows (the checkpoint's: always exact) or per `block`
# rows, whole pack groups (exact where a block's 32-row scales span at most 8 octaves, which
# packing checks); or FP4 e2m1 codes (two rows a byte), fed to the MXU as they are, with one
# scale per `block` rows, whole pack groups (exact where the checkpoint's values fit one
# scale per block, which packing checks and otherwise refuses unless the spec says `rounded`).
WEIGHT_FORMATS = MOE.weight_formats()


def _matrices_first(kind: LayerKind) -> LayerKind:
    """A composed kind with its matrices before its vectors and states."""
    tensors = kind.tensors
    ordered = {n: t for n, t in tensors.items() if t.role == "matrix"} | tensors
    return dataclasses.replace(kind, tensors=ordered)


def build(d: KimiDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict[str, WeightFormat] | None = None) -> FamilyGraph:
    ways = shard_ways(rules, ranks)
    kinds, per_rank = layer_kinds(LAYERS, d, ways)
    if (width := per_rank["expert_width"]) % (2 * MX_BLOCK):
        raise ShardingError(f"an expert's width slice of {width} is not a multiple of "
                            f"{2 * MX_BLOCK} (MXFP4 blocks of {MX_BLOCK}, two codes per byte)",
                            "expert_mlp")
    glob, per_rank["vocab"] = vocab_globals(d, ways["vocab"])
    glob = {n: t for n, t in glob.items() if n != "lm_head"} | mix_vectors(d.hidden_size, "output") | {
        "lm_head": glob["lm_head"]}     # the output mixture's vectors: the head's rows
    per_rank["host_cores"] = ways["latent_up"]
    return FamilyGraph(kinds={kind: _matrices_first(k) for kind, k in kinds.items()}, globals=glob,
                       per_rank=per_rank, activations={**block_activations(d), "latent": (
                           (-1, per_rank["latent_gathered"]), "f32")},
                       **MOE.graph_fields(d, formats, ways["expert_mlp"]))
