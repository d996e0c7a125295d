"""Muse Spark's reference decode step (transformers 5.25 `MuseSparkForConditionalGeneration`'s
text path): the layer library's (`mkc.layers.decode`) for the family's composition
(`graph.LAYERS`), two loop layers a model layer, under the gated residuals
(`mkc.layers.gated_residuals.reference`), the logits soft-capped and the unused vocabulary
masked. In f32 with every dot at ``Precision.HIGHEST``; with a `Rounding`, the kernel's rounding
emulation (each kind's reference). The math and the state layouts are each kind's (its
reference module's docstring); the config keys `config.read_dims`'s.
"""
from mkc.families.muse_spark.config import MODEL_TYPES, read_dims
from mkc.families.muse_spark.graph import LAYERS
from mkc.layers.decode import DecoderReference, norms_last
from mkc.layers.gated_residuals.reference import GATED_RESIDUALS
from mkc.layers.moe.reference import route, selection_scores  # noqa: F401
from mkc.layers.sublayer import paired

load_config, param_shapes, init_params, init_cache, decode_step = DecoderReference(
    LAYERS, read_dims, MODEL_TYPES, model_layer=paired, draw_rank=norms_last,
    residuals=GATED_RESIDUALS, softcap=True).functions()
