"""DeepSeek-V3's reference decode step (transformers' `DeepseekV3ForCausalLM`): the layer
library's (`mkc.layers.decode`), as `graph.LAYERS` composes it, two loop layers a model layer;
final norm plain, untied lm_head. `route` and `selection_scores` are the MoE's routing (the
harness records its picks through them)."""
from mkc.families.deepseek_v3.config import FAMILY_NAME, read_dims
from mkc.families.deepseek_v3.graph import LAYERS
from mkc.layers.decode import DecoderReference
from mkc.layers.moe.reference import route, selection_scores  # noqa: F401

_REFERENCE = DecoderReference(LAYERS, read_dims, (FAMILY_NAME,), model_layer=lambda layer: layer // 2)
load_config, param_shapes = _REFERENCE.load_config, _REFERENCE.param_shapes
init_params, init_cache, decode_step = _REFERENCE.init_params, _REFERENCE.init_cache, _REFERENCE.decode_step
