"""Qwen3-MoE's reference decode step (transformers' `Qwen3MoeForCausalLM`): the layer library's
(`mkc.layers.decode`) for the family's composition, GQA then the MoE each model layer; final
norm plain, untied lm_head. The harness records the MoE's picks through `route` and
`selection_scores`."""
from mkc.families.qwen3_moe import FAMILY
from mkc.layers.decode import DecoderReference
from mkc.layers.moe.reference import route, selection_scores  # noqa: F401
from mkc.layers.sublayer import paired

load_config, param_shapes, init_params, init_cache, decode_step = DecoderReference.of(
    FAMILY, model_layer=paired).functions()
