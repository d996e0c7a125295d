"""Muse Spark's weights: the layer library's, as `graph.LAYERS` composes them (`DecoderWeights`),
from the published checkpoint's names (`mkc.checkpoint` renames `model.language_model.`);
model layer = loop layer // 2 (the attention, then the MoE)."""
from mkc.families.muse_spark.graph import LAYERS
from mkc.layers.sublayer import paired
from mkc.layers.weights import DecoderWeights

_WEIGHTS = DecoderWeights(LAYERS, model_layer=paired)
matrix, layer_vector, reference_states = _WEIGHTS.matrix, _WEIGHTS.layer_vector, _WEIGHTS.reference_states
head_vectors, embedding, kernel_states = _WEIGHTS.head_vectors, _WEIGHTS.embedding, _WEIGHTS.kernel_states
expert, requantization = _WEIGHTS.expert, _WEIGHTS.requantization
