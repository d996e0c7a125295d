"""The Qwen3-MoE config reader (mkc.families.qwen3_moe.config, through the reference's
load_config): the published facts of the shipped configs and the settings it refuses."""
from __future__ import annotations

import json
import math

import pytest

from mkc.families.qwen3_moe import reference as ref
from mkc.model.config import CONFIG_DIR
from mkc.model.family import ConfigError

MINI_RAW = json.loads((CONFIG_DIR / "qwen3_moe_mini.json").read_text())


def _count(d, active: bool = False) -> int:
    """Parameters of the weights table; `active`: without the experts a token does not pick (the
    model cards count the whole embedding as active)."""
    total = 0
    for name, (shape, _) in ref.param_shapes(d).items():
        n = math.prod(shape)
        if active and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            n = n // d.experts * d.top_k
        total += n
    return total


@pytest.mark.parametrize("name,layers,hidden,heads,inter,total,active", [
    ("qwen3_30b_a3b", 48, 2048, 32, 768, 30.5e9, 3.3e9),
    ("qwen3_235b_a22b", 94, 4096, 64, 1536, 235e9, 22e9)])
def test_shipped_configs_hold_the_published_facts(name, layers, hidden, heads, inter, total, active):
    """The published config.json values, and the model cards' parameter counts (30.5B total,
    3.3B active; 235B, 22B) counted from the weights table."""
    d = ref.load_config(CONFIG_DIR / f"{name}.json")
    assert (d.num_hidden_layers, d.hidden_size, d.num_attention_heads, d.moe_intermediate_size) == \
        (layers, hidden, heads, inter)
    assert (d.num_key_value_heads, d.head_dim, d.rotary_dim, d.vocab_size) == (4, 128, 128, 151936)
    assert (d.experts, d.top_k, d.norm_topk_prob) == (128, 8, True)
    assert (d.rope_type, d.rope_theta, d.rms_norm_eps) == ("default", 1e6, 1e-6)
    assert d.layer_kinds == ("gqa", "moe") * layers
    assert _count(d) == pytest.approx(total, rel=5e-3)
    assert _count(d, active=True) == pytest.approx(active, rel=3e-2)


def test_defaults_are_qwen3_moe_config_s():
    """A config that leaves keys out gets Qwen3MoeConfig's defaults: norm_topk_prob false,
    128 experts top 8 of width 768, 4 KV heads, theta 1e4, head_dim = hidden / heads."""
    d = ref.load_config({"model_type": "qwen3_moe", "hidden_size": 512, "num_attention_heads": 8,
                         "num_hidden_layers": 2, "vocab_size": 256})
    assert (d.norm_topk_prob, d.experts, d.top_k, d.moe_intermediate_size) == (False, 128, 8, 768)
    assert (d.num_key_value_heads, d.head_dim, d.rope_theta, d.rope_type, d.rms_norm_eps) == \
        (4, 64, 10000.0, "default", 1e-6)


@pytest.mark.parametrize("edit,words", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"), ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"use_sliding_window": True}, "use_sliding_window"), ({"attention_bias": True}, "attention_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"), ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_type"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"), ({"head_dim": 63}, "odd"),
    ({"num_experts_per_tok": 17}, "num_experts_per_tok"), ({"norm_topk_prob": "yes"}, "boolean")])
def test_settings_it_does_not_compute_are_refused(edit, words):
    with pytest.raises(ConfigError, match=words) as e:
        ref.load_config(MINI_RAW | edit)
    assert e.value.hint


def test_an_empty_mlp_only_layers_and_no_sliding_window_are_taken():
    d = ref.load_config(MINI_RAW | {"mlp_only_layers": [], "use_sliding_window": False,
                                    "sliding_window": None, "rope_scaling": {"rope_type": "default"}})
    assert d.layer_kinds == ("gqa", "moe") * 4
