"""Kimi K3's reference decode step: the layer library's (`mkc.layers.decode`) for the family's
composition (`graph.LAYERS`: KDA or gated NoPE MLA, then a dense SiTU MLP or the latent MoE with
Kimi's per-expert MXFP4 experts), two loop layers a model layer, under block attention residuals
(`mkc.layers.block_residuals.reference`). In f32 with every dot at ``Precision.HIGHEST`` and the
MXFP4 experts decoded exactly; with a `Rounding`, the kernel's rounding emulation (each kind's
reference; `mkc.numerics` has how it was made to sum in the kernel's f32 order). The math and
the state layouts are each kind's (its reference module's docstring).

Sources: the released checkpoint contract as the public hand-written megakernel
``Inferact/tpu-megakernels`` reads it (``kimi/__init__.py``, ``kimi/load.py``,
``kimi/decode_megakernel.py``), and upstream Kimi Linear (``modeling_kimi.py``) for the names it
inherits. Names are the text-only ``model.`` / ``lm_head.`` ones (``mkc.checkpoint`` renames
the released ``language_model.`` tower); config keys: `config.read_dims`.
"""
from __future__ import annotations

import math

from mkc.families.kimi_k3.config import KimiDims, read_dims
from mkc.families.kimi_k3.graph import LAYERS
from mkc.layers.block_residuals.reference import BLOCK_RESIDUALS
from mkc.layers.decode import DecoderReference
from mkc.layers.moe.reference import route, selection_scores  # noqa: F401
from mkc.layers.sublayer import paired

MODEL_TYPES = ("kimi_k3", "kimi_linear")  # checkpoint top level / its text_config


def draw_rank(name: str) -> int:
    """The order a layer's random weights are drawn in (the one K3's MINI runs were measured
    on): the residual queries, the two layer norms, the attention and MLP weights, the routed
    experts."""
    if "_res_" in name:
        return 0
    if name in ("input_layernorm.weight", "post_attention_layernorm.weight"):
        return 1
    return 3 if ".experts." in name else 2


load_config, param_shapes, init_params, init_cache, decode_step = DecoderReference(
    LAYERS, read_dims, MODEL_TYPES, model_layer=paired, draw_rank=draw_rank,
    residuals=BLOCK_RESIDUALS).functions()


def count_parameters(cfg: KimiDims) -> int:
    """Logical parameter count: two weights per packed MXFP4 byte, E8M0 scales not counted."""
    total = 0
    for name, (shape, _) in param_shapes(cfg).items():
        if name.endswith(".weight_scale"):
            continue
        total += math.prod(shape) * (2 if name.endswith(".weight_packed") else 1)
    return total
