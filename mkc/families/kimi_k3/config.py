"""Kimi K3 dimensions from an upstream Kimi Linear-style config.json, and the shapes the
K3 lowering supports: the one config reader, which the compiler and the reference share."""
from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mkc.layers.config import setting, with_aliases
from mkc.model.contracts import Dims
from mkc.layers.kda import read_linear_attn_config
from mkc.model.family import ConfigError, config_float, config_int, identifier

BLOCK_SIZE = 32       # MXFP4 values per E8M0 scale (mkc.model.mxfp4's, which imports jax)

# Checkpoint layout. The released checkpoint is a composite: the text tower under
# `language_model.model.` and `language_model.lm_head.` (the reference loader, Inferact/
# tpu-megakernels kimi/load.py: PREFIX and the lm_head key); the family's table names the
# text-only ones. The composite's other parts are skipped: `vision_tower.` and `mm_projector.`
# are Kimi-K2.5's (KimiK25ForConditionalGeneration), assumed for K3, not seen in its files.
RENAMED_PREFIXES = (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."))
SKIPPED_PREFIXES = ("vision_tower.", "mm_projector.")
# Upstream KimiLinearConfig defaults, for keys a config.json omits (as HF does).
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu", "mla_use_nope": False, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "moe_layer_freq": 1, "num_expert_group": 1,
    "tie_word_embeddings": False, "routed_scaling_factor": 1.0, "first_k_dense_replace": 0,
}
# Settings mkc computes only one value of (the K3 values, in the lowering and the reference):
# anything else is refused rather than silently computed as K3.
REQUIRED: dict[str, Any] = {
    "hidden_act": "situ",
    "mla_use_nope": True,
    "mla_use_output_gate": True,
    "latent_moe_use_norm": True,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "moe_layer_freq": 1,
    "num_expert_group": 1,
    "tie_word_embeddings": False,
}

# KimiLinearConfig's attribute_map: the names transformers also reads these settings by.
ALIASES = {"num_local_experts": "num_experts", "num_experts_per_tok": "num_experts_per_token",
           "n_shared_experts": "num_shared_experts", "norm_topk_prob": "moe_renormalize",
           "n_group": "num_expert_group"}

