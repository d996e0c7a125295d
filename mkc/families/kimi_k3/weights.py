"""Kimi K3's weights: the layer library's, as `graph.LAYERS` composes them (`DecoderWeights`),
its routed experts from Kimi's per-expert MXFP4 by the library MoE's layout of them
(`mkc.layers.moe.weights.packed_mxfp4_expert`), in the spec's format."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mkc.families.kimi_k3.config import KimiDims
from mkc.families.kimi_k3.graph import LAYERS, MOE
from mkc.ir import WeightFormat
from mkc.layers.block_residuals import weights as block_weights
from mkc.layers.moe import weights as moe_weights
from mkc.layers.sublayer import paired
from mkc.layers.weights import DecoderWeights
from mkc.model.sharding import ShardTable

# Every tensor asked of the library kind that owns it (the routed experts: the MoE's
# compressed-tensors MXFP4 layout); model layer = loop layer // 2 (the attention, then the MLP).
_WEIGHTS = DecoderWeights(LAYERS, model_layer=paired)
matrix, layer_vector, embedding = _WEIGHTS.matrix, _WEIGHTS.layer_vector, _WEIGHTS.embedding
reference_states, kernel_states = _WEIGHTS.reference_states, _WEIGHTS.kernel_states
expert, requantization = _WEIGHTS.expert, _WEIGHTS.requantization


def expert_arrays(hf: Mapping[str, np.ndarray], d: KimiDims, layer: int, expert: int, rank: int,
                  expert_tp: int, formats: Mapping[str, WeightFormat] | None = None
                  ) -> dict[str, np.ndarray]:
    """Model layer `layer`'s routed expert `expert` as rank `rank` holds it (its width slice of
    `expert_tp`), by the library MoE (`mkc.layers.moe.weights.packed_mxfp4_expert`)."""
    return moe_weights.packed_mxfp4_expert(MOE, hf, d, f"model.layers.{layer}.", expert, rank,
                                           rank % expert_tp, expert_tp, formats)


def head_vectors(hf: Mapping[str, np.ndarray], d: KimiDims, rank: int, shards: ShardTable) -> np.ndarray:
    """The final norm, then the output mixture's norm and projection."""
    return np.concatenate([_WEIGHTS.head_vectors(hf, d, rank, shards), block_weights.head_vectors(hf)])
