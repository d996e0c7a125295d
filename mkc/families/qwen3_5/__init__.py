"""Qwen3.5 text (`qwen3_5_text`): gated delta net and gated attention layers, dense SwiGLU MLPs."""
from mkc.families.qwen3_5.config import read_dims
from mkc.families.qwen3_5.graph import LAYERS, SHARD_CLASSES, build
from mkc.layers.rope import rope_input
from mkc.model.family import Family


FAMILY = Family(
    name="qwen3_5_text", model_types=("qwen3_5_text",), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.qwen3_5.config", "Qwen35Dims"),
    vmem_inputs=rope_input, layers=LAYERS,
    plain_state_tolerance=1.5e-2,
    dense_classes=("attention", "mlp", "lm_head"),
    # Qwen3.5 checkpoints nest the text model under model.language_model. and carry a
    # vision tower and MTP head the decode step does not use.
    renamed_prefixes=(("model.language_model.", "model."),),
    skipped_prefixes=("model.visual.", "mtp."),
)
