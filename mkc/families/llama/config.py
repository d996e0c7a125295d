"""Llama dimensions from an upstream `LlamaConfig`-style config.json (transformers 5.x,
`models/llama/configuration_llama.py`; defaults below are that class's)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.config import attention_heads, refuse, setting
from mkc.layers.gqa import ScaledRopeGQADims
from mkc.layers.rope import read_rope
from mkc.model.family import config_float, config_int, identifier

FAMILY_NAME = "llama"
DEFAULTS: dict[str, Any] = {
    "vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
    "num_attention_heads": 32, "hidden_act": "silu", "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
    "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False,
}
# Settings the kernel and the reference do not compute: key -> (the value they compute, hint).
REFUSED = {
    "hidden_act": ("silu", "Llama MLPs are SwiGLU: \"hidden_act\": \"silu\""),
    "attention_bias": (False, "Llama 3 projections have no biases: \"attention_bias\": false"),
    "mlp_bias": (False, "Llama 3 MLPs have no biases: \"mlp_bias\": false"),
    "tie_word_embeddings": (False, "the kernel streams its own lm_head.weight (Llama 3.1 8B and 70B "
                                   "untie it; 3.2 1B and 3B tie it and are not supported)"),
}


@dataclass(frozen=True)
class LlamaDims(ScaledRopeGQADims):
    intermediate_size: int


def read_dims(raw: Mapping, name: str) -> LlamaDims:
    """The one reader of a Llama config; ConfigError for a setting mkc does not compute."""
    refuse(raw, REFUSED, DEFAULTS)
    ints = {key: config_int(setting(raw, key, DEFAULTS), key) for key in (
        "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size")}
    n = ints.pop("num_attention_heads")       # LlamaConfig: KV heads default to the query heads
    heads = attention_heads(raw, ints["hidden_size"], n,
                            config_int(setting(raw, "num_key_value_heads", {"num_key_value_heads": n}),
                                       "num_key_value_heads"))
    return LlamaDims(family=FAMILY_NAME, name=identifier(name),
                     rms_norm_eps=config_float(setting(raw, "rms_norm_eps", DEFAULTS), "rms_norm_eps"),
                     layer_kinds=("gqa",) * ints["num_hidden_layers"], **heads, **ints,
                     **read_rope(raw, heads["head_dim"], DEFAULTS["rope_theta"]))
