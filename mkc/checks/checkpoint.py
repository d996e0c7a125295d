"""A checkpoint directory as the model (`ScheduleIR.checkpoint`): its tensors' names, shapes and
dtypes against the family's weight table, from the safetensors headers alone (no value is
read), before anything packs it. Its values are checked by `mkc.requantize.report`."""
from __future__ import annotations

from mkc import ir
from mkc.diagnostics import Diagnostic


def check_checkpoint(s: ir.ScheduleIR) -> list[Diagnostic]:
    """E-CHECKPOINT at the spec's `model` line, one note per tensor missing, unexpected or
    mis-shaped."""
    if not s.checkpoint:
        return []
    # The checkpoint reader finds the family from the checkpoint's own config.json: it is
    # imported only for a checkpoint, so a spec over a config alone loads no safetensors.
    from mkc.checkpoint import CheckpointError, checkpoint_error, load_checkpoint
    try:
        load_checkpoint(s.checkpoint, lazy=True)
    except CheckpointError as e:
        return checkpoint_error(e, s.setting_spans["model"]).diagnostics
    return []
