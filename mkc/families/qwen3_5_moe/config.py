"""Qwen3.5 MoE text dimensions from an upstream `Qwen3_5MoeTextConfig`-style config.json.

What upstream says, and where it was read (transformers `main`, files
`src/transformers/models/qwen3_5_moe/configuration_qwen3_5_moe.py` and
`modeling_qwen3_5_moe.py`, read from the stored copy of huggingface/transformers):

* `model_type` is `qwen3_5_moe_text` (the multimodal checkpoint's top level is `qwen3_5_moe`
  with the text model under `text_config`). The token mixers are Qwen3.5's: gated delta net
  for `linear_attention` layers, gated attention for `full_attention` layers, same parameter
  names and math as `qwen3_5_text` (both read by the layer library's
  `mkc.layers.gated_delta_net.config`: `layer_types`, `rope`, `attention_fields`).
* Every decoder layer's MLP is `Qwen3_5MoeSparseMoeBlock`; the config class has no
  `mlp_only_layers`, no `decoder_sparse_step` and no `norm_topk_prob`. The router
  (`Qwen3_5MoeTopKRouter`) is a bias-free `[num_experts, hidden]` matrix: softmax over all
  experts in f32, top-`num_experts_per_tok`, the chosen probabilities ALWAYS divided by their
  sum, then cast to the logits' dtype. No correction bias, no routed scaling factor, no
  group-limited routing: those are the whole router details.
* `Qwen3_5MoeTextConfig` defaults (its docstring names Qwen/Qwen3.5-35B-A3B): vocab 248320,
  hidden 2048, 40 layers, 16 query / 2 KV heads x 256, linear attention 16 key / 32 value
  heads x 128, conv kernel 4, rms eps 1e-6, 256 experts, top 8, `moe_intermediate_size` 512,
  `shared_expert_intermediate_size` 512, untied lm_head, `max_position_embeddings` 32768,
  `router_aux_loss_coef` 0.001; `partial_rotary_factor` 0.25 and the interval-4 layer pattern
  come from its `__post_init__`; M-RoPE section [11, 11, 10] is the modeling file's fallback.

The shipped `qwen3_5_35b_a3b.json` takes those values, plus fields that the config class does
not default and that were established only from third-party copies of the published
Qwen/Qwen3.5-35B-A3B `config.json` (other projects' test fixtures and a model card, not the
Hub file itself): `max_position_embeddings` 262144, `rope_theta` 1e7 inside `rope_parameters`
with `mrope_interleaved`, `eos_token_id` 248044, `mtp_num_hidden_layers` 1, `attn_output_gate`.
The same values are published for the dense Qwen3.5 models (`qwen3_8_27b.json`), whose
`mamba_ssm_dtype` float32 the file also carries by analogy (unverified for the MoE model; mkc
does not read it). Not verified:
whether the published file also carries `norm_topk_prob`, `mlp_only_layers` or
`decoder_sparse_step` (third-party copies disagree); the shipped file leaves them out, as the
upstream config class does, and their defaults (True, [], 1) are what upstream computes.

Settings upstream's MoE model does not compute are refused with a hint (ConfigError):
`mlp_only_layers` non-empty or `decoder_sparse_step` != 1 (Qwen3-Next / Qwen3-MoE keys for dense
layers among sparse ones: upstream Qwen3.5 MoE ignores them and routes every layer), and
`norm_topk_prob` false (upstream renormalises unconditionally, whatever the key says).
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.config import setting
from mkc.layers.gated_delta_net import GatedDeltaNetDims
from mkc.layers.gated_delta_net.config import DEFAULTS, attention_fields, layer_types
from mkc.model.family import ConfigError, config_int

FAMILY_NAME = "qwen3_5_moe_text"
MODEL_TYPES = ("qwen3_5_moe_text",)   # the composite `qwen3_5_moe` nests one as text_config
# Upstream layer_types values -> mkc layer kinds (the phase names a schedule uses).
LAYER_KINDS = {"linear_attention": "gdn", "full_attention": "gqa"}

# Checkpoint layout, as for Qwen3.5 text: the published checkpoint is the multimodal
# Qwen3_5MoeForConditionalGeneration, text weights under model.language_model.; the vision
# tower and the multi-token-prediction head are not part of the decode step
# (upstream Qwen3_5MoeForCausalLM: _keys_to_ignore_on_load_unexpected = ^mtp.*, ^model.visual.*;
# transformers' conversion mapping for qwen3_5_moe_text starts with qwen3_5_text's prefix change).
RENAMED_PREFIXES = (("model.language_model.", "model."),)
SKIPPED_PREFIXES = ("model.visual.", "mtp.")
# Routed experts load fused or per expert (`mkc.layers.moe.EXPERT_LAYOUTS`): checked against
# huggingface/transformers main, src/transformers/conversion_mapping.py (qwen3_5_moe_text:
# qwen3_5_text's prefix change plus qwen2_moe's converters) and modeling_qwen3_5_moe.py.

# Upstream Qwen3_5MoeTextConfig defaults, for keys a config.json omits (as HF does): the one
# table the compiler and the reference read (through `read_dims`).
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    **DEFAULTS,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
}


@dataclass(frozen=True)
class Qwen35MoeDims(GatedDeltaNetDims):
    """The hybrid's attention dims (with `layer_kinds` per sublayer: the attention kind, then
    `moe`) and a sparse MoE in every layer. Upstream key names, except `experts`
    (num_experts) and `top_k` (num_experts_per_tok), the names the core reads. There is no
    `intermediate_size`: no dense MLP, and upstream's MoE config has no such key."""

    experts: int
    top_k: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool          # always True: upstream renormalises the top-k weights


