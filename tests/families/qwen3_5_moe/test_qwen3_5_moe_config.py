"""Qwen3.5 MoE configs: the shipped full and MINI configs, the dims reader's refusals, the
reference's config parsing, and the parameter table (upstream names, about 35B / 3B active)."""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from mkc.families.qwen3_5_moe import reference as ref
from mkc.families.qwen3_5_moe.config import Qwen35MoeDims, read_dims
from mkc.model.config import CONFIG_DIR, read_checked_dims
from mkc.model.family import ConfigError

FULL_JSON = CONFIG_DIR / "qwen3_5_35b_a3b.json"
MINI_JSON = CONFIG_DIR / "qwen3_5_moe_mini.json"
FULL = json.loads(FULL_JSON.read_text())
MINI = json.loads(MINI_JSON.read_text())


def _dims(raw: dict, path: Path) -> Qwen35MoeDims:
    """read_dims, then the core's range checks (what mkc.model.config runs on every family)."""
    return read_checked_dims(read_dims, raw, path.stem)


def test_full_config_dims() -> None:
    d = _dims(FULL, FULL_JSON)
    assert (d.family, d.name) == ("qwen3_5_moe_text", "qwen3_5_35b_a3b")
    assert (d.hidden_size, d.num_hidden_layers, d.vocab_size) == (2048, 40, 248320)
    # two sublayers per layer in the layer loop: attention, then the MoE
    assert d.layer_kinds == ("gdn", "moe", "gdn", "moe", "gdn", "moe", "gqa", "moe") * 10
    assert (d.num_attention_heads, d.num_key_value_heads, d.head_dim) == (16, 2, 256)
    assert (d.rotary_dim, d.rope_theta, d.rms_norm_eps) == (64, 1e7, 1e-6)
    assert (d.linear_num_key_heads, d.linear_num_value_heads) == (16, 32)
    assert (d.linear_key_head_dim, d.linear_value_head_dim, d.linear_conv_kernel_dim) == (128, 128, 4)
    assert d.linear_conv_dim == 8192
    assert (d.experts, d.top_k, d.moe_intermediate_size, d.shared_expert_intermediate_size) == (
        256, 8, 512, 512)
    assert d.norm_topk_prob is True


def test_mini_config_is_a_tp8_ready_twin() -> None:
    """Same structure as the full model, small sizes, every split over 8 ranks whole (and the
    per-rank widths the kernels tile lane-aligned)."""
    mini, full = _dims(MINI, MINI_JSON), _dims(FULL, FULL_JSON)
    assert mini.layer_kinds == full.layer_kinds[:8]
    assert mini.layer_kinds == ("gdn", "moe", "gdn", "moe", "gdn", "moe", "gqa", "moe")
    assert set(MINI) == set(FULL)   # the same upstream keys
    assert (mini.hidden_size, mini.experts, mini.top_k, mini.vocab_size) == (256, 16, 4, 1024)
    assert (mini.moe_intermediate_size, mini.shared_expert_intermediate_size) == (128, 128)
    assert (mini.rope_theta, mini.rms_norm_eps, mini.rotary_dim) == (full.rope_theta, 1e-6, 32)
    tp = 8
    assert mini.experts % tp == 0 and mini.top_k < mini.experts
    assert mini.num_attention_heads % tp == 0 and mini.linear_num_key_heads % tp == 0
    assert mini.linear_num_value_heads % tp == 0
    assert mini.moe_intermediate_size % tp == 0 and mini.shared_expert_intermediate_size % tp == 0
    lane_aligned = {
        "q+gate columns": 2 * mini.num_attention_heads * mini.head_dim // tp,
        "gdn conv channels": mini.linear_conv_dim // tp,
        "gdn value columns": mini.linear_num_value_heads * mini.linear_value_head_dim // tp,
        "vocab rows": mini.vocab_size // tp,
        "hidden": mini.hidden_size,
        "expert width": mini.moe_intermediate_size,
    }
    assert all(v > 0 and v % 128 == 0 for v in lane_aligned.values()), lane_aligned


