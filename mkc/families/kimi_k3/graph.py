"""The Kimi K3 decode graph: sublayer kinds, per-rank tensor families and sharding feasibility.

A K3 layer runs as two sublayers of the kernel's layer loop: attention (`kda` or `mla`), then
the MLP (`dense` for layer 0, `moe` after), as the reference decodes it. Per-rank shapes follow
the hand-written reference kernel's layout (`docs/k3-reference-notes.md`, section 1): attention
heads, shared experts, the dense MLP, `latent_down` and the vocabulary over every core; routed
experts expert-parallel over groups of cores and tensor-parallel inside a group; `latent_up`
split within a host and replicated across hosts; the router's columns split between the cores
of a chip. Routed experts stay MXFP4 in HBM and in VMEM (codes and E8M0 scales, K-major).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from mkc.families.kimi_k3.config import KimiDims
from mkc.ir import WeightFormat
from mkc.layers.expert_formats import MX_BLOCK
from mkc.layers.kda import KDA, projection_cols
from mkc.layers.mla import MLA
from mkc.layers.activation import Activation
from mkc.layers.block_residuals import BlockAdd, BlockMix, mix_vectors
from mkc.layers.block_residuals import activations as block_activations
from mkc.layers.moe import MoE
from mkc.layers.moe.options import SIGMOID, Checkpoint
from mkc.layers.sublayer import layer_kinds
from mkc.layers.swiglu import SwiGLU
from mkc.model.graph import FamilyGraph, LayerKind, ShardingError, Tensor, lane_pad, split

SHARD_CLASSES = ("heads", "mlp", "vocab", "latent_down", "experts", "expert_mlp",
                      "latent_up", "router")
# Its layer kinds composed from the layer library: KDA, MLA gated and NoPE, the dense SiTU MLP
# (its width lane padded) and the latent MoE (a sigmoid router split over sibling cores, SiTU
# experts on the checkpoint's MXFP4, ungated shared experts), each between the block attention
# residuals' input mix and residual add.
ATTENTION = {"kda": KDA(residual=False), "mla": MLA(output_gate=True, residual=False)}
MOE = MoE(prefix="block_sparse_moe.", routing=SIGMOID, activation=Activation.SITU,
          checkpoint=Checkpoint.MXFP4_PACKED, shared_expert=True, shared_gate=False,
          shared_prefix="shared_experts.", latent=True, router_split=True, residual=False)
DENSE = SwiGLU(activation=Activation.SITU, residual=False, padded=True)
LAYERS = {
    **{kind: (BlockMix("attn"), sub, BlockAdd("attn", ("attn_out",))) for kind, sub in ATTENTION.items()},
    "dense": (BlockMix("mlp"), DENSE, BlockAdd("mlp", ("mlp_out",))),
    "moe": (BlockMix("mlp"), MOE, BlockAdd("mlp", ("mlp_out", "shared_out"))),
}
# Classes the K3 lowering splits over every core (a rule for them must be `over tp`).
_WHOLE_MESH = ("mlp", "vocab", "latent_down")


@dataclass(frozen=True)
class KimiSharding:
    """How K3's dimensions split over the mesh (derived from a spec's shard rules)."""

    ranks: int = 32
    expert_tp: int = 4           # ranks sharing one expert's width (TP); EP = ranks / this
    host_cores: int = 8          # latent_up is split over a host's cores
    router_split: int = 2        # sibling cores each score a share of the experts
    # Attention heads split over groups of this many consecutive ranks, replicated across the
    # groups (0: every rank): 96 heads over 32 of 64 cores.
    head_parts: int = 0

    @property
    def head_ways(self) -> int:
        return self.head_parts or self.ranks

    def head_part(self, rank: int) -> int:
        """The part of the attention heads rank `rank` holds."""
        return rank % self.head_ways

    @property
    def expert_groups(self) -> int:
        return self.ranks // self.expert_tp

    @staticmethod
    def from_rules(rules: dict[str, tuple[int, int]], ranks: int) -> "KimiSharding":
        """Check shard rules {class: (ways, stride)} against the K3 lowering; ShardingError says
        which rule does not fit and how to write it."""
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
        return KimiSharding(ranks=ranks, expert_tp=tp, host_cores=rules["latent_up"][0],
                            router_split=rules["router"][0],
                            head_parts=0 if heads == ranks else heads)


def _ceil_split(total: int, ways: int) -> int:
    """A split that pads the last shards with zeros (the reference does this for the latent)."""
    return -(-total // ways)


def _m(name: str, rows: int, cols: int, dtype: str = "bf16", partial: tuple[str, ...] = (),
       split: str | None = None, cls: str = "") -> Tensor:
    return Tensor(name, "matrix", (rows, cols), dtype, partial_out=partial, split_out=split,
                  format_class=cls)


def _v(name: str, *shape: int) -> Tensor:
    return Tensor(name, "vector", tuple(shape), "f32")


@dataclass(frozen=True)
class KimiGeometry:
    """Per-rank sizes the K3 kernel indexes by."""

    heads: int
    kda_cols: int
    shared: int
    inter: int                   # the dense MLP's width (lane padded)
    latent_cols: int             # this rank's latent_down columns (lane padded)
    latent_gathered: int         # the all-gathered latent width (ranks * latent_cols)
    up_cols: int                 # latent_up output columns of this rank
    router_cols: int
    expert_width: int            # one expert's width slice on this rank
    local_experts: int           # experts of this rank's expert group
    cache_width: int             # an MLA latent cache row (kv_lora + extra, lane padded)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


def kimi_k3_geometry(d: KimiDims, sh: KimiSharding) -> KimiGeometry:
    if sh.ranks % sh.expert_tp:
        raise ShardingError(f"{sh.ranks} ranks do not form groups of expert_tp = {sh.expert_tp}")
    heads = split(d.num_attention_heads, sh.head_ways, "attention heads", "heads")
    local = split(d.experts, sh.expert_groups, "routed experts", "experts")
    width = split(d.moe_intermediate_size, sh.expert_tp, "expert width", "expert_mlp")
    if width % (2 * MX_BLOCK):
        raise ShardingError(f"an expert's width slice of {width} is not a multiple of "
                            f"{2 * MX_BLOCK} (MXFP4 blocks of {MX_BLOCK}, two codes per byte)",
                            "expert_mlp")
    split(d.hidden_size, sh.host_cores, "hidden size (latent_up columns)", "latent_up")
    latent_cols = lane_pad(_ceil_split(d.routed_expert_hidden_size, sh.ranks))   # 112 -> 128, zero padded
    return KimiGeometry(
        heads=heads, kda_cols=projection_cols(d, heads),
        shared=split(d.shared_expert_intermediate_size, sh.ranks, "shared expert width", "mlp"),
        inter=lane_pad(_ceil_split(d.intermediate_size, sh.ranks)),
        latent_cols=latent_cols, latent_gathered=latent_cols * sh.ranks,
        # The reference pads the hidden size to 8192 here (1024 columns per core); an exact
        # 7168 / 8 = 896 is already lane aligned, so mkc does not.
        up_cols=lane_pad(_ceil_split(d.hidden_size, sh.host_cores)),
        router_cols=lane_pad(_ceil_split(d.experts, sh.router_split)),
        expert_width=width, local_experts=local,
        cache_width=lane_pad(d.latent_cache_dim))


def kimi_k3_families(d: KimiDims, sh: KimiSharding,
                     formats: dict[str, WeightFormat] | None = None) -> dict[str, dict[str, Tensor]]:
    """Per-rank weight families of each sublayer kind (kda, mla, moe, dense) and of one routed
    expert ("expert", in the `formats` chosen), in HBM layout. Raises ShardingError for an
    infeasible sharding."""
    g = kimi_k3_geometry(d, sh)
    kinds, _ = layer_kinds(LAYERS, d, _ways(sh))
    return {
        **{kind: {n: t for n, t in k.tensors.items() if t.role == "matrix"} for kind, k in kinds.items()},
        # One routed expert's width slice, K-major, in its format.
        "expert": MOE.expert_tensors(d, expert_formats(d, g, formats), sh.expert_tp),
    }


# The formats a routed expert's matrices take (`format expert.gate_up fp8 [block N]`,
# `mkc.layers.expert_formats`): the checkpoint's MXFP4, decoded in the kernel; or FP8 e4m3
# codes, with an E8M0 scale per 32 input rows (the checkpoint's: always exact) or per `block`
# rows, whole pack groups (exact where a block's 32-row scales span at most 8 octaves, which
# packing checks); or FP4 e2m1 codes (two rows a byte), fed to the MXU as they are, with one
# scale per `block` rows, whole pack groups (exact where the checkpoint's values fit one
# scale per block, which packing checks and otherwise refuses unless the spec says `rounded`).
WEIGHT_FORMATS = MOE.weight_formats()


def _expert_tp(d: KimiDims, g: KimiGeometry) -> int:
    return d.moe_intermediate_size // g.expert_width


def pack_groups(d: KimiDims, g: KimiGeometry) -> dict[str, int]:
    """Input rows a rank's expert matrices are multiplied in at a time (`MoE.pack_groups`)."""
    return MOE.pack_groups(d, _expert_tp(d, g))


