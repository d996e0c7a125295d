"""Qwen3.5 text dimensions from an upstream `Qwen3_5TextConfig`-style config.json: the layer
library's hybrid reading (`mkc.layers.gated_delta_net.config`) and the dense MLP's width."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.config import setting
from mkc.layers.gated_delta_net import GatedDeltaNetDims
from mkc.layers.gated_delta_net.config import DEFAULTS, attention_fields, layer_types
from mkc.model.family import config_int

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
    **DEFAULTS,
}


@dataclass(frozen=True)
class Qwen35Dims(GatedDeltaNetDims):
    """Dimensions of one Qwen3.5 text model: the hybrid's attention dims and a dense SwiGLU MLP."""

    intermediate_size: int


def read_dims(raw: Mapping, name: str) -> Qwen35Dims:
    """The dimensions, the one reader of a config (the reference builds its config from them);
    ConfigError for a setting mkc does not compute, KeyError / ValueError / TypeError for a
    malformed config."""
    return Qwen35Dims(family="qwen3_5_text",
                      layer_kinds=tuple(LAYER_KINDS[t] for t in layer_types(raw, UPSTREAM_DEFAULTS)),
                      intermediate_size=config_int(setting(raw, "intermediate_size", UPSTREAM_DEFAULTS),
                                                     "intermediate_size"),
                      **attention_fields(raw, name, UPSTREAM_DEFAULTS))
