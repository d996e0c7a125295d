"""Qwen3.5 MoE's reference decode step (transformers' `Qwen3_5MoeForCausalLM`, e.g.
Qwen3.5-35B-A3B): the layer library's (`mkc.layers.decode`), as `graph.LAYERS` composes it, two
loop layers a model layer: Qwen3.5's attention kinds (gated delta net `gdn`, gated attention
`gqa`), then the sparse MoE block (`Qwen3_5MoeSparseMoeBlock`: `MoE(norm="zero_centred",
shared_expert=True)`, `mkc.layers.moe.reference`), whose router always divides the top-k
probabilities by their sum (the config reader refuses ``norm_topk_prob`` false). Zero-centred
final norm, untied lm_head.

Parameter names are upstream's, per layer ``model.layers.{i}.mlp.``: ``gate.weight [E, H]``,
``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``,
``shared_expert.{gate,up}_proj.weight [S, H]``, ``shared_expert.down_proj.weight [H, S]``,
``shared_expert_gate.weight [1, H]``. The fused expert tensors are what the modeling file
declares; that the published BF16 checkpoint stores them so (under ``model.language_model.``,
693 text tensors for the 35B) was established from third-party manifests of its safetensors,
not from the Hub files themselves. A checkpoint with per-expert tensors (the Qwen2/3-MoE layout)
loads too: ``mkc.checkpoint`` fuses them (``mkc.layers.moe.EXPERT_LAYOUTS``)."""
from __future__ import annotations

import dataclasses
import math

import numpy as np

from mkc.families.qwen3_5_moe.config import MODEL_TYPES, Qwen35MoeDims, read_dims
from mkc.families.qwen3_5_moe.graph import DELTA_NET, GATED_ATTENTION, LAYERS
from mkc.layers.decode import DecoderReference, norms_last
from mkc.layers.gated_delta_net import GatedDeltaNetDims
from mkc.layers.moe.reference import route, selection_scores  # noqa: F401
from mkc.layers.sublayer import paired
from mkc.layers.swiglu import SwiGLU
from mkc.reference.rounding import bf16_weights

_REFERENCE = DecoderReference(LAYERS, read_dims, MODEL_TYPES, final_norm="zero_centred",
                              model_layer=paired)
load_config, param_shapes = _REFERENCE.load_config, _REFERENCE.param_shapes
init_cache, decode_step = _REFERENCE.init_cache, _REFERENCE.decode_step

# The attention tensors' random draws: those of dense Qwen3.5's composition (each attention
# kind then a SwiGLU, its layer norms drawn last), the order the recorded MINI results were
# drawn in.
_DENSE_DRAWS = DecoderReference(
    {kind: (attention, SwiGLU(norm="zero_centred")) for kind, attention in (("gdn", DELTA_NET),
                                                                            ("gqa", GATED_ATTENTION))},
    read_dims, MODEL_TYPES, final_norm="zero_centred", draw_rank=norms_last)


@dataclasses.dataclass(frozen=True)
class _DenseDims(GatedDeltaNetDims):
    intermediate_size: int


def init_params(d: Qwen35MoeDims, seed: int) -> dict[str, np.ndarray]:
    """Random bf16 parameters keeping the residual stream and logits O(1): every attention
    tensor drawn as dense Qwen3.5 draws it (`_DENSE_DRAWS`, with a dense MLP of width 1 whose
    draws are dropped); the MoE's N(0, 1/fan_in) from a stream of their own, those writing into
    the residual stream (``experts.down_proj``, ``shared_expert.down_proj``) further scaled by
    1/sqrt(2 layers)."""
    attention = {f.name: getattr(d, f.name) for f in dataclasses.fields(GatedDeltaNetDims)}
    mixers = _DENSE_DRAWS.init_params(_DenseDims(**attention | dict(
        layer_kinds=tuple(k for k in d.layer_kinds if k != "moe"), intermediate_size=1)), seed)
    rng = np.random.default_rng([seed, 1])
    residual_scale = 1.0 / math.sqrt(2 * d.num_hidden_layers)
    out: dict[str, np.ndarray] = {}
    for name, (shape, _) in param_shapes(d).items():
        if ".mlp." not in name:
            out[name] = mixers[name]
            continue
        std = 1.0 / math.sqrt(shape[-1])
        if name.endswith(("experts.down_proj", "shared_expert.down_proj.weight")):
            std *= residual_scale
        out[name] = bf16_weights(rng.normal(0.0, std, shape))
    return out


def count_parameters(d: Qwen35MoeDims, active: bool = False) -> int:
    """Parameters of ``param_shapes``; ``active``: those one decode token reads, i.e. without the
    ``E - top_k`` routed experts it does not pick and without all but one embedding row."""
    total = 0
    for name, (shape, _) in param_shapes(d).items():
        n = math.prod(shape)
        if active and name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
            n = n // d.experts * d.top_k
        elif active and name == "model.embed_tokens.weight":
            n = d.hidden_size
        total += n
    return total
