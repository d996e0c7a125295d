"""Qwen3.5's weights: the layer library's, as `graph.LAYERS` composes them (Qwen3.5 MoE's
attention sublayers are these too)."""
from mkc.families.qwen3_5.graph import LAYERS
from mkc.layers.weights import DecoderWeights

_WEIGHTS = DecoderWeights(LAYERS)
matrix, layer_vector, reference_states = _WEIGHTS.matrix, _WEIGHTS.layer_vector, _WEIGHTS.reference_states
head_vectors, embedding, kernel_states = _WEIGHTS.head_vectors, _WEIGHTS.embedding, _WEIGHTS.kernel_states
