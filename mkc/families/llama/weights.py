"""Llama's weights: the layer library's, as `graph.LAYERS` composes them."""
from mkc.families.llama.graph import LAYERS
from mkc.layers.weights import DecoderWeights

_WEIGHTS = DecoderWeights(LAYERS)
matrix, layer_vector, reference_states = _WEIGHTS.matrix, _WEIGHTS.layer_vector, _WEIGHTS.reference_states
head_vectors, embedding, kernel_states = _WEIGHTS.head_vectors, _WEIGHTS.embedding, _WEIGHTS.kernel_states