def expert_formats(d: KimiDims, g: KimiGeometry, formats: dict[str, WeightFormat] | None
                   ) -> dict[str, WeightFormat]:
    """Each expert matrix class's format with its block resolved to rows (32 for MXFP4 and
    plain FP8); FormatError for a block the kernel cannot use."""
    return MOE.expert_formats(d, formats, _expert_tp(d, g))


def kimi_k3_activations(d: KimiDims, sh: KimiSharding) -> dict[str, tuple[tuple[int, ...], str]]:
    """VMEM activations the K3 kernel keeps across ops, with -1 for the batch dim."""
    g = kimi_k3_geometry(d, sh)
    return {**block_activations(d), "latent": ((-1, g.latent_gathered), "f32")}


def kimi_k3_kinds(d: KimiDims, sh: KimiSharding, formats: dict[str, WeightFormat] | None = None
                  ) -> tuple[dict[str, LayerKind], dict[str, Tensor], dict[str, Tensor],
                             dict[str, int]]:
    """(sublayer kinds, routed expert families, globals, per-rank sizes)."""
    fam = kimi_k3_families(d, sh, formats)
    g = kimi_k3_geometry(d, sh)
    H = d.hidden_size
    vocab = split(d.vocab_size, sh.ranks, "vocab_size", "vocab")
    glob = {
        "embed": Tensor("embed", "table", (vocab, H), "bf16"),
        "final_norm": _v("final_norm", H),
        **mix_vectors(H, "output"),
        "lm_head": _m("lm_head", H, vocab, cls="lm_head"),
    }
    per_rank = g.as_dict() | {"vocab": vocab, "expert_tp": sh.expert_tp,
                              "host_cores": sh.host_cores, "router_split": sh.router_split}
    kinds, composed = layer_kinds(LAYERS, d, _ways(sh))
    if any(per_rank.get(name, size) != size for name, size in composed.items()):
        raise ValueError(f"the library kinds' per-rank sizes {composed} are not K3's geometry's")
    return {kind: _matrices_first(k) for kind, k in kinds.items()}, fam["expert"], glob, per_rank | composed


