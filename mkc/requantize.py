"""What packing a checkpoint into the spec's weight formats does to its values (`format CLASS
fp4 block N [rounded]` on K3, `fp8 block N rounded` on Qwen3.5 MoE: the family's
`rounding_formats`): with a checkpoint directory as the model, `mkc check` and `mkc
compile` requantize its matrices as packing will, refuse (at the spec's `format` line) a class
that cannot be held exactly without `rounded`, and report the error per matrix class against
the checkpoint's values; with a config alone they say when it will be measured."""
from __future__ import annotations

import importlib
from pathlib import Path

from mkc import ir


def requantizing(s: ir.ScheduleIR) -> dict[str, ir.WeightFormat]:
    """The matrix classes whose format requantizes the checkpoint's values and may round them
    (the family's `rounding_formats`: K3's FP4 blocks, Qwen3.5 MoE's FP8 blocks)."""
    from mkc.model import registry
    rounds = registry.get(s.family).rounding_formats
    return {cls: f for cls, f in sorted(s.weight_formats.items()) if f.name in rounds}


def checkpoint_dir(sched, model: str | None) -> Path | None:
    """The model's checkpoint directory (a config.json beside safetensors files), or None."""
    from mkc.model.config import resolve_config_path
    setting = sched.settings.get("model")
    if model is None and setting is None:
        return None
    path = resolve_config_path(model or setting.value,
                               None if model else Path(sched.source_file).parent)
    root = path.parent if path.name == "config.json" else None
    return root if root is not None and any(root.glob("*.safetensors")) else None


def report(s: ir.ScheduleIR, sched, model: str | None) -> dict[str, dict]:
    """Per requantizing class: its format and, with a checkpoint, the measured error (values
    moved, inexact blocks, max abs, relative RMS). MkcError at the class's `format` line where
    the checkpoint cannot be held exactly and the spec did not say `rounded`."""
    classes = requantizing(s)
    if not classes:
        return {}
    root = checkpoint_dir(sched, model)
    if root is None:
        return {cls: {"format": f.spelled, "measured": False,
                      "note": "its error against the checkpoint is measured when weights are "
                              "packed (the module's requantized_weights), or here with "
                              "--model CHECKPOINT_DIR"}
                for cls, f in classes.items()}
    from mkc.checkpoint import load_checkpoint
    from mkc.model import registry
    from mkc.model.family import FormatError
    from mkc.model.sharding import ShardTable
    from mkc.resolve.formats import format_error
    _, hf = load_checkpoint(root, lazy=True)
    family = registry.get(s.family)
    dims = family.read_dims(s.model_config, s.model)
    weights = importlib.import_module(f"{s.family_package}.weights")
    try:
        _, measured = weights.requantization(hf, dims, s.weight_formats,
                                             ShardTable.of(s.shards, s.ranks))
    except FormatError as e:
        where = s.weight_formats[e.cls].where + ": "
        text = str(e)[len(where):] if str(e).startswith(where) else str(e)
        raise format_error(FormatError(e.cls, text, e.hint), sched) from None
    return {cls: {**r, "measured": True, "checkpoint": str(root)} for cls, r in measured.items()}


def lines(rep: dict[str, dict]) -> list[str]:
    """The report for people: one line per class."""
    out = []
    for cls, r in rep.items():
        if not r.get("measured"):
            out.append(f"{cls} ({r['format']}): requantized from the checkpoint's values "
                       f"when weights are packed; {r['note']}")
            continue
        out.append(f"{cls} ({r['format']}): " + (
            "exact (every block's values fit one scale)" if r["exact"] else
            f"{r['changed']} of {r['values']} values rounded in {r['inexact_blocks']} of "
            f"{r['blocks']} blocks, max abs error {r['max_abs_error']:.3g}, relative RMS "
            f"{r['relative_rms_error']:.3g}") + " against the checkpoint's values")
    return out
