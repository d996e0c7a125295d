"""The Llama config reader (mkc.families.llama.config, through the reference's load_config):
the published facts of the shipped configs and the settings it refuses, and its alias
`mistral` read by MistralConfig's defaults, its `sliding_window` null (no window) told from
omitted (a 4096-token window, refused)."""
from __future__ import annotations

import json

import pytest

from mkc.diagnostics import MkcError, Span
from mkc.families.llama import FAMILY
from mkc.families.llama import reference as ref
from mkc.model import registry
from mkc.model.config import CONFIG_DIR, dims_from_config
from mkc.model.family import ConfigError

MINI_RAW = json.loads((CONFIG_DIR / "llama_mini.json").read_text())
MISTRAL_RAW = json.loads((CONFIG_DIR / "mistral_mini.json").read_text())
# The keys the default tests give: the rest is left to each type's config class.
SOME = {"hidden_size": 512, "num_attention_heads": 16, "num_hidden_layers": 2, "vocab_size": 256}


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


def test_mistral_is_read_by_the_llama_family_and_its_reference():
    assert registry.for_model_type("mistral") is registry.for_model_type("llama") is registry.get("llama")
    assert FAMILY.model_types == ("llama", "mistral")
    with pytest.raises(ValueError, match="model_type"):
        ref.load_config(MINI_RAW | {"model_type": "phi3"})


def test_each_type_s_omitted_keys_take_its_own_config_class_s_defaults():
    """MistralConfig: intermediate 14336, 8 KV heads; LlamaConfig: intermediate 11008, the
    query heads' count; both eps 1e-6, theta 1e4, the default rope."""
    mistral = ref.load_config(SOME | {"model_type": "mistral", "sliding_window": None})
    llama = ref.load_config(SOME | {"model_type": "llama"})
    assert (mistral.intermediate_size, mistral.num_key_value_heads) == (14336, 8)
    assert (llama.intermediate_size, llama.num_key_value_heads) == (11008, 16)
    for d in (mistral, llama):
        assert (d.head_dim, d.rms_norm_eps, d.rope_theta, d.rope_type) == (32, 1e-6, 10000.0, "default")


def test_a_null_kv_head_count_is_the_query_heads_for_both():
    """Both classes read an explicit null as the query heads' count; only MistralConfig's
    omission differs (8)."""
    for model_type, extra in (("mistral", {"sliding_window": None}), ("llama", {})):
        d = ref.load_config(SOME | extra | {"model_type": model_type, "num_key_value_heads": None})
        assert d.num_key_value_heads == 16, model_type


def test_the_mistral_mini_is_the_llama_mini_s_shapes_with_mistral_s_rope():
    d = ref.load_config(CONFIG_DIR / "mistral_mini.json")
    llama = ref.load_config(CONFIG_DIR / "llama_mini.json")
    assert (d.family, d.name, d.rope_type, d.rope_theta) == ("llama", "mistral_mini", "default", 1e6)
    assert ref.param_shapes(d) == ref.param_shapes(llama)


def test_sliding_window_null_is_no_window_and_its_omission_a_window_refused():
    """MistralConfig reads null as no window (the causal mask over the whole context, what
    these layers compute) and an omitted key as 4096 tokens, which they do not: refused,
    naming the key, what upstream makes of it and the fix."""
    ref.load_config(MISTRAL_RAW)
    assert MISTRAL_RAW["sliding_window"] is None
    omitted = {k: v for k, v in MISTRAL_RAW.items() if k != "sliding_window"}
    with pytest.raises(ConfigError, match="sliding_window is omitted, which MistralConfig reads as "
                                          "4096, and that is not supported") as e:
        ref.load_config(omitted)
    assert '"sliding_window": null' in e.value.hint and "4096-token window" in e.value.hint
    for window in (4096, 32768):
        with pytest.raises(ConfigError, match=f"sliding_window = {window} is not supported"):
            ref.load_config(MISTRAL_RAW | {"sliding_window": window})


def test_mkc_check_refuses_an_omitted_window_at_the_model_line(tmp_path):
    path = tmp_path / "config.json"
    where = Span("spec.sched", 3, 11, 3, 24)
    raw = {k: v for k, v in MISTRAL_RAW.items() if k != "sliding_window"}
    with pytest.raises(MkcError) as e:
        dims_from_config(raw, path, where)
    (d,) = e.value.diagnostics
    assert (d.code, d.span) == ("E-MODEL", where) and "sliding_window is omitted" in d.message
    assert '"sliding_window": null' in d.hint
    assert dims_from_config(MISTRAL_RAW, path, where).intermediate_size == 512


def test_keys_a_type_s_class_does_not_read_are_not_read():
    """LlamaConfig has no sliding_window (LlamaAttention never slides); MistralConfig has no
    attention_bias or mlp_bias (its projections are built without biases): transformers
    ignores them, and so does the reader."""
    assert ref.load_config(MINI_RAW | {"sliding_window": 4096}) == ref.load_config(MINI_RAW)
    biased = ref.load_config(MISTRAL_RAW | {"attention_bias": True, "mlp_bias": True})
    assert biased == ref.load_config(MISTRAL_RAW)
    assert not any(name.endswith(".bias") for name in ref.param_shapes(biased))


@pytest.mark.parametrize("edit,words", [
    ({"hidden_act": "gelu"}, "hidden_act"), ({"tie_word_embeddings": True}, "tie_word_embeddings = true "),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"), ({"head_dim": 63}, "odd")])
def test_mistral_settings_it_does_not_compute_are_refused(edit, words):
    with pytest.raises(ConfigError, match=words):
        ref.load_config(MISTRAL_RAW | edit)
