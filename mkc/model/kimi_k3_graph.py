"""Kimi K3 per-rank tensor families under a tensor x expert parallel sharding.

First step of the K3 model graph (issue 3): the weights, vectors and states each layer kind
reads, with per-rank shapes and dtypes, and the feasibility rules a topology must meet. The
layout follows the hand-written reference kernel (`docs/k3-reference-notes.md`, section 1):
attention heads, shared experts, the dense MLP, `latent_down` and the vocabulary split over
every rank; routed experts split EP x TP; `latent_up` split within a host and replicated across
hosts; the router's columns split between the two cores of a chip. Not yet wired into resolve.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from mkc.model.graph import ShardingError, Tensor, lane_pad


@dataclass(frozen=True)
class KimiDims:
    """The K3 dimensions mkc needs, read from upstream-style config keys."""

    hidden: int
    layers: int
    vocab: int
    dense_width: int             # layer 0's MLP (first_k_dense_replace = 1)
    heads: int                   # KDA and MLA heads
    head_dim: int                # KDA head dim and MLA nope / value dim
    conv_taps: int
    q_lora: int
    kv_lora: int
    qk_extra: int                # the 64 shared extra key dims (qk_rope_head_dim, NoPE)
    experts: int
    top_k: int
    shared_experts: int
    expert_width: int            # moe_intermediate_size
    latent: int                  # routed_expert_hidden_size
    block: int                   # attention-residual block size

    @staticmethod
    def from_config(raw: dict) -> "KimiDims":
        lin = raw["linear_attn_config"]
        return KimiDims(
            hidden=raw["hidden_size"], layers=raw["num_hidden_layers"], vocab=raw["vocab_size"],
            dense_width=raw["intermediate_size"], heads=raw["num_attention_heads"],
            head_dim=lin["head_dim"], conv_taps=lin["short_conv_kernel_size"],
            q_lora=raw["q_lora_rank"], kv_lora=raw["kv_lora_rank"],
            qk_extra=raw["qk_rope_head_dim"], experts=raw["num_experts"],
            top_k=raw["num_experts_per_token"], shared_experts=raw["num_shared_experts"],
            expert_width=raw["moe_intermediate_size"], latent=raw["routed_expert_hidden_size"],
            block=raw["attn_res_block_size"])

    @staticmethod
    def load(path: str | Path) -> "KimiDims":
        return KimiDims.from_config(json.loads(Path(path).read_text()))

    def layer_kinds(self) -> list[tuple[str, str]]:
        """(attention kind, MLP kind) per layer: MLA where i % 4 == 3 or the last layer."""
        return [("mla" if i % 4 == 3 or i == self.layers - 1 else "kda",
                 "dense" if i == 0 else "moe") for i in range(self.layers)]


@dataclass(frozen=True)
class KimiSharding:
    ranks: int = 32
    expert_tp: int = 4           # ranks sharing one expert's width (TP4); EP = ranks / this
    host_cores: int = 8          # latent_up is split over a host's cores
    router_split: int = 2        # sibling cores each score half the experts

    @property
    def expert_groups(self) -> int:
        return self.ranks // self.expert_tp


def _split(total: int, ways: int, what: str) -> int:
    if ways <= 0 or total % ways:
        raise ShardingError(f"{what} = {total} does not divide over {ways} ranks")
    return total // ways


def _ceil_split(total: int, ways: int) -> int:
    """A split that pads the last shards with zeros (the reference does this for the latent)."""
    return -(-total // ways)


def _m(name: str, rows: int, cols: int, dtype: str = "bf16", partial: bool = False) -> Tensor:
    return Tensor(name, "matrix", (rows, cols), dtype, partial_out=partial)


def kimi_k3_families(d: KimiDims, sh: KimiSharding) -> dict[str, dict[str, Tensor]]:
    """Per-rank weight families of each layer kind (kda, mla, moe, dense) and of one routed
    expert ("expert"), in HBM layout. Raises ShardingError for an infeasible sharding."""
    if sh.ranks % sh.expert_tp:
        raise ShardingError(f"{sh.ranks} ranks do not form groups of expert_tp = {sh.expert_tp}")
    H, hd = d.hidden, d.head_dim
    heads = _split(d.heads, sh.ranks, "attention heads")
    _split(d.experts, sh.expert_groups, "routed experts")
    width = _split(d.expert_width, sh.expert_tp, "expert width")
    shared = _split(d.shared_experts * d.expert_width, sh.ranks, "shared expert width")
    dense = -(-_ceil_split(d.dense_width, sh.ranks) // 128) * 128
    latent_cols = lane_pad(_ceil_split(d.latent, sh.ranks))      # 112 -> 128, zero padded
    # The reference pads the hidden size to 8192 here (1024 columns per core); an exact
    # 7168 / 8 = 896 is already lane aligned, so mkc does not.
    up_cols = lane_pad(_ceil_split(H, sh.host_cores))
    router_cols = lane_pad(_ceil_split(d.experts, sh.router_split))
    kda_cols = 3 * heads * hd + heads * hd + lane_pad(heads)    # q, k, v | g | b
    return {
        "kda": {
            "projection": _m("projection", H, kda_cols),
            "gate_down": _m("gate_down", H, 128),                  # low-rank decay gate, full
            "gate_up": _m("gate_up", 128, heads * hd),
            "o_proj": _m("o_proj", heads * hd, H, partial=True),
        },
        "mla": {
            "q_down": _m("q_down", H, d.q_lora),                   # replicated
            "kv_down": _m("kv_down", H, lane_pad(d.kv_lora + d.qk_extra)),   # replicated
            "q_up": _m("q_up", d.q_lora, heads * lane_pad(hd + d.qk_extra)),
            "kv_up": _m("kv_up", d.kv_lora, heads * 2 * hd),
            "gate": _m("gate", H, heads * hd),
            "o_proj": _m("o_proj", heads * hd, H, partial=True),
        },
        "moe": {
            "router": _m("router", H, router_cols),
            "latent_down": _m("latent_down", H, latent_cols),
            "latent_up": _m("latent_up", d.latent, up_cols),
            "shared_gate_up": _m("shared_gate_up", H, 2 * shared),
            "shared_down": _m("shared_down", shared, H, partial=True),
        },
        "dense": {
            "gate_up": _m("gate_up", H, 2 * dense),
            "down": _m("down", dense, H, partial=True),
        },
        # One routed expert's TP slice: gate/up re-blocked to FP8 with a bf16 scale per 256
        # rows (as the reference loads them), down as MXFP4 codes and E8M0 scales.
        "expert": {
            "gate_up": _m("gate_up", d.latent, 2 * width, "fp8"),
            "gate_up_scale": _m("gate_up_scale", d.latent // 256, 2 * width),
            "down": _m("down", width, d.latent // 2, "u8"),
            "down_scale": _m("down_scale", width // 32, d.latent, "u8"),
        },
    }


def family_bytes(families: dict[str, Tensor]) -> int:
    return sum(t.nbytes for t in families.values())


def hbm_bytes_per_rank(d: KimiDims, sh: KimiSharding) -> dict[str, int]:
    """Weight bytes one rank holds in HBM, by class (states and caches come with a batch)."""
    fam = kimi_k3_families(d, sh)
    kinds = d.layer_kinds()
    attention = sum(family_bytes(fam[a]) for a, _ in kinds)
    moe_layers = sum(1 for _, m in kinds if m == "moe")
    experts_per_group = d.experts // sh.expert_groups
    vocab = _split(d.vocab, sh.ranks, "vocab")
    return {
        "attention": attention,
        "dense mlp": sum(family_bytes(fam["dense"]) for _, m in kinds if m == "dense"),
        "moe fixed": moe_layers * family_bytes(fam["moe"]),
        "routed experts": moe_layers * experts_per_group * family_bytes(fam["expert"]),
        "embedding and lm_head": 2 * vocab * d.hidden * 2,
    }
