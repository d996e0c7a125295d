"""Kimi K3 dimensions from an upstream Kimi Linear-style config.json, and the shapes the
K3 lowering supports."""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from mkc.model.contracts import Dims
from mkc.model.family import ConfigError, identifier


@dataclass(frozen=True)
class KimiDims(Dims):
    """The K3 dimensions mkc needs, read from upstream-style config keys."""

    rms_norm_eps: float
    dense_width: int             # layer 0's MLP (first_k_dense_replace = 1)
    heads: int                   # KDA and MLA heads
    head_dim: int                # KDA head dim and MLA nope / value dim
    conv_taps: int
    gate_lower_bound: float = field(metadata={"any_sign": True})   # a log-space floor
    q_lora: int
    kv_lora: int
    qk_extra: int                # the 64 shared extra key dims (qk_rope_head_dim, NoPE)
    experts: int
    top_k: int
    shared_experts: int
    expert_width: int            # moe_intermediate_size
    latent: int                  # routed_expert_hidden_size
    block: int                   # attention-residual block size
    situ_beta: float
    situ_linear_beta: float
    routed_scaling: float
    layer_kinds: tuple[str, ...]   # one per sublayer: attention kind, then MLP kind

    @staticmethod
    def from_config(raw: dict, name: str = "kimi_k3") -> "KimiDims":
        """The dimensions as upstream keys give them, unchecked (`read_dims` checks)."""
        lin = raw["linear_attn_config"]
        n = int(raw["num_hidden_layers"])
        mla = {int(i) - 1 for i in lin["full_attn_layers"]}     # 1-based upstream
        dense = int(raw.get("first_k_dense_replace", 0))
        kinds: list[str] = []
        for i in range(n):
            kinds += ["mla" if i in mla else "kda", "dense" if i < dense else "moe"]
        return KimiDims(
            family="kimi_k3", name=identifier(name),
            hidden_size=int(raw["hidden_size"]), num_hidden_layers=n,
            vocab_size=int(raw["vocab_size"]), rms_norm_eps=float(raw["rms_norm_eps"]),
            dense_width=int(raw["intermediate_size"]), heads=int(raw["num_attention_heads"]),
            head_dim=int(lin["head_dim"]), conv_taps=int(lin["short_conv_kernel_size"]),
            gate_lower_bound=float(lin["gate_lower_bound"]),
            q_lora=int(raw["q_lora_rank"]), kv_lora=int(raw["kv_lora_rank"]),
            qk_extra=int(raw["qk_rope_head_dim"]), experts=int(raw["num_experts"]),
            top_k=int(raw["num_experts_per_token"]),
            shared_experts=int(raw["num_shared_experts"]),
            expert_width=int(raw["moe_intermediate_size"]),
            latent=int(raw["routed_expert_hidden_size"]),
            block=int(raw["attn_res_block_size"]),
            situ_beta=float(raw["activation_situ_beta"]),
            situ_linear_beta=float(raw["activation_situ_linear_beta"]),
            routed_scaling=float(raw.get("routed_scaling_factor", 1.0)), layer_kinds=tuple(kinds))

    @staticmethod
    def load(path: str | Path) -> "KimiDims":
        return read_dims(json.loads(Path(path).read_text()), Path(path).stem)

    def layer_plan(self) -> list[tuple[str, str]]:
        """(attention kind, MLP kind) per layer."""
        k = self.layer_kinds
        return [(k[2 * i], k[2 * i + 1]) for i in range(self.num_hidden_layers)]


def read_dims(raw: dict, name: str) -> KimiDims:
    """The dimensions; ConfigError for a shape the K3 lowering does not take, KeyError /
    ValueError / TypeError for a malformed config."""
    dims = KimiDims.from_config(raw, name)
    if dims.num_hidden_layers < 2 or dims.layer_kinds[1] != "dense" or "dense" in dims.layer_kinds[2:]:
        raise ConfigError("mkc lowers K3 with exactly one dense layer (first_k_dense_replace = 1) "
                          "before the MoE layers", "set first_k_dense_replace to 1")
    listed = raw["linear_attn_config"]["full_attn_layers"]
    if not all(type(i) is int and 1 <= i <= dims.num_hidden_layers for i in listed):
        raise ConfigError(f"full_attn_layers must list 1-based layer numbers from 1 to "
                          f"{dims.num_hidden_layers}", "as upstream Kimi configs do, e.g. [4, 8, ...]")
    missing = [k for k in ("kda", "mla") if k not in dims.layer_kinds]
    if missing:
        raise ConfigError(f"it has no {missing[0]} layer; the K3 lowering runs both KDA and MLA "
                          "layers", "list some but not all layers in linear_attn_config.full_attn_layers")
    return dims
