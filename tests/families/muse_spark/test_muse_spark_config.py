"""Muse Spark's config reader: the shipped configs hold the published facts, upstream's defaults
fill what a config omits, and what the kinds do not compute is refused with a hint."""
import dataclasses
import json

import pytest

from mkc.families.muse_spark.config import read_dims
from mkc.model.config import CONFIG_DIR, upstream_config
from mkc.model.family import ConfigError


def _raw(name: str) -> dict:
    raw, _ = upstream_config(CONFIG_DIR / f"{name}.json")
    return dict(raw)


def test_the_shipped_config_holds_the_published_facts():
    d = read_dims(_raw("muse_spark"), "muse_spark")
    attention = d.layer_kinds[::2]
    assert d.num_hidden_layers == 62 and len(d.layer_kinds) == 124 and set(d.layer_kinds[1::2]) == {"moe"}
    assert [i for i, k in enumerate(attention) if k == "full"] == [i for i in range(62) if i % 4 == 1]
    assert (d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (8192, 128, 16, 64)
    assert (d.experts, d.top_k, d.moe_hidden_size, d.moe_intermediate_size) == (256, 8, 4096, 4096)
    assert (d.vocab_size, d.vocab_used, d.sliding_window) == (202048, 201818, 2048)
    assert d.output_multiplier == pytest.approx(2 ** -2.5) and d.qk_scale_factor == 5.4730064863875
    assert (d.rope_theta, d.residual_gate_temperature, d.post_norm_eps) == (500000.0, 0.3, 1e-8)


def test_the_mini_config_is_the_reference_repositorys_test_size():
    d = read_dims(_raw("muse_spark_mini"), "muse_spark_mini")
    assert (d.num_hidden_layers, d.hidden_size, d.experts, d.top_k) == (4, 1024, 16, 4)
    assert (d.num_attention_heads, d.num_key_value_heads) == (16, 8)
    assert (d.vocab_size, d.sliding_window) == (2048, 256)
    assert d.layer_kinds[::2] == ("swa", "full", "swa", "swa")


def test_upstream_defaults_fill_an_empty_config():
    """`MuseSparkTextConfig()`: its layer pattern (full every 4th layer counted back from the
    last) coincides with the hand kernel's `l % 4 == 1` at 62 layers."""
    shipped = read_dims(_raw("muse_spark"), "defaults")
    assert read_dims({}, "defaults") == dataclasses.replace(shipped, vocab_used=shipped.vocab_size)


@pytest.mark.parametrize("change,what", [
    ({"mlp_layer_types": ["dense"] + ["sparse"] * 3}, "mlp_layer_types"),
    ({"layer_rope_theta": [500000.0] * 4}, "layer_rope_theta"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"),
    ({"vocab_used": 4096}, "vocab_used"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quantization"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6}}, "rope_type"),
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention", "full_attention"]},
     "layer_types"),
])
def test_what_the_kinds_do_not_compute_is_refused_with_a_hint(change, what):
    with pytest.raises(ConfigError) as e:
        read_dims(_raw("muse_spark_mini") | change, "m")
    assert what in str(e.value) and e.value.hint


def test_an_omni_config_nests_the_text_model_and_says_where_its_experts_are_nvfp4():
    """The released omni config holds the text model under `text_config` and, in the -NVFP4
    release, ModelOpt's `quantization_config` at its top: the experts' checkpoint."""
    text = _raw("muse_spark_mini")
    plain = read_dims({"model_type": "musespark1x_omni", "text_config": text}, "m")
    assert plain == read_dims(text, "m") and plain.expert_checkpoint == ""
    nvfp4 = read_dims({"model_type": "muse_spark", "text_config": text,
                       "quantization_config": {"quant_method": "modelopt", "quant_algo": "NVFP4"}}, "m")
    assert nvfp4 == dataclasses.replace(plain, expert_checkpoint="nvfp4")
    modules = ["lm_head", "model.language_model.layers.0.mlp.experts*",
               "model.language_model.layers.3.mlp.experts", "*self_attn*"]
    excluded = read_dims({"model_type": "muse_spark", "text_config": text, "quantization_config": {
        "quant_algo": "NVFP4", "exclude_modules": modules}}, "m")
    assert excluded.expert_checkpoint_bf16_layers == (0, 3)
    quant = {"quant_algo": "NVFP4", "exclude_modules": ["*experts"]}
    every = read_dims(text | {"quantization_config": quant}, "m")
    assert every.expert_checkpoint_bf16_layers == (0, 1, 2, 3)


def test_the_shipped_files_are_json_without_duplicate_keys():
    for name in ("muse_spark", "muse_spark_mini"):
        json.loads((CONFIG_DIR / f"{name}.json").read_text(),
                   object_pairs_hook=lambda pairs: dict(pairs) if len({k for k, _ in pairs}) == len(pairs)
                   else pytest.fail(f"{name}: duplicate keys"))
