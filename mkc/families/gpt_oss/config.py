"""GPT-OSS dimensions from an upstream `GptOssConfig`-style config.json: the family's one config
reader (the reference builds its config from these dims). The facts and their sources are in
the package docstring (`mkc/families/gpt_oss/__init__.py`)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mkc.layers import config as layer_config
from mkc.layers.rope import read_yarn
from mkc.model.contracts import Dims
from mkc.model.family import ConfigError, config_float, config_int, identifier

FAMILY_NAME = "gpt_oss"
MXFP4_BLOCK = 32      # values per E8M0 scale: the contraction axes of both expert matrices

# Upstream layer_types values -> mkc layer kinds (a schedule's phase names); every layer's
# attention sublayer is followed by its MoE sublayer, kind `moe`.
LAYER_KINDS = {"sliding_attention": "swa", "full_attention": "gqa"}
MOE_KIND = "moe"

# Upstream GptOssConfig defaults (configuration_gpt_oss.py; the class documents
# openai/gpt-oss-120b's sizes), for keys a config.json omits or sets to null.
UPSTREAM_DEFAULTS: dict[str, Any] = {
    "num_hidden_layers": 36,
    "num_local_experts": 128,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "num_experts_per_tok": 4,
    "swiglu_alpha": 1.702,
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "rope_theta": 150000.0,
    "max_position_embeddings": 131072,
}
# GptOssConfig.__post_init__'s rope_parameters when the config gives none.
DEFAULT_ROPE: dict[str, Any] = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                                "beta_slow": 1.0, "truncate": False,
                                "original_max_position_embeddings": 4096}

# GptOssConfig's attribute_map: another name transformers reads the expert count by.
ALIASES = {"num_experts": "num_local_experts"}

@dataclass(frozen=True)
class GptOssDims(Dims):
    """One GPT-OSS model. Upstream key names, except `experts` (num_local_experts) and `top_k`
    (num_experts_per_tok), the names the core reads, and the YaRN fields, which hold what
    upstream's `_compute_yarn_parameters` derives from `rope_scaling`: the ramp between the
    interpolated and the original frequencies runs over rotary pair indices `yarn_low` ..
    `yarn_high` (already floored / ceiled when `truncate`), and cos and sin are multiplied by
    `yarn_attention_factor`."""

    rms_norm_eps: float
    layer_kinds: tuple[str, ...]      # per layer: "swa" or "gqa", then "moe"
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    sliding_window: int
    rope_theta: float
    yarn_factor: float
    yarn_low: float = field(metadata={"any_sign": True})    # may be 0 (clamped at 0 upstream)
    yarn_high: float
    yarn_attention_factor: float
    experts: int
    top_k: int
    intermediate_size: int
    swiglu_alpha: float
    swiglu_limit: float

    @property
    def moe_intermediate_size(self) -> int:
        """An expert's width, by the name the library's MoE reads."""
        return self.intermediate_size

    @property
    def rotary_dim(self) -> int:
        """RoPE rotates whole heads."""
        return self.head_dim

    @property
    def rope_type(self) -> str:
        """The rotary scaling, by the name the library's rope reads (`mkc.layers.rope`)."""
        return "yarn"

    @property
    def attention_types(self) -> tuple[str, ...]:
        """Upstream layer_types: "sliding_attention" or "full_attention" per layer."""
        upstream = {kind: t for t, kind in LAYER_KINDS.items()}
        return tuple(upstream[k] for k in self.layer_kinds if k != MOE_KIND)


def setting(raw: Mapping, key: str) -> Any:
    """A config value, or the upstream default for a key the config omits or sets to null."""
    return layer_config.setting(raw, key, UPSTREAM_DEFAULTS)


def layer_types(raw: Mapping, layers: int) -> list[str]:
    """Upstream layer_types, or GptOssConfig's default pattern (sliding at even layers)."""
    return layer_config.layer_types(
        raw, layers, LAYER_KINDS,
        lambda n: ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(n)],
        "the published gpt-oss configs")


def check_settings(raw: Mapping) -> None:
    """ConfigError for settings neither the reference nor (later) the lowering computes."""
    layer_config.refuse(raw, {
        "hidden_act": ("silu", "GPT-OSS experts apply the clamped SwiGLU of GptOssExperts whatever "
                               "hidden_act says; the published configs write \"hidden_act\": \"silu\""),
        "attention_bias": (True, "the gpt-oss checkpoints carry q/k/v/o projection biases: write "
                                 "\"attention_bias\": true or leave the key out"),
        "tie_word_embeddings": (False, "gpt-oss ships its own lm_head.weight: write "
                                       "\"tie_word_embeddings\": false")}, UPSTREAM_DEFAULTS)
    if "sliding_window" in raw and raw["sliding_window"] is None:
        raise ConfigError("sliding_window is null: upstream then gives its sliding_attention "
                          "layers no window", "give the window in tokens (128 in gpt-oss)")
    quant = raw.get("quantization_config")
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    if method != "mxfp4":
        raise ConfigError(f"quantization_config.quant_method is {method!r}: mkc reads the routed "
                          "experts as MXFP4 *_blocks / *_scales tensors",
                          "use the published checkpoint's config: \"quantization_config\": "
                          "{\"quant_method\": \"mxfp4\", ...}")


