"""The Qwen3.5 MoE decode graph: each layer runs as two sublayers of the layer loop, its
attention (Qwen3.5's gated delta net `gdn` or gated attention `gqa`, up to the residual add),
then the sparse MoE (`moe`): router, routed experts and a gated shared expert.

Sharding: attention heads, the shared expert's width (`mlp`) and the vocabulary each over their
rank group, as Qwen3.5 does; routed experts expert-parallel over every core (each core holds whole experts,
`experts / ranks` of them) and fetched into a pool's expert slots as routing picks them. The
router is replicated: every core scores every expert, so all route alike.
"""
from __future__ import annotations

from mkc.families.qwen3_5.graph import attention_kinds, vocab_globals
from mkc.families.qwen3_5_moe.config import Qwen35MoeDims
from mkc.model.graph import FamilyGraph, LayerKind, Op, ShardingError, Tensor, split

SHARD_CLASSES = ("heads", "mlp", "vocab", "experts")


def moe_kind(d: Qwen35MoeDims, ranks: int, mlp: int
             ) -> tuple[LayerKind, dict[str, Tensor], dict[str, int]]:
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
    experts = {
        "gate_up": Tensor("gate_up", "matrix", (H, 2 * inter), "bf16"),
        "down": Tensor("down", "matrix", (inter, H), "bf16"),
    }
    per_rank = {"shared": shared, "local_experts": local, "expert_width": inter, "expert_tp": 1}
    return kind, experts, per_rank


def build(d: Qwen35MoeDims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    if rules["experts"] != (ranks, 1):
        raise ShardingError("the Qwen3.5 MoE lowering splits experts over every core: write "
                            "`shard experts over tp`", "experts")
    kinds, per_rank = attention_kinds(d, rules["heads"][0], rules["mlp"][0], with_mlp=False)
    moe, experts, moe_sizes = moe_kind(d, ranks, rules["mlp"][0])
    kinds["moe"] = moe
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank | moe_sizes,
                       experts=experts, experts_total=d.experts,
                       top_k=d.top_k)
