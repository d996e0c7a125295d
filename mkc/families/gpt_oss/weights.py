"""GPT-OSS's weights: the layer library's, as `graph.LAYERS` composes them, from the published
checkpoint (`GptOssForCausalLM`'s names); model layer = loop layer // 2 (attention, then MoE).
The attention's are the library GQA's with biases and sinks (`mkc.layers.gqa.weights`), the
MoE's the library MoE's with a biased router and MXFP4 experts moved as the checkpoint holds
them, never decoded (`mkc.layers.moe.weights.mxfp4_expert`)."""
from mkc.families.gpt_oss.graph import LAYERS
from mkc.layers.sublayer import paired
from mkc.layers.weights import DecoderWeights

_WEIGHTS = DecoderWeights(LAYERS, model_layer=paired)
matrix, layer_vector, reference_states = _WEIGHTS.matrix, _WEIGHTS.layer_vector, _WEIGHTS.reference_states
head_vectors, embedding, kernel_states = _WEIGHTS.head_vectors, _WEIGHTS.embedding, _WEIGHTS.kernel_states
expert = _WEIGHTS.expert
