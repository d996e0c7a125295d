"""Kimi K3's reference decode step: the layer library's (`mkc.layers.decode`) for the family's
composition (`graph.LAYERS`), two loop layers a model layer, under block attention residuals
(`mkc.layers.block_residuals.reference`). In f32, every dot at ``Precision.HIGHEST``, bf16
weights upcast and the MXFP4 routed experts decoded exactly (``mkc.model.mxfp4``); with a
`Rounding`, the kernel's rounding emulation (each kind's reference: `mkc.numerics` has how it
was made to sum in the kernel's f32 order).

Sources. Parameter names and equations follow the released checkpoint contract as read by the
public hand-written megakernel ``Inferact/tpu-megakernels`` (``kimi/__init__.py``,
``kimi/load.py``, ``kimi/decode_megakernel.py``), and, for names it inherits, upstream Kimi Linear
(``modeling_kimi.py``: KDA, MLA, ``block_sparse_moe``). The released checkpoint nests the text
tower under ``language_model.`` (``mkc.checkpoint`` renames it); names here are the text-only
``model.`` / ``lm_head.`` ones. Config keys: `config.read_dims`.

Per layer (B rows, one token each; ``rms(x, w) = x * rsqrt(mean(x^2) + eps) * w``, plain weight):

* attention residuals (Block AttnRes, `mkc.layers.block_residuals.reference`): each sublayer and
  the final norm read a learned softmax mixture of the embedding, the completed blocks of
  ``attn_res_block_size`` layers and the block being filled;
* attention input ``rms(mix, input_layernorm)``; KDA (``linear_attention``,
  `mkc.layers.kda.reference`) or gated NoPE MLA (``full_attention``, `mkc.layers.mla.reference`);
* MLP input ``rms(mix, post_attention_layernorm)``; layers ``< first_k_dense_replace`` a dense
  ``mlp`` (`mkc.layers.swiglu.reference`), the rest the latent ``block_sparse_moe``
  (`mkc.layers.moe.reference`: sigmoid router, the correction bias picking only, weights the
  picked scores over their sum times ``routed_scaling_factor``; the routed experts on
  ``routed_expert_down_proj(x)``, their weighted sum normed by ``routed_expert_norm`` and
  projected back by ``routed_expert_up_proj``; plus the ungated shared experts on x); every GLU
  is SiTU ``4 tanh(g/4) sigmoid(g) * 25 tanh(u/25)``. Routed experts ``w1`` (gate), ``w3`` (up),
  ``w2`` (down) are MXFP4: ``weight_packed`` uint8 ``[out, in/2]``, ``weight_scale`` E8M0
  ``[out, in/32]``.

State: the KDA's ``layers.{i}.conv_state`` bf16 ``[B, 3P, K-1]`` and ``recurrent_state`` f32
``[B, heads, D, D]``; the MLA's ``layers.{i}.latent_cache`` bf16 ``[B, T, kv_lora_rank +
qk_rope_head_dim]``. The KDA states advance by one token per call whatever the position.
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