def check_moe_keys(raw: Mapping) -> None:
    """ConfigError for MoE settings upstream Qwen3.5 MoE does not compute."""
    dense_layers = raw.get("mlp_only_layers") or []
    if dense_layers:
        raise ConfigError(f"mlp_only_layers = {dense_layers!r}: dense MLP layers are not supported",
                          "upstream Qwen3.5 MoE has a sparse MoE block in every layer; "
                          "write \"mlp_only_layers\": [] or leave the key out")
    step = raw.get("decoder_sparse_step")
    step = 1 if step is None else config_int(step, "decoder_sparse_step")
    if step != 1:
        raise ConfigError(f"decoder_sparse_step = {step!r}: only every layer sparse (1) is supported",
                          "upstream Qwen3.5 MoE has a sparse MoE block in every layer; "
                          "write \"decoder_sparse_step\": 1 or leave the key out")
    if raw.get("norm_topk_prob") not in (None, True):
        raise ConfigError(f"norm_topk_prob = {raw['norm_topk_prob']!r}: the top-k routing weights "
                          "are always renormalised",
                          "upstream Qwen3_5MoeTopKRouter divides the chosen probabilities by their "
                          "sum unconditionally; write \"norm_topk_prob\": true or leave the key out")


def read_dims(raw: Mapping, name: str) -> Qwen35MoeDims:
    """The dimensions, the one reader of a config (the reference builds its config from them);
    ConfigError for unsupported settings, KeyError / ValueError / TypeError for a malformed
    config."""
    check_moe_keys(raw)
    moe = {key: config_int(setting(raw, key, UPSTREAM_DEFAULTS), key) for key in (
        "num_experts", "num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")}
    if not 1 <= moe["num_experts_per_tok"] <= moe["num_experts"]:
        raise ConfigError(f"num_experts_per_tok = {moe['num_experts_per_tok']} must be in 1..num_experts "
                          f"({moe['num_experts']})", "each token picks some of the experts")
    return Qwen35MoeDims(
        family=FAMILY_NAME, **attention_fields(raw, name, UPSTREAM_DEFAULTS),
        # Two sublayers per layer: its attention kind, then the MoE.
        layer_kinds=tuple(k for t in layer_types(raw, UPSTREAM_DEFAULTS) for k in (LAYER_KINDS[t], "moe")),
        experts=moe["num_experts"], top_k=moe["num_experts_per_tok"],
        moe_intermediate_size=moe["moe_intermediate_size"],
        shared_expert_intermediate_size=moe["shared_expert_intermediate_size"],
        norm_topk_prob=True,
    )
