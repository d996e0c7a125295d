"""Qwen3.5 MoE (`qwen3_5_moe_text`): Qwen3.5's gated delta net and gated attention layers, each
followed by the layer library's sparse MoE (softmax top-k router always renormalised, many
small SwiGLU experts, a sigmoid-gated shared expert: `mkc.layers.moe`). Its own code is its
config reader, the composition (`graph.LAYERS`, the MoE a loop layer of its own) and its
reference's parameter table and initialisation."""
from mkc.families.qwen3_5_moe.config import FAMILY_NAME, RENAMED_PREFIXES, SKIPPED_PREFIXES, read_dims
from mkc.families.qwen3_5_moe.graph import LAYERS, SHARD_CLASSES, build
from mkc.layers.moe import EXPERT_LAYOUTS, ROUNDING_FORMATS, WEIGHT_FORMATS
from mkc.layers.rope import rope_input
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=(FAMILY_NAME,), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.qwen3_5_moe.config", "Qwen35MoeDims"),
    vmem_inputs=rope_input, layers=LAYERS,
    plain_state_tolerance=1.5e-2,
    weight_formats=WEIGHT_FORMATS, rounding_formats=ROUNDING_FORMATS,
    renamed_prefixes=RENAMED_PREFIXES, skipped_prefixes=SKIPPED_PREFIXES, expert_layouts=EXPERT_LAYOUTS,
)
