"""DeepSeek-V3's reference decode step (transformers' `DeepseekV3ForCausalLM`): the layer
library's (`mkc.layers.decode`) for the family's composition, MLA then a dense or MoE MLP each
model layer; final norm plain, untied lm_head. The harness records the MoE's picks through
`route` and `selection_scores`."""
from mkc.families.deepseek_v3 import FAMILY
from mkc.layers.decode import DecoderReference
from mkc.layers.moe.reference import route, selection_scores  # noqa: F401
from mkc.layers.sublayer import paired

load_config, param_shapes, init_params, init_cache, decode_step = DecoderReference.of(
    FAMILY, model_layer=paired).functions()
