"""The Llama config reader (mkc.families.llama.config, through the reference's load_config):
the published facts of the shipped configs and the settings it refuses."""
from __future__ import annotations

import json

import pytest

from mkc.families.llama import reference as ref
from mkc.model.config import CONFIG_DIR
from mkc.model.family import ConfigError

MINI_RAW = json.loads((CONFIG_DIR / "llama_mini.json").read_text())


@pytest.mark.parametrize("name,layers,hidden,heads,inter,params", [
    ("llama_3_1_8b", 32, 4096, 32, 14336, 8.03e9), ("llama_3_1_70b", 80, 8192, 64, 28672, 70.55e9)])
def test_shipped_configs_hold_the_published_facts(name, layers, hidden, heads, inter, params):
    """The published config.json values, and the parameter counts of the model cards (8.03B
    and 70.55B) counted from the weights table."""
    d = ref.load_config(CONFIG_DIR / f"{name}.json")
    assert (d.num_hidden_layers, d.hidden_size, d.num_attention_heads, d.intermediate_size) == \
        (layers, hidden, heads, inter)
    assert (d.num_key_value_heads, d.head_dim, d.rotary_dim, d.vocab_size) == (8, 128, 128, 128256)
    assert (d.rope_type, d.rope_theta, d.rope_factor, d.rope_low_freq_factor, d.rope_high_freq_factor,
            d.rope_original_max_position) == ("llama3", 500000.0, 8.0, 1.0, 4.0, 8192)
    assert d.rms_norm_eps == 1e-5 and d.layer_kinds == ("gqa",) * layers
    count = sum(int(__import__("math").prod(shape)) for shape, _ in ref.param_shapes(d).values())
    assert count == pytest.approx(params, rel=2e-3)


def test_defaults_are_llama_configs_and_head_dim_follows_the_hidden_size():
    """A config that leaves keys out gets LlamaConfig's defaults (KV heads = heads, theta 1e4,
    the default rope), head_dim = hidden / heads unless given."""
    d = ref.load_config({"model_type": "llama", "hidden_size": 512, "num_attention_heads": 8,
                         "num_hidden_layers": 2, "intermediate_size": 1024, "vocab_size": 256})
    assert (d.num_key_value_heads, d.head_dim, d.rope_theta, d.rope_type, d.rms_norm_eps) == \
        (8, 64, 10000.0, "default", 1e-6)


@pytest.mark.parametrize("edit,words", [
    ({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"), ({"tie_word_embeddings": True}, "tie_word_embeddings = true "),
    ({"tie_word_embeddings": "no"}, 'tie_word_embeddings = "no" is not supported'),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"num_key_value_heads": 0}, "num_key_value_heads = 0 is out of range"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                       "original_max_position_embeddings": 8192}}, "high_freq_factor > low_freq_factor"),
    ({"head_dim": 63}, "odd")])
def test_settings_it_does_not_compute_are_refused(edit, words):
    with pytest.raises(ConfigError, match=words):
        ref.load_config(MINI_RAW | edit)
