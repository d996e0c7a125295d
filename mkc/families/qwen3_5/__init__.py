"""Qwen3.5 text (`qwen3_5_text`): gated delta net and gated attention layers, dense SwiGLU MLPs."""
from mkc import ir
from mkc.families.qwen3_5.config import AttentionDims, read_dims
from mkc.families.qwen3_5.graph import SHARD_CLASSES, build
from mkc.model.family import Family


def rope_input(dims: AttentionDims, batch: int) -> list[ir.Buffer]:
    """The module passes the rotary table [2, B, head_dim] f32 in VMEM."""
    return [ir.Buffer("rope", "input", (2, batch, dims.head_dim), "f32", batch_axis=1)]


FAMILY = Family(
    name="qwen3_5_text", model_types=("qwen3_5_text",), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.qwen3_5.config", "Qwen35Dims"),
    vmem_inputs=rope_input,
    plain_state_tolerance=1.5e-2,
    # Qwen3.5 checkpoints nest the text model under model.language_model. and carry a
    # vision tower and MTP head the decode step does not use.
    renamed_prefixes=(("model.language_model.", "model."),),
    skipped_prefixes=("model.visual.", "mtp."),
)
