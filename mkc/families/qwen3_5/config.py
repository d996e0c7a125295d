"""Qwen3.5 text dimensions from an upstream `Qwen3_5TextConfig`-style config.json."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.model.contracts import Dims
from mkc.model.family import ConfigError, identifier

# Upstream layer_types values -> mkc layer kinds (the phase names a schedule uses).
LAYER_KINDS = {"linear_attention": "gdn", "full_attention": "gqa"}


@dataclass(frozen=True)
class AttentionDims(Dims):
    """What every Qwen3.5-style model has: the decoder and its gated delta net and gated
    attention layers. Names follow the upstream config keys."""

    rms_norm_eps: float
    layer_kinds: tuple[str, ...]
    # gated GQA
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
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


def layer_types(raw: dict) -> list[str]:
    """Upstream layer_types, or the full-attention interval's pattern when the config omits it."""
    n_layers = int(raw["num_hidden_layers"])
    if "layer_types" in raw:
        types = list(raw["layer_types"])
    else:
        interval = int(raw.get("full_attention_interval", 4))
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                 for i in range(n_layers)]
    if len(types) != n_layers or any(t not in LAYER_KINDS for t in types):
        raise ConfigError(f"layer_types must list {n_layers} entries of {sorted(LAYER_KINDS)}",
                          "as upstream Qwen3.5 configs do")
    return types


def rope(raw: dict, head_dim: int) -> tuple[int, float]:
    """(rotary dims, theta); fallbacks are the upstream Qwen3_5TextConfig defaults."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be an object, not {params!r}")
    factor = float(params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10_000_000.0)))
    return int(head_dim * factor), theta


def attention_fields(raw: dict, name: str) -> dict:
    """The AttentionDims fields of a config but `family` and `layer_kinds`."""
    head_dim = int(raw["head_dim"])
    rotary_dim, theta = rope(raw, head_dim)
    return dict(
        name=identifier(name),
        hidden_size=int(raw["hidden_size"]), num_hidden_layers=int(raw["num_hidden_layers"]),
        vocab_size=int(raw["vocab_size"]), rms_norm_eps=float(raw["rms_norm_eps"]),
        num_attention_heads=int(raw["num_attention_heads"]),
        num_key_value_heads=int(raw["num_key_value_heads"]), head_dim=head_dim,
        rotary_dim=rotary_dim, rope_theta=theta,
        linear_num_key_heads=int(raw["linear_num_key_heads"]),
        linear_num_value_heads=int(raw["linear_num_value_heads"]),
        linear_key_head_dim=int(raw["linear_key_head_dim"]),
        linear_value_head_dim=int(raw["linear_value_head_dim"]),
        linear_conv_kernel_dim=int(raw["linear_conv_kernel_dim"]),
    )


def read_dims(raw: dict, name: str) -> Qwen35Dims:
    """The dimensions; KeyError / ValueError / TypeError for a malformed config."""
    return Qwen35Dims(family="qwen3_5_text", layer_kinds=tuple(LAYER_KINDS[t] for t in layer_types(raw)),
                      intermediate_size=int(raw["intermediate_size"]), **attention_fields(raw, name))