@pytest.mark.parametrize("key,value,words", [
    ("mlp_only_layers", [1], "mlp_only_layers"),
    ("decoder_sparse_step", 2, "decoder_sparse_step"),
    ("norm_topk_prob", False, "norm_topk_prob"),
    ("hidden_act", "gelu", "hidden_act"),
])
def test_unsupported_settings_are_refused(key: str, value: object, words: str) -> None:
    raw = {**MINI, key: value}
    with pytest.raises(ConfigError) as e:
        read_dims(raw, "x")
    assert words in str(e.value) and e.value.hint
    with pytest.raises(ValueError, match=words):   # the reference refuses the same configs
        ref.load_config(raw)


def test_upstream_neutral_values_are_accepted() -> None:
    raw = {**MINI, "mlp_only_layers": [], "decoder_sparse_step": 1, "norm_topk_prob": True}
    assert read_dims(raw, "x") == read_dims(MINI, "x")
    assert ref.load_config(raw) == ref.load_config(MINI)


def test_reference_config() -> None:
    full = ref.load_config(FULL_JSON)
    assert full.layer_kinds == ("gdn", "moe", "gdn", "moe", "gdn", "moe", "gqa", "moe") * 10
    assert (full.experts, full.top_k) == (256, 8)
    assert (full.moe_intermediate_size, full.shared_expert_intermediate_size) == (512, 512)
    assert full.norm_topk_prob and not hasattr(full, "intermediate_size")
    assert (full.rotary_dim, full.rope_theta, full.linear_conv_dim) == (64, 1e7, 8192)
    # A composite checkpoint config: the text model under text_config.
    composite = {"model_type": "qwen3_5_moe", "text_config": FULL}
    assert dataclasses.replace(ref.load_config(composite), name=full.name) == full
    # Omitted keys take the upstream Qwen3_5MoeTextConfig defaults, which describe the 35B model.
    sparse = {"model_type": "qwen3_5_moe_text", "rope_parameters": {"rope_theta": 10000000}}
    assert dataclasses.replace(ref.load_config(sparse), name=full.name) == full
    with pytest.raises(ValueError, match="qwen3_5_moe_text"):
        ref.load_config({**FULL, "model_type": "qwen3_5_text"})
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ref.load_config({**MINI, "num_experts_per_tok": 17})


def test_parameter_table_uses_upstream_names() -> None:
    mini = ref.load_config(MINI_JSON)
    shapes = ref.param_shapes(mini)
    moe = {n[len("model.layers.3.mlp."):]: s for n, (s, _) in shapes.items()
           if n.startswith("model.layers.3.mlp.")}
    assert moe == {
        "gate.weight": (16, 256),
        "experts.gate_up_proj": (16, 2 * 128, 256),
        "experts.down_proj": (16, 256, 128),
        "shared_expert.gate_proj.weight": (128, 256),
        "shared_expert.up_proj.weight": (128, 256),
        "shared_expert.down_proj.weight": (256, 128),
        "shared_expert_gate.weight": (1, 256),
    }
    layer0 = [n[len("model.layers.0."):] for n in shapes if n.startswith("model.layers.0.")]
    assert layer0[:2] == ["linear_attn.in_proj_qkv.weight", "linear_attn.in_proj_z.weight"]
    assert {"input_layernorm.weight", "post_attention_layernorm.weight"} <= set(layer0)
    assert "model.layers.3.self_attn.q_proj.weight" in shapes and "lm_head.weight" in shapes
    assert all(dtype == "bfloat16" for _, dtype in shapes.values())
    # 3 global + 30 gated-delta-net layers x 18 + 10 attention layers x 15 tensors: the count of a
    # published Qwen3.5-35B-A3B text model with fused experts.
    assert len(ref.param_shapes(ref.load_config(FULL_JSON))) == 693


def test_full_model_is_35b_total_3b_active() -> None:
    full = ref.load_config(FULL_JSON)
    total, active = ref.count_parameters(full), ref.count_parameters(full, active=True)
    assert abs(total / 35e9 - 1) < 0.03, total       # 34.66e9
    assert abs(active / 3e9 - 1) < 0.03, active      # 2.95e9: lm_head, mixers, 8 of 256 experts
