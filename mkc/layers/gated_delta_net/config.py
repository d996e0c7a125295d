"""Reading the config of a hybrid decoder of gated delta net (`linear_attention`) and gated
attention (`full_attention`) layers, as the upstream Qwen3.5 text config classes give it
(`Qwen3_5TextConfig`, `Qwen3_5MoeTextConfig`): the defaults they share for its keys, the layer
pattern, the partial rotary embedding, and the `GatedDeltaNetDims` fields (`attention_fields`).
A family's reader adds its sizes and its MLPs'."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mkc.layers import config
from mkc.layers.config import setting
from mkc.layers.rope import rope_parameters
from mkc.model.family import ConfigError, config_float, config_int, identifier

LAYER_TYPES = ("linear_attention", "full_attention")

# The upstream config classes' defaults for the hybrid's keys, for keys a config.json omits (as
# HF does); a family's table adds its model sizes.
DEFAULTS: dict[str, Any] = {
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "head_dim": 256,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
}


def full_attention_pattern(raw: Mapping, layers: int) -> list[str]:
    """The layer types upstream derives without `layer_types`: every `full_attention_interval`-th
    layer (4 when the config omits it) full attention, the rest linear."""
    interval = config_int(setting(raw, "full_attention_interval", {"full_attention_interval": 4}),
                          "full_attention_interval")
    if interval < 1:
        raise ConfigError(f"full_attention_interval = {interval} must be at least 1",
                          "every Nth layer is full attention: upstream Qwen3.5 uses 4")
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(layers)]


def layer_types(raw: Mapping, defaults: Mapping[str, Any]) -> list[str]:
    """Upstream layer_types, or the full-attention interval's pattern when the config omits it."""
    n_layers = config_int(setting(raw, "num_hidden_layers", defaults), "num_hidden_layers")
    return config.layer_types(raw, n_layers, LAYER_TYPES, lambda n: full_attention_pattern(raw, n),
                              "upstream Qwen3.5 configs")


def rope(raw: Mapping, head_dim: int) -> tuple[int, float]:
    """(rotary dims, theta): plain RoPE on a partial head, theta given by the config."""
    params = rope_parameters(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type != "default":
        raise ConfigError(f"rope_type = {rope_type!r} is not supported",
                          "Qwen3.5 text uses plain RoPE: \"rope_type\": \"default\"")
    theta = params.get("rope_theta", raw.get("rope_theta"))
    if theta is None:
        raise ConfigError("it has no rope_theta (looked in rope_parameters and at top level)",
                          "give rope_parameters.rope_theta, as upstream configs do (10000000)")
    factor = config_float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)),
                          "partial_rotary_factor")
    rotary_dim = int(head_dim * factor)
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ConfigError(f"the rotary dims ({rotary_dim}: head_dim x partial_rotary_factor) must be "
                          "even and in (0, head_dim]", "Qwen3.5 rotates a quarter of each head: 0.25")
    return rotary_dim, config_float(theta, "rope_theta")


def check_settings(raw: Mapping, defaults: Mapping[str, Any]) -> None:
    """ConfigError for settings neither the lowering nor the reference computes."""
    config.refuse(raw, {
        "hidden_act": ("silu", "Qwen3.5 MLPs are SwiGLU: \"hidden_act\": \"silu\""),
        "attention_bias": (False, "no Qwen3.5 checkpoint has attention biases: write "
                                  "\"attention_bias\": false or leave the key out"),
        "tie_word_embeddings": (False, "the kernel streams its own lm_head.weight: write "
                                       "\"tie_word_embeddings\": false, as Qwen3.5 does")}, defaults)


def attention_fields(raw: Mapping, name: str, defaults: Mapping[str, Any]) -> dict:
    """The `GatedDeltaNetDims` fields of a config but `family` and `layer_kinds`, keys the
    config omits taken from `defaults` (the model's upstream config class)."""
    check_settings(raw, defaults)
    fields = {key: config_int(setting(raw, key, defaults), key) for key in (
        "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "linear_num_key_heads", "linear_num_value_heads",
        "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim")}
    for heads, groups in (("num_attention_heads", "num_key_value_heads"),
                          ("linear_num_value_heads", "linear_num_key_heads")):
        if fields[groups] < 1 or fields[heads] % fields[groups]:
            raise ConfigError(f"{heads} ({fields[heads]}) must be a multiple of {groups} "
                              f"({fields[groups]})", "each head group shares one key head")
    rotary_dim, theta = rope(raw, fields["head_dim"])
    eps = config_float(setting(raw, "rms_norm_eps", defaults), "rms_norm_eps")
    return fields | dict(name=identifier(name), rms_norm_eps=eps, rotary_dim=rotary_dim, rope_theta=theta)
