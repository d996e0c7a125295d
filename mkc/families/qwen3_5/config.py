"""Qwen3.5 text dimensions from an upstream `Qwen3_5TextConfig`-style config.json."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.gqa import GQADims
from mkc.model.family import ConfigError, config_float, config_int, identifier

# Upstream layer_types values -> mkc layer kinds (the phase names a schedule uses).
LAYER_KINDS = {"linear_attention": "gdn", "full_attention": "gqa"}

# Upstream Qwen3_5TextConfig defaults, for keys a config.json omits (as HF does): the one table
# the compiler and the reference read (through `read_dims`).
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
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


@dataclass(frozen=True)
class AttentionDims(GQADims):
    """What every Qwen3.5-style model has: the decoder and its gated attention (GQADims) and
    gated delta net layers. Names follow the upstream config keys."""

    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def linear_conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)


@dataclass(frozen=True)
class Qwen35Dims(AttentionDims):
    """Dimensions of one Qwen3.5 text model: the attention dims and a dense SwiGLU MLP."""

    intermediate_size: int


def setting(raw: Mapping, key: str, defaults: Mapping[str, Any]) -> Any:
    """A config value, or the upstream default for a key the config omits or sets to null (as
    HF does); KeyError for a key with no default."""
    value = raw.get(key)
    return defaults[key] if value is None else value


def layer_types(raw: Mapping, defaults: Mapping[str, Any] = UPSTREAM_DEFAULTS) -> list[str]:
    """Upstream layer_types, or the full-attention interval's pattern when the config omits it."""
    n_layers = config_int(setting(raw, "num_hidden_layers", defaults), "num_hidden_layers")
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])
    else:
        interval = config_int(setting(raw, "full_attention_interval", {"full_attention_interval": 4}),
                              "full_attention_interval")
        if interval < 1:
            raise ConfigError(f"full_attention_interval = {interval} must be at least 1",
                              "every Nth layer is full attention: upstream Qwen3.5 uses 4")
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(n_layers)]
    bad = sorted({str(t) for t in types if t not in LAYER_KINDS})
    if len(types) != n_layers or bad:
        what = (f"layer_types has {len(types)} entries but num_hidden_layers is {n_layers}"
                if len(types) != n_layers else f"unsupported layer_types {bad}")
        raise ConfigError(what, f"list one of {sorted(LAYER_KINDS)} per layer, as upstream Qwen3.5 "
                                "configs do")
    return types


def rope(raw: Mapping, head_dim: int) -> tuple[int, float]:
    """(rotary dims, theta): plain RoPE on a partial head, theta given by the config."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_parameters must be an object, not {params!r}")
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
    if setting(raw, "hidden_act", defaults) != "silu":
        raise ConfigError(f"hidden_act = {raw['hidden_act']!r} is not supported",
                          "Qwen3.5 MLPs are SwiGLU: \"hidden_act\": \"silu\"")
    if setting(raw, "attention_bias", defaults):
        raise ConfigError("attention_bias = true is not supported (no Qwen3.5 checkpoint uses it)",
                          "write \"attention_bias\": false or leave the key out")
    if setting(raw, "tie_word_embeddings", defaults):
        raise ConfigError("tie_word_embeddings = true is not supported: the kernel streams its own "
                          "lm_head.weight", "write \"tie_word_embeddings\": false, as Qwen3.5 does")


def attention_fields(raw: Mapping, name: str, defaults: Mapping[str, Any]) -> dict:
    """The AttentionDims fields of a config but `family` and `layer_kinds`, keys the config
    omits taken from `defaults` (the model's upstream config class)."""
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


def read_dims(raw: Mapping, name: str) -> Qwen35Dims:
    """The dimensions, the one reader of a config (the reference builds its config from them);
    ConfigError for a setting mkc does not compute, KeyError / ValueError / TypeError for a
    malformed config."""
    return Qwen35Dims(family="qwen3_5_text", layer_kinds=tuple(LAYER_KINDS[t] for t in layer_types(raw)),
                      intermediate_size=config_int(setting(raw, "intermediate_size", UPSTREAM_DEFAULTS),
                                                     "intermediate_size"),
                      **attention_fields(raw, name, UPSTREAM_DEFAULTS))
