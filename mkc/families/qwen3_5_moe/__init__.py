"""Qwen3.5 MoE (`qwen3_5_moe_text`): Qwen3.5's gated delta net and gated attention layers, each
followed by a sparse MoE (softmax top-k router, many small SwiGLU experts, a sigmoid-gated
shared expert). Lowered by the generic module template: its own code is its config reader,
graph, weight layout, routing op and compute bodies."""
from mkc.layers.rope import rope_input
from mkc.families.qwen3_5_moe.config import (EXPERT_LAYOUTS, FAMILY_NAME, RENAMED_PREFIXES, SKIPPED_PREFIXES,
                                             read_dims)
from mkc.families.qwen3_5_moe.graph import LAYERS, ROUNDING_FORMATS, SHARD_CLASSES, WEIGHT_FORMATS, build
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=(FAMILY_NAME,), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.qwen3_5_moe.config", "Qwen35MoeDims"),
    # Not yet measured by benchmarks/vmem_probe.py: Qwen3.5's points, whose attention bodies
    # these layers share (the MoE bodies unroll per row like its MLP).
    vmem_inputs=rope_input, layers=LAYERS,
    plain_state_tolerance=1.5e-2,
    weight_formats=WEIGHT_FORMATS, rounding_formats=ROUNDING_FORMATS,
    renamed_prefixes=RENAMED_PREFIXES, skipped_prefixes=SKIPPED_PREFIXES, expert_layouts=EXPERT_LAYOUTS,
)
