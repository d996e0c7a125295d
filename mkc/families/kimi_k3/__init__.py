"""Kimi K3 (`kimi_k3`): Kimi Delta Attention and MLA layers, a dense first MLP, then latent MoE
layers with MXFP4 routed experts and block attention residuals. Lowered by the generic module
template with its compute bodies in `lowering.py`; its KDA and MLA are the layer library's
(`graph.LAYERS`)."""
from mkc.families.kimi_k3.config import RENAMED_PREFIXES, SKIPPED_PREFIXES, read_dims
from mkc.families.kimi_k3.graph import LAYERS, MOE, SHARD_CLASSES, WEIGHT_FORMATS, build
from mkc.layers.moe import packed_expert_layouts
from mkc.model.family import Family

FAMILY = Family(
    name="kimi_k3", model_types=("kimi_k3",), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.kimi_k3.config", "KimiDims"),
    plain_state_tolerance=3e-2,
    weight_formats=WEIGHT_FORMATS, rounding_formats=("fp4",),
    dense_classes=("attention", "mlp", "shared_expert", "latent", "lm_head"),
    renamed_prefixes=RENAMED_PREFIXES, skipped_prefixes=SKIPPED_PREFIXES,
    expert_layouts=packed_expert_layouts(MOE.prefix), e8m0_suffixes=(".weight_scale",), layers=LAYERS,
)