def rope_parameters(raw: Mapping) -> Mapping:
    """The config's YaRN parameters (`rope_parameters`, or the published `rope_scaling`)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or DEFAULT_ROPE
    if not isinstance(params, Mapping):
        raise ValueError(f"rope_scaling must be an object, not {params!r}")
    rope_type = params.get("rope_type", params.get("type"))
    if rope_type != "yarn":
        raise ConfigError(f"rope_type = {rope_type!r} is not supported",
                          "GPT-OSS uses YaRN: \"rope_type\": \"yarn\", as the published configs do")
    if config_float(params.get("partial_rotary_factor", 1.0), "rope_scaling.partial_rotary_factor") != 1.0:
        raise ConfigError("partial_rotary_factor must be 1: GPT-OSS rotates whole heads",
                          "leave partial_rotary_factor out")
    if params.get("original_max_position_embeddings") is None:
        raise ConfigError("rope_scaling has no original_max_position_embeddings, which YaRN needs",
                          "give the pre-extension context (4096 in gpt-oss)")
    return params


def yarn(raw: Mapping, head_dim: int) -> dict[str, float]:
    """rope_theta and the YaRN fields of GptOssDims, as upstream's `_compute_yarn_parameters`
    derives them (modeling_rope_utils.py; the layer library's `read_yarn`)."""
    fields = read_yarn(raw, rope_parameters(raw), head_dim, setting(raw, "rope_theta"),
                       setting(raw, "max_position_embeddings"))
    del fields["yarn_mscale"]       # a softmax scale of MLA's: GPT-OSS scales by head_dim alone
    return fields


def read_dims(raw: Mapping, name: str) -> GptOssDims:
    """The dimensions, the one reader of a config; ConfigError for a setting mkc does not
    compute, KeyError / ValueError / TypeError for a malformed config."""
    raw = layer_config.with_aliases(raw, ALIASES)
    check_settings(raw)
    ints = {key: config_int(setting(raw, key), key) for key in (
        "hidden_size", "num_hidden_layers", "vocab_size", "num_attention_heads",
        "num_key_value_heads", "head_dim", "sliding_window", "num_local_experts",
        "num_experts_per_tok", "intermediate_size")}
    if ints["num_key_value_heads"] < 1 or ints["num_attention_heads"] % ints["num_key_value_heads"]:
        raise ConfigError(f"num_attention_heads ({ints['num_attention_heads']}) must be a multiple of "
                          f"num_key_value_heads ({ints['num_key_value_heads']})",
                          "each group of query heads shares one key/value head")
    if ints["head_dim"] % 2:
        raise ConfigError(f"head_dim = {ints['head_dim']} must be even", "RoPE rotates pairs of dims")
    for key in ("hidden_size", "intermediate_size"):
        if ints[key] % MXFP4_BLOCK:
            raise ConfigError(f"{key} = {ints[key]} is not a multiple of {MXFP4_BLOCK}",
                              f"the MXFP4 expert matrices contract over it in blocks of {MXFP4_BLOCK}")
    if not 1 <= ints["num_experts_per_tok"] <= ints["num_local_experts"]:
        raise ConfigError(f"num_experts_per_tok = {ints['num_experts_per_tok']} must be in "
                          f"1..num_local_experts ({ints['num_local_experts']})",
                          "each token picks some of the experts")
    types = layer_types(raw, ints["num_hidden_layers"])
    return GptOssDims(
        family=FAMILY_NAME, name=identifier(name), hidden_size=ints["hidden_size"],
        num_hidden_layers=ints["num_hidden_layers"], vocab_size=ints["vocab_size"],
        rms_norm_eps=config_float(setting(raw, "rms_norm_eps"), "rms_norm_eps"),
        layer_kinds=tuple(k for t in types for k in (LAYER_KINDS[t], MOE_KIND)),
        num_attention_heads=ints["num_attention_heads"],
        num_key_value_heads=ints["num_key_value_heads"], head_dim=ints["head_dim"],
        sliding_window=ints["sliding_window"], **yarn(raw, ints["head_dim"]),
        experts=ints["num_local_experts"], top_k=ints["num_experts_per_tok"],
        intermediate_size=ints["intermediate_size"],
        swiglu_alpha=config_float(setting(raw, "swiglu_alpha"), "swiglu_alpha"),
        swiglu_limit=config_float(setting(raw, "swiglu_limit"), "swiglu_limit"))
