"""Muse Spark text dimensions from an upstream `MuseSparkTextConfig`-style config.json
(transformers 5.25, `models/muse_spark/configuration_muse_spark.py`; the omni checkpoint nests
it as `text_config`). Defaults below are that class's; `vocab_used` (the ids the tokenizer
emits: the rest of the embedding rows are untrained padding) is mkc's key, from the hand
kernel's `musespark/config.py` (Inferact/tpu-megakernels: 201818 of 202048), the whole
vocabulary when absent.

Per layer: GQA attention, full on `full_attention` layers (without rotary embedding: their
`layer_rope_theta` is 0) and windowed on `sliding_attention` layers (rotary at `rope_theta`),
then the latent MoE; the config reader refuses what the kinds do not compute: another rope
type, rotary on a full layer or none on a sliding one, a dense MLP layer, biases, tied
embeddings, another activation."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.layers.config import attention_heads, layer_types, refuse, setting
from mkc.layers.gqa import GQADims
from mkc.layers.moe.options import nvfp4_expert_fields
from mkc.layers.rope import read_rope
from mkc.model.family import ConfigError, config_float, config_int, identifier

FAMILY_NAME = "muse_spark"
MODEL_TYPES = ("muse_spark_text", "muse_spark", "musespark1x_omni")
LAYER_KINDS = {"sliding_attention": "swa", "full_attention": "full"}
# The MoE of the layers an NVFP4 checkpoint keeps bf16 (its quantization's excluded modules):
# a kind of its own, its experts held as stored (`mkc.layers.moe.MoE.graph_fields`)
MOE_BF16 = "moe_bf16"
# Checkpoint layout (`MuseSparkForConditionalGeneration`): the text model under
# `model.language_model.`, its `lm_head.` at the top; the vision and audio towers, their
# adapters and projection are skipped (decode reads text only).
RENAMED_PREFIXES = (("model.language_model.", "model."),)
SKIPPED_PREFIXES = ("model.vision_tower.", "model.vision_adapter.", "model.vision_projection.",
                    "model.audio_tower.")

DEFAULTS: dict[str, Any] = {
    "vocab_size": 202048, "hidden_size": 8192, "num_hidden_layers": 62, "num_attention_heads": 128,
    "num_key_value_heads": 16, "head_dim": 64, "rms_norm_eps": 1e-5, "sliding_window": 2048,
    "final_logit_softcapping": 20.0, "qk_scale_factor": 5.4730064863875,
    "output_multiplier": 0.1767766952966369, "post_norm_eps": 1e-8, "hidden_act": "silu",
    "moe_intermediate_size": 4096, "num_local_experts": 256, "num_experts_per_tok": 8,
    "routed_scaling_factor": 1.0, "moe_hidden_size": 4096, "residual_gate_temperature": 0.3,
    "rope_theta": 500000.0, "tie_word_embeddings": False, "attention_bias": False,
}
REFUSED = {
    "hidden_act": ("silu", "Muse Spark's experts are SwiGLU: \"hidden_act\": \"silu\""),
    "attention_bias": (False, "Muse Spark's projections have no biases: \"attention_bias\": false"),
    "tie_word_embeddings": (False, "the kernel streams its own lm_head.weight: "
                                   "\"tie_word_embeddings\": false"),
}


@dataclass(frozen=True)
class MuseSparkDims(GQADims):
    """Upstream key names, except `experts` (num_local_experts) and `top_k`
    (num_experts_per_tok), the names the core reads; `layer_kinds` one per sublayer: the
    attention kind (`swa` or `full`), then `moe` (`moe_bf16` where the checkpoint keeps the
    layer's experts bf16)."""

    sliding_window: int
    qk_scale_factor: float
    post_norm_eps: float
    residual_gate_temperature: float
    output_multiplier: float
    final_logit_softcapping: float
    vocab_used: int
    experts: int
    top_k: int
    moe_intermediate_size: int
    moe_hidden_size: int
    routed_scaling_factor: float
    norm_topk_prob: bool          # always: upstream divides the picked scores by their sum
    # "nvfp4" where the checkpoint's routed experts are NVFP4 (`quantization_config`'s
    # `quant_algo`, the `-NVFP4` release), "" where they are bf16
    expert_checkpoint: str = ""
    # the layers whose routed experts that checkpoint keeps bf16 (its quantization's excluded
    # modules: 0 and 61 in the release)
    expert_checkpoint_bf16_layers: tuple[int, ...] = ()


def _full_every_fourth_from_last(n: int) -> list[str]:
    """`MuseSparkTextConfig`'s default: full attention on every 4th layer counted back from the
    last."""
    return ["full_attention" if (n - 1 - i) % 4 == 0 else "sliding_attention" for i in range(n)]


def check_layers(raw: Mapping, types: list[str], theta: float) -> None:
    """ConfigError unless every layer's MLP is sparse and exactly the full layers are NoPE."""
    mlp = raw.get("mlp_layer_types")
    if mlp is not None and (len(mlp) != len(types) or set(mlp) != {"sparse"}):
        raise ConfigError(f"mlp_layer_types = {mlp!r}: only a sparse MoE in every layer is supported",
                          "write \"sparse\" for every layer, as the released checkpoint does")
    thetas = raw.get("layer_rope_theta")
    want = [0.0 if t == "full_attention" else theta for t in types]
    if thetas is not None and [config_float(t, "layer_rope_theta") for t in thetas] != want:
        raise ConfigError(f"layer_rope_theta = {thetas!r}: mkc computes the full-attention layers "
                          "without rotary embedding and the sliding ones at rope_theta",
                          "write 0 for each full_attention layer and rope_theta for the others")


def read_dims(top: Mapping, name: str) -> MuseSparkDims:
    """The one reader of a Muse Spark text config (an omni config's `text_config`);
    ConfigError for a setting mkc does not compute."""
    text = top.get("text_config")
    raw = text if isinstance(text, Mapping) else top
    refuse(raw, REFUSED, DEFAULTS)
    ints = {key: config_int(setting(raw, key, DEFAULTS), key) for key in (
        "hidden_size", "num_hidden_layers", "vocab_size", "sliding_window", "moe_intermediate_size",
        "num_local_experts", "num_experts_per_tok", "moe_hidden_size")}
    floats = {key: config_float(setting(raw, key, DEFAULTS), key) for key in (
        "rms_norm_eps", "qk_scale_factor", "post_norm_eps", "residual_gate_temperature",
        "output_multiplier", "final_logit_softcapping", "routed_scaling_factor")}
    n = ints["num_hidden_layers"]
    heads = attention_heads(raw | {"head_dim": setting(raw, "head_dim", DEFAULTS)}, ints["hidden_size"],
                            config_int(setting(raw, "num_attention_heads", DEFAULTS), "num_attention_heads"),
                            config_int(setting(raw, "num_key_value_heads", DEFAULTS), "num_key_value_heads"))
    rope = read_rope(raw, heads["head_dim"], DEFAULTS["rope_theta"], ("default",))
    types = layer_types(raw, n, LAYER_KINDS, _full_every_fourth_from_last, "Muse Spark configs")
    check_layers(raw, types, rope["rope_theta"])
    experts, top_k = ints.pop("num_local_experts"), ints.pop("num_experts_per_tok")
    if not 1 <= top_k <= experts:
        raise ConfigError(f"num_experts_per_tok = {top_k} must be in 1..num_local_experts ({experts})",
                          "each token picks some of the experts")
    vocab_used = config_int(raw.get("vocab_used", ints["vocab_size"]), "vocab_used")
    if vocab_used > ints["vocab_size"]:
        raise ConfigError(f"vocab_used = {vocab_used} exceeds vocab_size ({ints['vocab_size']})",
                          "vocab_used counts the ids the tokenizer emits, the first rows")
    checkpoint = _checkpoint_fields(raw, top, n)
    bf16 = checkpoint.get("expert_checkpoint_bf16_layers", ())
    return MuseSparkDims(
        family=FAMILY_NAME, name=identifier(name), **ints, **floats, **heads,
        rotary_dim=rope["rotary_dim"], rope_theta=rope["rope_theta"],
        layer_kinds=tuple(k for i, t in enumerate(types)
                          for k in (LAYER_KINDS[t], MOE_BF16 if i in bf16 else "moe")),
        experts=experts, top_k=top_k, vocab_used=vocab_used, norm_topk_prob=True, **checkpoint)


def _checkpoint_fields(raw: Mapping, top: Mapping, layers: int) -> dict[str, Any]:
    """The experts' checkpoint (`mkc.layers.moe.options.nvfp4_expert_fields`), from the text
    config's `quantization_config` or the omni config's."""
    quant = raw.get("quantization_config", top.get("quantization_config"))
    if quant is not None and not isinstance(quant, Mapping):
        raise ConfigError("quantization_config must be an object", "ModelOpt's, as the -NVFP4 release has")
    return nvfp4_expert_fields(quant, layers)
