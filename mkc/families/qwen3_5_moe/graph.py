"""The Qwen3.5 MoE decode graph: each layer runs as two sublayers of the layer loop, its
attention (Qwen3.5's gated delta net `gdn` or gated attention `gqa`, up to the residual add),
then the sparse MoE (`moe`): router, routed experts and a gated shared expert.

Sharding: attention heads, the shared expert's width (`mlp`) and the vocabulary each over their
rank group, as Qwen3.5 does; routed experts expert-parallel over every core (each core holds whole experts,
`experts / ranks` of them) and fetched into a pool's expert slots as routing picks them. The
router is replicated: every core scores every expert, so all route alike.

Routed experts are stored as the spec's `format expert.gate_up|expert.down` says: bf16, the
checkpoint's, or FP8 e4m3 codes under one E8M0 scale per block of whole pack groups
(`fp8 block N rounded`), Kimi K3's layout (`mkc.families.kimi_k3.graph.expert_codes`), whose
codes the kernel feeds to the MXU as they are, one mixed bf16 x fp8 dot a pack group, the
block's scale multiplying the group's partial product (K3's `_expert_matmul`). FP8 halves an
expert's bytes; requantizing bf16 to it rounds (3 mantissa bits, not 7), so the spec must say
`rounded`, and packing reports the error (`weights.requantization`).
"""
from __future__ import annotations

import dataclasses

from mkc.families.kimi_k3.graph import check_block, expert_codes, expert_pack_groups
from mkc.families.qwen3_5.graph import DELTA_NET, GATED_ATTENTION
from mkc.families.qwen3_5_moe.config import Qwen35MoeDims
from mkc.ir import WeightFormat
from mkc.layers.decoder import vocab_globals
from mkc.layers.sublayer import layer_kinds
from mkc.model.family import FormatError
from mkc.model.graph import FamilyGraph, LayerKind, Op, ShardingError, Tensor, split

SHARD_CLASSES = ("heads", "mlp", "vocab", "experts")
# A routed expert's matrix classes and the formats they take (`format CLASS NAME block N
# rounded`), the checkpoint's first.
WEIGHT_FORMATS = (("expert.gate_up", ("bf16", "fp8")), ("expert.down", ("bf16", "fp8")))
# Formats whose packing rounds the checkpoint's values (`Family.rounding_formats`).
ROUNDING_FORMATS = ("fp8",)
# Qwen3.5's attention kinds, each up to its residual add; the `moe` sublayer is the family's own.
LAYERS = {"gdn": (DELTA_NET,), "gqa": (GATED_ATTENTION,)}


def expert_rows(d: Qwen35MoeDims) -> dict[str, int]:
    """Input rows of each routed expert matrix (whole experts on every rank)."""
    return {"gate_up": d.hidden_size, "down": d.moe_intermediate_size}


def pack_groups(d: Qwen35MoeDims) -> dict[str, int]:
    """Input rows an FP8 expert matrix is multiplied in at a time: Kimi K3's pack groups (512
    rows of gate|up, 128 of down, or the whole matrix when smaller)."""
    rows = expert_rows(d)
    return expert_pack_groups(rows["gate_up"], rows["down"])


def expert_formats(d: Qwen35MoeDims, formats: dict[str, WeightFormat] | None = None
                   ) -> dict[str, WeightFormat]:
    """Each routed expert class's format, an FP8 block resolved to input rows (past the matrix's
    rows: the whole matrix). FormatError for FP8 without a block or without `rounded`, or a
    block that is not whole pack groups tiling the rows."""
    rows, groups = expert_rows(d), pack_groups(d)
    out = {}
    for cls, fmt in ({c: WeightFormat(f[0]) for c, f in WEIGHT_FORMATS} | (formats or {})).items():
        name = cls.split(".")[1]
        if fmt.name == "fp8":
            example = f"`format {cls} fp8 block {groups[name]} rounded`"
            if not fmt.block:
                raise FormatError(cls, "FP8 experts take one scale per block of whole pack groups "
                                  "(their codes reach the MXU as they are, the scale multiplying a "
                                  "pack group's partial product)", f"write {example} (a multiple "
                                  f"of {groups[name]} rows dividing {rows[name]})")
            block = min(fmt.block, rows[name])
            check_block(cls, block, rows[name], groups[name])
            if not fmt.rounded:
                raise FormatError(cls, f"the checkpoint's {cls} is bf16 (8 significant bits), "
                                  "and e4m3 keeps 4: requantizing it to FP8 rounds almost every "
                                  "value, so the spec must accept the rounding", f"write `format "
                                  f"{cls} fp8 block {block} rounded` (the error is reported per "
                                  "matrix class), or keep it bf16 (drop the `format` line)")
            fmt = dataclasses.replace(fmt, block=block)
        out[cls] = fmt
    return out