@dataclass(frozen=True)
class KimiDims(Dims):
    """The K3 dimensions mkc needs, by their upstream config names (`linear_attn_config`'s
    `num_heads`, `head_dim` and `short_conv_kernel_size` as the KDA kind's `kda_num_heads`,
    `kda_head_dim` and `conv_kernel_size`), except `experts` (num_experts) and `top_k`
    (num_experts_per_token), the names the core reads. One head count and one head width
    serve KDA and MLA (`check_shapes`)."""

    rms_norm_eps: float
    intermediate_size: int       # layer 0's MLP (first_k_dense_replace = 1)
    num_attention_heads: int
    kda_num_heads: int
    kda_head_dim: int
    qk_nope_head_dim: int
    v_head_dim: int
    conv_kernel_size: int
    gate_lower_bound: float = field(metadata={"any_sign": True})   # a log-space floor
    q_lora_rank: int
    kv_lora_rank: int
    qk_rope_head_dim: int        # the 64 shared extra key dims (NoPE: no rotary embedding)
    experts: int
    top_k: int
    num_shared_experts: int
    moe_intermediate_size: int
    routed_expert_hidden_size: int   # the latent width
    norm_topk_prob: bool         # moe_renormalize (REQUIRED true)
    attn_res_block_size: int
    activation_situ_beta: float
    activation_situ_linear_beta: float
    routed_scaling_factor: float
    layer_kinds: tuple[str, ...]   # one per sublayer: attention kind, then MLP kind

    @staticmethod
    def load(path: str | Path) -> "KimiDims":
        from mkc.model.config import MAX_CONFIG_BYTES, read_json   # (it imports the registry)
        return read_dims(read_json(Path(path), MAX_CONFIG_BYTES), Path(path).stem)

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Upstream's attention per layer: "linear_attention" (KDA) or "full_attention" (MLA)."""
        return tuple("linear_attention" if a == "kda" else "full_attention" for a in self.layer_kinds[::2])

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared experts' width (one MLP of num_shared_experts experts')."""
        return self.num_shared_experts * self.moe_intermediate_size

    def is_moe(self, layer: int) -> bool:
        return self.layer_kinds[2 * layer + 1] == "moe"


def read_dims(raw: Mapping, name: str) -> KimiDims:
    """The dimensions; ConfigError for a setting or shape mkc does not compute (the reference
    builds its config from these dims, so it refuses the same), KeyError / ValueError /
    TypeError for a malformed config."""
    raw = with_aliases(raw, ALIASES)
    check_settings(raw)
    n = config_int(raw["num_hidden_layers"], "num_hidden_layers")
    attention, kda = read_linear_attn_config(raw, n)
    kinds = [kind for pair in zip(attention, mlp_kinds(raw, n)) for kind in pair]
    ints = {key: config_int(raw[key], key) for key in (
        "hidden_size", "vocab_size", "intermediate_size", "num_attention_heads", "q_lora_rank",
        "kv_lora_rank", "qk_rope_head_dim", "num_shared_experts", "moe_intermediate_size",
        "routed_expert_hidden_size", "attn_res_block_size")}
    floats = {key: config_float(raw[key], key) for key in (
        "rms_norm_eps", "activation_situ_beta", "activation_situ_linear_beta")}
    dims = KimiDims(
        family="kimi_k3", name=identifier(name), num_hidden_layers=n, **ints, **floats, **kda,
        qk_nope_head_dim=raw.get("qk_nope_head_dim", kda["kda_head_dim"]),
        v_head_dim=raw.get("v_head_dim", kda["kda_head_dim"]),
        experts=config_int(raw["num_experts"], "num_experts"),
        top_k=config_int(raw["num_experts_per_token"], "num_experts_per_token"),
        norm_topk_prob=setting(raw, "moe_renormalize", UPSTREAM_DEFAULTS),
        routed_scaling_factor=config_float(setting(raw, "routed_scaling_factor", UPSTREAM_DEFAULTS),
                                           "routed_scaling_factor"),
        layer_kinds=tuple(kinds))
    check_shapes(dims)
    return dims


def check_settings(raw: Mapping) -> None:
    for key, want in REQUIRED.items():
        got = setting(raw, key, UPSTREAM_DEFAULTS) if key in UPSTREAM_DEFAULTS else raw.get(key)
        if type(got) is not type(want) or got != want:     # `true` is not 1, nor 0 false
            raise ConfigError(f"unsupported Kimi K3 setting {key} = {got!r} (mkc implements {want!r})",
                              f"write \"{key}\": {json.dumps(want)}, as K3 does")


def mlp_kinds(raw: Mapping, n: int) -> list[str]:
    """Per layer "dense" or "moe": exactly one dense layer, the first (first_k_dense_replace)."""
    dense = setting(raw, "first_k_dense_replace", UPSTREAM_DEFAULTS)
    if n < 2 or config_int(dense, "first_k_dense_replace") != 1:
        raise ConfigError("mkc lowers K3 with exactly one dense layer (first_k_dense_replace = 1) "
                          "before the MoE layers", "set first_k_dense_replace to 1")
    return ["dense"] + ["moe"] * (n - 1)


def check_shapes(d: KimiDims) -> None:
    """ConfigError for shapes the K3 lowering does not take: one head count and one head width
    for KDA and MLA, MXFP4-blockable expert widths."""
    same = {"linear_attn_config.num_heads": (d.kda_num_heads, d.num_attention_heads),
            "qk_nope_head_dim": (d.qk_nope_head_dim, d.kda_head_dim),
            "v_head_dim": (d.v_head_dim, d.kda_head_dim)}
    for key, (value, want) in same.items():
        if value != want:
            raise ConfigError(f"{key} = {value!r} differs from {want}: mkc lowers K3 with one head "
                              "count (num_attention_heads) and one head width (linear_attn_config."
                              "head_dim) for KDA and MLA", f"set {key} to {want}, as K3 does")
    if d.routed_expert_hidden_size % BLOCK_SIZE or d.moe_intermediate_size % BLOCK_SIZE:
        raise ConfigError(f"MXFP4 experts need latent and expert widths that are multiples of "
                          f"{BLOCK_SIZE}", "routed_expert_hidden_size and moe_intermediate_size")
    if d.conv_kernel_size < 2:
        raise ConfigError("short_conv_kernel_size must be at least 2", "K3 uses 4")