def _ways(sh: KimiSharding) -> dict[str, int]:
    """The ways K3's shard classes split, as the library's kinds take them."""
    return {"heads": sh.head_ways, "mlp": sh.ranks, "experts": sh.expert_groups, "expert_mlp": sh.expert_tp,
            "router": sh.router_split, "latent_down": sh.ranks, "latent_up": sh.host_cores}


def _matrices_first(kind: LayerKind) -> LayerKind:
    """A composed kind with its matrices before its vectors and states."""
    tensors = kind.tensors
    ordered = {n: t for n, t in tensors.items() if t.role == "matrix"} | tensors
    return dataclasses.replace(kind, tensors=ordered)


def family_bytes(families: dict[str, Tensor]) -> int:
    return sum(t.nbytes for t in families.values())


def hbm_bytes_per_rank(d: KimiDims, sh: KimiSharding,
                       formats: dict[str, WeightFormat] | None = None
                       ) -> dict[str, int]:
    """Weight bytes one rank holds in HBM, by class (states and caches come with a batch)."""
    fam = kimi_k3_families(d, sh, formats)
    kinds = d.layer_kinds
    moe_layers = kinds.count("moe")
    vocab = split(d.vocab_size, sh.ranks, "vocab")
    return {
        "attention": sum(family_bytes(fam[k]) for k in kinds if k in ("kda", "mla")),
        "dense mlp": kinds.count("dense") * family_bytes(fam["dense"]),
        "moe fixed": moe_layers * family_bytes(fam["moe"]),
        "routed experts": moe_layers * (d.experts // sh.expert_groups) * family_bytes(fam["expert"]),
        "embedding and lm_head": 2 * vocab * d.hidden_size * 2,
    }


def build(d: KimiDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict[str, WeightFormat] | None = None) -> FamilyGraph:
    sharding = KimiSharding.from_rules(rules, ranks)
    kinds, experts, glob, per_rank = kimi_k3_kinds(d, sharding, formats)
    resolved = expert_formats(d, kimi_k3_geometry(d, sharding), formats)
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank, experts=experts,
                       activations=kimi_k3_activations(d, sharding), experts_total=d.experts,
                       top_k=d.top_k, formats=resolved)