def expert_families(d: Qwen35MoeDims, formats: dict[str, WeightFormat]) -> dict[str, Tensor]:
    """One routed expert as its slot holds it, K-major ([in, out]): each matrix bf16 by its
    name, or FP8 codes and block scales (`expert_codes`)."""
    H, inter = d.hidden_size, d.moe_intermediate_size
    out: dict[str, Tensor] = {}
    for name, rows, cols in (("gate_up", H, 2 * inter), ("down", inter, H)):
        fmt = formats[f"expert.{name}"]
        out |= (expert_codes(name, rows, cols, fmt) if fmt.name == "fp8"
                else {name: Tensor(name, "matrix", (rows, cols), "bf16")})
    return out


def moe_kind(d: Qwen35MoeDims, ranks: int, mlp: int
             ) -> tuple[LayerKind, dict[str, int]]:
    """The moe sublayer: the shared expert split `mlp` ways, routed experts over `ranks`."""
    H, E, inter = d.hidden_size, d.experts, d.moe_intermediate_size
    shared = split(d.shared_expert_intermediate_size, mlp, "shared_expert_intermediate_size", "mlp")
    local = split(E, ranks, "num_experts", "experts")
    kind = LayerKind("moe", ops=(
        Op("post_norm", reads=("x", "post_norm"), writes=("h",)),
        Op("router", reads=("h",), writes=("router_logits",), matmul="router"),
        Op("route", reads=("router_logits",), writes=("expert_ids", "expert_weights"),
           picks_experts=True),
        Op("shared_gate_up", reads=("h",), writes=("shared_act",), matmul="shared_gate_up"),
        Op("shared_down", reads=("shared_act",), writes=("shared_out",), matmul="shared_down"),
        Op("routed_experts", reads=("h", "expert_ids", "expert_weights"), writes=("routed_out",),
           partial=("experts",), width=H, runs_experts=True),
        Op("mlp_residual", reads=("shared_out", "routed_out", "h", "shared_gate", "x"), writes=("x",)),
    ), tensors={
        "post_norm": Tensor("post_norm", "vector", (H,), "f32"),
        "shared_gate": Tensor("shared_gate", "vector", (H,), "f32"),   # shared_expert_gate [1, H]
        "router": Tensor("router", "matrix", (H, E), "bf16"),
        "shared_gate_up": Tensor("shared_gate_up", "matrix", (H, 2 * shared), "bf16"),
        "shared_down": Tensor("shared_down", "matrix", (shared, H), "bf16", partial_out=("mlp",)),
    })
    per_rank = {"shared": shared, "local_experts": local, "expert_width": inter, "expert_tp": 1}
    return kind, per_rank


def build(d: Qwen35MoeDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    if rules["experts"] != (ranks, 1):
        raise ShardingError("the Qwen3.5 MoE lowering splits experts over every core: write "
                            "`shard experts over tp`", "experts")
    kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0]})
    moe, moe_sizes = moe_kind(d, ranks, rules["mlp"][0])
    kinds["moe"] = moe
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    resolved = expert_formats(d, formats)
    groups = pack_groups(d)
    moe_sizes |= {"gate_up_group": groups["gate_up"], "down_group": groups["down"]}
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank | moe_sizes,
                       experts=expert_families(d, resolved), experts_total=d.experts,
                       top_k=d.top_k, formats=resolved)
