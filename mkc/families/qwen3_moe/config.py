"""Qwen3-MoE dimensions from an upstream `Qwen3MoeConfig`-style config.json (transformers 5.x,
`models/qwen3_moe/configuration_qwen3_moe.py`; defaults below are that class's)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.config import attention_heads, refuse, setting, with_aliases
from mkc.layers.gqa import ScaledRopeGQADims
from mkc.layers.rope import read_rope
from mkc.model.family import ConfigError, config_float, config_int, identifier

FAMILY_NAME = "qwen3_moe"
DEFAULTS: dict[str, Any] = {
    "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": 24, "num_attention_heads": 32,
    "num_key_value_heads": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
    "attention_bias": False, "use_sliding_window": False, "decoder_sparse_step": 1,
    "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128, "norm_topk_prob": False,
    # `PreTrainedConfig.default_theta`: what rope standardisation gives a config without one
    "rope_theta": 10000.0,
}
# Settings the kernel and the reference do not compute: key -> (the value they compute, hint).
REFUSED = {
    "hidden_act": ("silu", "Qwen3-MoE experts are SwiGLU: \"hidden_act\": \"silu\""),
    "attention_bias": (False, "Qwen3-MoE projections have no biases: \"attention_bias\": false"),
    "tie_word_embeddings": (False, "the kernel streams its own lm_head.weight (Qwen3-30B-A3B and "
                                   "-235B-A22B untie it)"),
    "use_sliding_window": (False, "every Qwen3-MoE layer attends to the whole context: "
                                  "\"use_sliding_window\": false"),
    "decoder_sparse_step": (1, "every layer's MLP is the sparse MoE block: \"decoder_sparse_step\": 1"),
}

# Qwen3MoeConfig's attribute_map: its save_pretrained writes the expert count by this name.
ALIASES = {"num_local_experts": "num_experts"}

@dataclass(frozen=True)
class Qwen3MoeDims(ScaledRopeGQADims):
    """Upstream key names, except `experts` (num_experts) and `top_k` (num_experts_per_tok),
    the names the core reads; `layer_kinds` per sublayer: `gqa`, then `moe`."""

    experts: int
    top_k: int
    moe_intermediate_size: int
    norm_topk_prob: bool


def read_dims(raw: Mapping, name: str) -> Qwen3MoeDims:
    """The one reader of a Qwen3-MoE config; ConfigError for a setting mkc does not compute."""
    raw = with_aliases(raw, ALIASES)
    refuse(raw, REFUSED, DEFAULTS)
    if raw.get("mlp_only_layers"):
        raise ConfigError(f"mlp_only_layers = {raw['mlp_only_layers']!r}: dense MLP layers are not "
                          "supported", "every layer's MLP is the sparse MoE block: write "
                          "\"mlp_only_layers\": [] or leave the key out")
    ints = {key: config_int(setting(raw, key, DEFAULTS), key) for key in (
        "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "num_key_value_heads",
        "moe_intermediate_size", "num_experts", "num_experts_per_tok")}
    heads = attention_heads(raw, ints["hidden_size"], ints.pop("num_attention_heads"),
                            ints.pop("num_key_value_heads"))
    experts, top_k = ints.pop("num_experts"), ints.pop("num_experts_per_tok")
    if not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok = {top_k} must be in 1..num_experts ({experts})",
                          "each token picks some of the experts")
    norm_topk_prob = setting(raw, "norm_topk_prob", DEFAULTS)
    if not isinstance(norm_topk_prob, bool):
        raise ConfigError(f"norm_topk_prob = {norm_topk_prob!r} is not a boolean", "write true or false")
    return Qwen3MoeDims(
        family=FAMILY_NAME, name=identifier(name),
        rms_norm_eps=config_float(setting(raw, "rms_norm_eps", DEFAULTS), "rms_norm_eps"),
        layer_kinds=("gqa", "moe") * ints["num_hidden_layers"], **heads,
        **read_rope(raw, heads["head_dim"], DEFAULTS["rope_theta"], types=("default",)),
        experts=experts, top_k=top_k, norm_topk_prob=norm_topk_prob, **ints)
