"""The DeepSeek-V3 config reader (mkc.families.deepseek_v3.config, through the reference's
load_config): the published facts of the shipped config, upstream's YaRN derivation and the
settings it refuses."""
from __future__ import annotations

import json
import math

import pytest

from mkc.families.deepseek_v3 import reference as ref
from mkc.layers.mla import softmax_scale
from mkc.model.config import CONFIG_DIR
from mkc.model.family import ConfigError

MINI_RAW = json.loads((CONFIG_DIR / "deepseek_v3_mini.json").read_text())


def _count(d, active: bool = False) -> int:
    """Parameters of the weights table; `active`: the routed experts a token picks only."""
    total = 0
    for name, (shape, _) in ref.param_shapes(d).items():
        if name.endswith("_scale_inv"):          # an FP8 checkpoint's block scales: no parameters
            continue
        n = math.prod(shape)
        if active and name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            n = n // d.experts * d.top_k
        total += n
    return total


def test_the_shipped_config_holds_the_published_facts():
    """deepseek-ai/DeepSeek-V3's config.json, and the model card's 671B parameters (37B
    active) counted from the weights table (the MTP layer's 14B apart)."""
    d = ref.load_config(CONFIG_DIR / "deepseek_v3.json")
    assert (d.num_hidden_layers, d.hidden_size, d.intermediate_size, d.vocab_size) == \
        (61, 7168, 18432, 129280)
    assert (d.num_attention_heads, d.q_lora_rank, d.kv_lora_rank, d.qk_nope_head_dim, d.qk_rope_head_dim,
            d.v_head_dim) == (128, 1536, 512, 128, 64, 128)
    assert (d.experts, d.top_k, d.moe_intermediate_size, d.shared_expert_intermediate_size) == \
        (256, 8, 2048, 2048)
    assert (d.n_group, d.topk_group, d.routed_scaling_factor, d.norm_topk_prob) == (8, 4, 2.5, True)
    assert d.layer_kinds == ("mla", "dense") * 3 + ("mla", "moe") * 58
    assert (d.rope_type, d.rope_theta, d.yarn_factor, d.rope_interleave, d.rms_norm_eps) == \
        ("yarn", 10000.0, 40.0, True, 1e-6)
    assert _count(d) == pytest.approx(671e9, rel=2e-3)
    assert _count(d, active=True) == pytest.approx(37e9, rel=3e-2)


def test_the_published_checkpoint_is_fp8_in_128x128_blocks():
    """quantization_config {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
    "activation_scheme": "dynamic"}: every linear weight but the lm_head is e4m3 codes beside its
    f32 `weight_scale_inv`, one per started 128 x 128 block of [out, in] (fused experts:
    transformers 5's `gate_up_proj_scale_inv`); embeddings, norms, the router and its bias not."""
    d = ref.load_config(CONFIG_DIR / "deepseek_v3.json")
    assert d.weight_block_size == (128, 128)
    table, m = ref.param_shapes(d), "model.layers.3."
    assert table[m + "mlp.experts.gate_up_proj"] == ((256, 4096, 7168), "float8_e4m3fn")
    assert table[m + "mlp.experts.gate_up_proj_scale_inv"] == ((256, 32, 56), "float32")
    assert table[m + "mlp.experts.down_proj_scale_inv"] == ((256, 56, 16), "float32")
    assert table[m + "self_attn.kv_a_proj_with_mqa.weight"] == ((576, 7168), "float8_e4m3fn")
    assert table[m + "self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == ((5, 56), "float32")
    assert table[m + "mlp.shared_experts.down_proj.weight_scale_inv"] == ((56, 16), "float32")
    assert table["model.layers.0.mlp.gate_proj.weight_scale_inv"] == ((144, 56), "float32")
    for plain in ("lm_head.weight", "model.embed_tokens.weight", m + "mlp.gate.weight",
                  m + "self_attn.kv_a_layernorm.weight"):
        assert table[plain][1] == "bfloat16" and plain + "_scale_inv" not in table
    assert table[m + "mlp.gate.e_score_correction_bias"][1] == "float32"


def test_yarn_is_upstreams_derivation():
    """`_compute_yarn_parameters` over the 64 rope dims (truncated correction range of pair
    indices from beta_fast 32 and beta_slow 1 at 4096 positions), attention factor
    mscale(40, 1) / mscale(40, 1) = 1, and the softmax scale `yarn_apply_mscale`:
    192^-0.5 * (0.1 ln 40 + 1)^2."""
    d = ref.load_config(CONFIG_DIR / "deepseek_v3.json")

    def correction(rotations):
        return 64 * math.log(4096 / (rotations * 2 * math.pi)) / (2 * math.log(10000))
    assert (d.yarn_low, d.yarn_high) == (math.floor(correction(32)), math.ceil(correction(1))) == (10, 23)
    assert d.yarn_attention_factor == 1.0
    assert softmax_scale(d) == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-15)
    plain = ref.load_config(MINI_RAW | {"rope_scaling": None})
    assert (plain.rope_type, softmax_scale(plain)) == ("default", 128 ** -0.5)


def test_defaults_are_deepseek_v3_config_s():
    d = ref.load_config({"model_type": "deepseek_v3", "hidden_size": 512, "num_hidden_layers": 4,
                         "vocab_size": 256, "intermediate_size": 1024})
    assert (d.num_attention_heads, d.experts, d.top_k, d.n_group, d.topk_group) == (128, 256, 8, 8, 4)
    assert (d.rope_type, d.rope_interleave, d.layer_kinds[5], d.layer_kinds[7]) == \
        ("default", True, "dense", "moe")


@pytest.mark.parametrize("edit,words", [
    ({"hidden_act": "gelu"}, "hidden_act"), ({"attention_bias": True}, "attention_bias"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings"), ({"scoring_func": "softmax"}, "scoring_func"),
    ({"topk_method": "greedy"}, "topk_method"), ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"q_lora_rank": None}, "q_lora_rank"), ({"num_key_value_heads": 4}, "num_key_value_heads"),
    ({"quantization_config": {"quant_method": "awq", "weight_block_size": [128, 128]}}, "quant_method"),
    ({"quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}, "fmt"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128]}}, "weight_block_size"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "activation_scheme": "static"}}, "activation_scheme"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128],
                              "modules_to_not_convert": ["q_a_proj"]}}, "modules_to_not_convert"),
    ({"n_group": 3}, "do not route"), ({"topk_group": 5}, "do not route"),
    ({"n_group": 32}, "do not route"), ({"first_k_dense_replace": 5}, "do not route"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "rope_type"),
    ({"rope_scaling": {"type": "yarn", "factor": 8.0}}, "original_max_position_embeddings"),
    ({"qk_rope_head_dim": 63}, "odd"), ({"rope_interleave": 1}, "boolean")])
def test_settings_it_does_not_compute_are_refused(edit, words):
    with pytest.raises(ConfigError, match=words) as e:
        ref.load_config(MINI_RAW | edit)
    assert e.value.hint
