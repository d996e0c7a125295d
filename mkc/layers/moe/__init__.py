"""A sparse mixture-of-experts MLP (`MoE`): pre-norm; a bias-free router `[H, E]`, softmax
over all E experts in f32, the top `top_k` picked, their probabilities divided by their sum
when the model's `norm_topk_prob` says so; each picked expert a SwiGLU of width
`moe_intermediate_size` (`[gate | up]` in one matmul, then down), weighted by its probability;
optionally a shared SwiGLU expert of width `shared_expert_intermediate_size` gated by
`sigmoid(h . shared_expert_gate)`; the residual add.

Variants are options of the one kind: Qwen3.5-MoE's block is `MoE(norm="zero_centred",
shared_expert=True)` (its config reader fixes `norm_topk_prob` true), Qwen3-MoE's `MoE()`.
The dims a model gives it: hidden_size, rms_norm_eps, experts, top_k, moe_intermediate_size,
norm_topk_prob and, with a shared expert, shared_expert_intermediate_size.

Sharding: routed experts expert-parallel over every core (each core holds whole experts,
`experts / ranks` of them, fetched into a pool's expert slots as routing picks them; shard
class `experts`), the shared expert's width over `mlp`. The router is replicated: every core
scores every expert, so all route alike.

Routed experts are stored as the spec's `format expert.gate_up|expert.down` says: bf16, the
checkpoint's, or FP8 e4m3 codes under one E8M0 scale per block of whole pack groups
(`fp8 block N rounded`), fed to the MXU as they are, one mixed bf16 x fp8 dot a pack group,
the block's scale multiplying the group's partial product. FP8 halves an expert's bytes;
requantizing bf16 to it rounds (3 mantissa bits, not 7), so the spec must say `rounded`.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.ir import WeightFormat
from mkc.layers import expert_formats as expert_formats_lib
from mkc.layers.sublayer import Part, Sublayer
from mkc.model.family import ExpertLayout
from mkc.model.graph import Op, ShardingError, Tensor, split

# A routed expert's matrix classes and the formats they take (`format CLASS NAME block N
# rounded`), the checkpoint's first; the formats whose packing rounds the checkpoint's values.
WEIGHT_FORMATS = (("expert.gate_up", ("bf16", "fp8")), ("expert.down", ("bf16", "fp8")))
ROUNDING_FORMATS = ("fp8",)
# Routed experts load fused, as transformers 5 declares them (`mlp.experts.gate_up_proj [E, 2I,
# H]`, gate rows first; `mlp.experts.down_proj [E, H, I]`), or per expert, the Qwen2/3-MoE
# checkpoints' layout that transformers' `qwen2_moe` conversion mapping fuses on load
# (`MergeModulelist(dim=0)`, then `Concatenate(dim=1)` of gate and up) and writes back on save.
EXPERT_LAYOUTS = (
    ExpertLayout("mlp.experts.gate_up_proj",
                 ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ExpertLayout("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
)


@dataclass(frozen=True)
class MoE(Sublayer):
    package = "mkc.layers.moe"

    norm: str = "plain"            # the post-attention norm's weight: plain `w` or `1 + w`
    shared_expert: bool = False    # a SwiGLU expert every row runs, times a sigmoid gate
    prefix: str = "mlp."

    def op_names(self) -> tuple[str, ...]:
        shared = ("shared_gate_up", "shared_down") if self.shared_expert else ()
        return ("post_norm", "router", "route", *shared, "routed_experts", "mlp_residual")

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        H, E = d.hidden_size, d.experts
        local = split(E, ways["experts"], "num_experts", "experts")
        shared_ops: tuple[Op, ...] = ()
        shared_tensors: dict[str, Tensor] = {}
        per_rank = {"local_experts": local, "expert_width": d.moe_intermediate_size, "expert_tp": 1}
        if self.shared_expert:
            shared = split(d.shared_expert_intermediate_size, ways["mlp"], "shared_expert_intermediate_size",
                           "mlp")
            shared_ops = (
                Op("shared_gate_up", reads=("h",), writes=("shared_act",), matmul="shared_gate_up"),
                Op("shared_down", reads=("shared_act",), writes=("shared_out",), matmul="shared_down"),
            )
            shared_tensors = {
                "shared_gate_up": Tensor("shared_gate_up", "matrix", (H, 2 * shared), "bf16"),
                "shared_down": Tensor("shared_down", "matrix", (shared, H), "bf16", partial_out=("mlp",)),
            }
            per_rank = {"shared": shared} | per_rank
        residual_reads = ("shared_out", "routed_out", "h", "shared_gate", "x") if self.shared_expert \
            else ("routed_out", "x")
        ops = (
            Op("post_norm", reads=("x", "post_norm"), writes=("h",)),
            Op("router", reads=("h",), writes=("router_logits",), matmul="router"),
            Op("route", reads=("router_logits",), writes=("expert_ids", "expert_weights"),
               picks_experts=True),
            *shared_ops,
            Op("routed_experts", reads=("h", "expert_ids", "expert_weights"), writes=("routed_out",),
               partial=("experts",), width=H, runs_experts=True),
            Op("mlp_residual", reads=residual_reads, writes=("x",)),
        )
        tensors = {
            "post_norm": Tensor("post_norm", "vector", (H,), "f32"),
            # shared_expert_gate [1, H]
            **({"shared_gate": Tensor("shared_gate", "vector", (H,), "f32")} if self.shared_expert else {}),
            "router": Tensor("router", "matrix", (H, E), "bf16"),
            **shared_tensors,
        }
        groups = pack_groups(d)
        per_rank |= {"gate_up_group": groups["gate_up"], "down_group": groups["down"]}
        return Part(ops, tensors, per_rank)


def expert_ways(rules: Mapping[str, tuple[int, int]], ranks: int, family: str) -> int:
    """The ways routed experts split: every core, the one sharding the lowering computes;
    ShardingError otherwise."""
    if tuple(rules["experts"]) != (ranks, 1):
        raise ShardingError(f"the {family} lowering splits experts over every core: write "
                            "`shard experts over tp`", "experts")
    return ranks


def expert_rows(d: Any) -> dict[str, int]:
    """Input rows of each routed expert matrix (whole experts on every rank)."""
    return {"gate_up": d.hidden_size, "down": d.moe_intermediate_size}


def pack_groups(d: Any) -> dict[str, int]:
    return expert_formats_lib.pack_groups(expert_rows(d))


def expert_formats(d: Any, formats: Mapping[str, WeightFormat] | None = None) -> dict[str, WeightFormat]:
    """Each routed expert class's format, an FP8 block resolved to input rows
    (`mkc.layers.expert_formats.resolve`: whole pack groups tiling the rows, `rounded`)."""
    return expert_formats_lib.resolve(WEIGHT_FORMATS, expert_rows(d), pack_groups(d), formats)


def expert_tensors(d: Any, formats: Mapping[str, WeightFormat]) -> dict[str, Tensor]:
    """One routed expert as its slot holds it, K-major ([in, out]), each matrix in its format."""
    H, inter = d.hidden_size, d.moe_intermediate_size
    return {**expert_formats_lib.tensors("gate_up", H, 2 * inter, formats["expert.gate_up"]),
            **expert_formats_lib.tensors("down", inter, H, formats["expert.down"])}


def graph_fields(d: Any, formats: Mapping[str, WeightFormat] | None) -> dict[str, Any]:
    """The `FamilyGraph` fields of a family with this kind: one routed expert's tensors, the
    model's experts and picks, the expert classes' resolved formats."""
    resolved = expert_formats(d, formats)
    return dict(experts=expert_tensors(d, resolved), experts_total=d.experts, top_k=d.top_k,
                formats=resolved)
