"""Muse Spark (`muse_spark`, Muse-Spark-Open-816B-A42B): GQA attention, windowed with rotary
embedding on three of four layers and full without it on the fourth, a latent MoE of 256
SwiGLU experts, gated norm-preserving residuals, soft-capped logits. Its own code is its config
reader (`config.py`) and its composition of the layer library (`graph.py`); its bodies,
weights and reference are the library's as the composition says. Configs
`mkc/model/configs/muse_spark{,_mini}{,_nvfp4}.json` (the bf16 checkpoint's and the NVFP4
release's); facts and sources in `config.py` and each kind. The f32 reference against
transformers 5.25's `MuseSparkForConditionalGeneration` on the MINI: 1.2e-05 of the largest
logit over 12 steps (`benchmarks/transformers_parity.py --family muse_spark`, docs/parity.md)."""
from mkc.families.muse_spark.config import (FAMILY_NAME, MODEL_TYPES, RENAMED_PREFIXES, SKIPPED_PREFIXES,
                                            read_dims)
from mkc.families.muse_spark.graph import LAYERS, MOE, SHARD_CLASSES, WEIGHT_FORMATS, build
from mkc.layers.moe import EXPERT_LAYOUTS, ROUNDING_FORMATS
from mkc.layers.rope import rope_input
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=MODEL_TYPES, read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.muse_spark.config", "MuseSparkDims"),
    vmem_inputs=rope_input, layers=LAYERS, final_logits=True,
    # bf16-staged activations against f32 everywhere, on random MINI weights: the scores'
    # 5.47 / sqrt(64) scale on unit-normed q and k and every normed branch entering the stream
    # undamped amplify them to 4.3 % of the largest logit (batch 8, step 1; 2.2 % at batch 2),
    # the kernel bit-equal to its emulation throughout
    plain_logits_tolerance=0.06,
    weight_formats=WEIGHT_FORMATS, model_formats=MOE.weight_formats, rounding_formats=ROUNDING_FORMATS,
    dense_classes=("attention", "latent", "lm_head"),
    renamed_prefixes=RENAMED_PREFIXES, skipped_prefixes=SKIPPED_PREFIXES, expert_layouts=EXPERT_LAYOUTS,
)
