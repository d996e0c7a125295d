"""DeepSeek-V3 dimensions from an upstream `DeepseekV3Config`-style config.json (transformers
5.25 `models/deepseek_v3/configuration_deepseek_v3.py`; defaults below are that class's)."""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mkc.layers.config import refuse, setting, with_aliases
from mkc.layers.mla import MLADims
from mkc.layers.rope import read_yarn, rope_parameters
from mkc.model.family import ConfigError, config_float, config_int, identifier
from mkc.model.fp8_blocks import read_quantization

FAMILY_NAME = "deepseek_v3"
DEFAULTS: dict[str, Any] = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
    "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "norm_topk_prob": True, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
    "max_position_embeddings": 4096, "rope_theta": 10000.0,
    # the reference implementation's keys upstream's class ignores: only these values compute it
    "scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1,
}
# Settings the kernel and the reference do not compute: key -> (the value they compute, hint).
REFUSED = {
    "hidden_act": ("silu", "DeepSeek-V3 MLPs are SwiGLU: \"hidden_act\": \"silu\""),
    "attention_bias": (False, "DeepSeek-V3 projections have no biases: \"attention_bias\": false"),
    "tie_word_embeddings": (False, "the kernel streams its own lm_head.weight, as DeepSeek-V3 unties it"),
    "scoring_func": ("sigmoid", "DeepSeek-V3 scores experts by a sigmoid: \"scoring_func\": \"sigmoid\""),
    "topk_method": ("noaux_tc", "DeepSeek-V3 picks by the corrected scores in the best groups: "
                                "\"topk_method\": \"noaux_tc\""),
    "moe_layer_freq": (1, "every layer past the dense ones is MoE: \"moe_layer_freq\": 1"),
}

# DeepseekV3Config's attribute_map: another name transformers reads the routed expert count by.
ALIASES = {"num_local_experts": "n_routed_experts"}

@dataclass(frozen=True)
class DeepseekV3Dims(MLADims):
    """Upstream key names, except `experts` (n_routed_experts) and `top_k`
    (num_experts_per_tok), the names the core reads; `layer_kinds` per sublayer: `mla`, then
    `dense` (the first `first_k_dense_replace` layers) or `moe`."""

    intermediate_size: int
    experts: int
    top_k: int
    moe_intermediate_size: int
    n_shared_experts: int
    norm_topk_prob: bool
    n_group: int
    topk_group: int
    routed_scaling_factor: float
    # quantization_config's: the checkpoint is FP8 with an f32 scale per [out, in] block of its
    # linear weights (`mkc.model.fp8_blocks`); () for a bf16 checkpoint
    weight_block_size: tuple[int, int] = field(default=(), metadata={"when_set": True})

    @property
    def shared_expert_intermediate_size(self) -> int:
        """The shared experts' width (`DeepseekV3MoE`: one MLP of n_shared_experts experts')."""
        return self.n_shared_experts * self.moe_intermediate_size


def read_dims(raw: Mapping, name: str) -> DeepseekV3Dims:
    """The one reader of a DeepSeek-V3 config; ConfigError for a setting mkc does not compute."""
    raw = with_aliases(raw, ALIASES)
    refuse(raw, REFUSED, DEFAULTS)
    block = read_quantization(raw)
    if raw.get("q_lora_rank", 1) is None:
        raise ConfigError("q_lora_rank = null (a q_proj without the low-rank query) is not supported",
                          "DeepSeek-V3 projects the query through q_lora_rank 1536")
    ints = {key: config_int(setting(raw, key, DEFAULTS), key) for key in (
        "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_hidden_layers",
        "num_attention_heads", "n_shared_experts", "n_routed_experts", "kv_lora_rank", "q_lora_rank",
        "qk_rope_head_dim", "v_head_dim", "qk_nope_head_dim", "n_group", "topk_group",
        "num_experts_per_tok")}
    heads, layers = ints["num_attention_heads"], ints["num_hidden_layers"]
    kv_heads = setting(raw, "num_key_value_heads", {"num_key_value_heads": heads})
    if kv_heads != heads:
        raise ConfigError(f"num_key_value_heads = {kv_heads!r} differs from num_attention_heads ({heads})",
                          "MLA's keys and values are per query head: write the head count")
    dense = config_int(setting(raw, "first_k_dense_replace", DEFAULTS), "first_k_dense_replace")
    experts, top_k, groups, top_groups = (ints.pop(k) for k in (
        "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group"))
    if not (0 <= dense <= layers and groups >= 1 and experts % groups == 0 and experts // groups >= 2
            and 1 <= top_groups <= groups and 1 <= top_k <= top_groups * (experts // groups)):
        raise ConfigError(f"first_k_dense_replace {dense}, {experts} experts in n_group {groups} "
                          f"groups, topk_group {top_groups} and num_experts_per_tok {top_k} do not route",
                          "groups of at least two experts each, top k within the best groups' experts, "
                          "at most num_hidden_layers dense layers")
    bools = {key: setting(raw, key, DEFAULTS) for key in ("norm_topk_prob", "rope_interleave")}
    for key, value in bools.items():
        if not isinstance(value, bool):
            raise ConfigError(f"{key} = {value!r} is not a boolean", "write true or false")
    rope = ints["qk_rope_head_dim"]
    if rope % 2:
        raise ConfigError(f"qk_rope_head_dim = {rope} is odd", "rotary embedding pairs its dims")
    return DeepseekV3Dims(
        family=FAMILY_NAME, name=identifier(name),
        rms_norm_eps=config_float(setting(raw, "rms_norm_eps", DEFAULTS), "rms_norm_eps"),
        layer_kinds=tuple(k for i in range(layers) for k in ("mla", "dense" if i < dense else "moe")),
        head_dim=rope, rotary_dim=rope, **rope_fields(raw, rope), **bools, **ints, experts=experts,
        top_k=top_k, n_group=groups, topk_group=top_groups,
        routed_scaling_factor=config_float(setting(raw, "routed_scaling_factor", DEFAULTS),
                                           "routed_scaling_factor"),
        **({"weight_block_size": block} if block else {}))


def rope_fields(raw: Mapping, rope: int) -> dict[str, Any]:
    """The rope part's rotary fields: upstream's default rope or its YaRN scaling."""
    params = rope_parameters(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    theta = config_float(params.get("rope_theta", setting(raw, "rope_theta", DEFAULTS)), "rope_theta")
    if rope_type == "default":
        return dict(rope_type="default", rope_theta=theta, yarn_factor=1.0, yarn_low=0.0, yarn_high=1.0,
                    yarn_attention_factor=1.0, yarn_mscale=1.0)
    if rope_type != "yarn":
        raise ConfigError(f"rope_type = {rope_type!r} is not supported",
                          "DeepSeek-V3 uses YaRN (\"type\": \"yarn\") or the default rope")
    return dict(rope_type="yarn", **read_yarn(raw, params, rope, theta, DEFAULTS["max_position_embeddings"]))
