"""Llama's reference decode step (transformers' `LlamaForCausalLM`): the layer library's
(`mkc.layers.decode`), as `graph.LAYERS` composes it; final norm plain, untied lm_head."""
from mkc.families.llama.config import MODEL_TYPES, read_dims
from mkc.families.llama.graph import LAYERS
from mkc.layers.decode import DecoderReference

_REFERENCE = DecoderReference(LAYERS, read_dims, MODEL_TYPES)
load_config, param_shapes = _REFERENCE.load_config, _REFERENCE.param_shapes
init_params, init_cache, decode_step = _REFERENCE.init_params, _REFERENCE.init_cache, _REFERENCE.decode_step
