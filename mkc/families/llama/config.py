"""Llama dimensions from an upstream config.json of a model type the family reads: `llama`
(transformers 5.x `models/llama/configuration_llama.py`) and its alias `mistral`
(`models/mistral/configuration_mistral.py`), each with its own config class's defaults."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from mkc.layers.config import ConfigClass, attention_heads, config_class
from mkc.layers.gqa import ScaledRopeGQADims
from mkc.layers.rope import read_rope
from mkc.model.family import config_float, config_int, identifier

FAMILY_NAME = "llama"
SWIGLU = ("silu", "the family's MLPs are SwiGLU: \"hidden_act\": \"silu\"")
# `num_key_value_heads` None: both classes then take the query heads' count (their
# "backward compatibility" branch), LlamaConfig by default, MistralConfig for an explicit null.
LLAMA = ConfigClass(
    "LlamaConfig",
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": None, "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "attention_bias": False, "mlp_bias": False},
    refused={
        "hidden_act": SWIGLU,
        "attention_bias": (False, "Llama 3 projections have no biases: \"attention_bias\": false"),
        "mlp_bias": (False, "Llama 3 MLPs have no biases: \"mlp_bias\": false"),
        "tie_word_embeddings": (False, "the kernel streams its own lm_head.weight (Llama 3.1 8B and 70B "
                                       "untie it; 3.2 1B and 3B tie it and are not supported)"),
    })
# MistralConfig has no attention_bias or mlp_bias: MistralAttention and MistralMLP build their
# projections without biases whatever a config says, so those keys are not read here either.
MISTRAL = ConfigClass(
    "MistralConfig",
    defaults={"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_act": "silu",
              "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
              "sliding_window": 4096},
    nulls={"num_key_value_heads": None, "sliding_window": None},
    refused={
        "hidden_act": SWIGLU,
        "tie_word_embeddings": (False, "the kernel streams its own lm_head.weight (Mistral 7B unties it)"),
        "sliding_window": (None, "this family's layers attend over the whole context. MistralConfig "
                                 "reads an omitted sliding_window as a 4096-token window (Mistral 7B "
                                 "v0.1's), which this family does not compute; a checkpoint trained "
                                 "without a window says \"sliding_window\": null (Mistral 7B v0.2 "
                                 "and v0.3 do): write null only if yours was"),
    })
CONFIG_CLASSES = {"llama": LLAMA, "mistral": MISTRAL}
MODEL_TYPES = tuple(CONFIG_CLASSES)


@dataclass(frozen=True)
class LlamaDims(ScaledRopeGQADims):
    intermediate_size: int


def read_dims(raw: Mapping, name: str) -> LlamaDims:
    """The one reader of the family's configs, by the config class of their model type;
    ConfigError for a setting mkc does not compute."""
    upstream = config_class(raw, CONFIG_CLASSES)
    upstream.refuse(raw)
    ints = {key: config_int(upstream.get(raw, key), key) for key in (
        "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads", "intermediate_size")}
    n = ints.pop("num_attention_heads")
    kv = upstream.get(raw, "num_key_value_heads")
    heads = attention_heads(raw, ints["hidden_size"], n,
                            config_int(n if kv is None else kv, "num_key_value_heads"))
    return LlamaDims(family=FAMILY_NAME, name=identifier(name),
                     rms_norm_eps=config_float(upstream.get(raw, "rms_norm_eps"), "rms_norm_eps"),
                     layer_kinds=("gqa",) * ints["num_hidden_layers"], **heads, **ints,
                     **read_rope(raw, heads["head_dim"], upstream.defaults["rope_theta"]))
