"""What packing a checkpoint into the spec's weight formats does to its values (`format CLASS
fp4 block N [rounded]` on K3, `fp8 block N rounded` on Qwen3.5 MoE: the family's
`rounding_formats`; the dense classes' `fp8|int8 channel rounded`): with a checkpoint
directory as the model, `mkc check` and `mkc
compile` requantize its matrices as packing will, refuse (at the spec's `format` line) a class
that cannot be held exactly without `rounded`, and report the error per matrix class against
the checkpoint's values; with a config alone they say when it will be measured. With a
checkpoint they also check every value of it, as packing reads them."""
from __future__ import annotations

import importlib

from mkc import ir


def requantizing(s: ir.ScheduleIR) -> dict[str, ir.WeightFormat]:
    """The matrix classes whose format requantizes the checkpoint's values and may round them
    (the family's `rounding_formats`: K3's FP4 blocks, Qwen3.5 MoE's FP8 blocks; and the dense
    classes stored as codes with a scale per column)."""
    from mkc.model import registry
    rounds = registry.get(s.family).rounding_formats
    # `fp8 block R x C` holds an FP8 checkpoint's codes and scales as they are, and `nvfp4` an
    # NVFP4 checkpoint's unless `rounded` (its bf16 layers requantized): nothing rounds
    return {cls: f for cls, f in sorted(s.weight_formats.items())
            if (f.name in rounds and not f.cols and (f.rounded or f.name != "nvfp4")) or f.channel}


def dense_matrices(s: ir.ScheduleIR) -> list:
    """Every kernel matrix of `s` as `mkc.model.channel_codes.Member`s: each loop
    layer's streamed ones (with their codes) and pooled ones, then the tail's."""
    from mkc.model.channel_codes import Member
    out = []
    for layer, kind in enumerate(s.layer_kinds):
        out += [Member(layer, kind, f.name, f.codes, f.format_class) for f in s.stream.families[kind]]
        out += [Member(layer, kind, name) for name in s.kinds[kind].pooled]
    return out + [Member(-1, "tail", f.name, f.codes, f.format_class) for f in s.stream.tail]


def dense_requantization(s: ir.ScheduleIR, weights, hf, dims, classes) -> tuple[dict, dict]:
    """The checkpoint tensors `classes` (dense, stored as codes) read, as the kernel holds them,
    and the error per class (`mkc.model.channel_codes.requantization`)."""
    from mkc.model import channel_codes as dense
    from mkc.model.sharding import ShardTable
    tensors = dense.sources(weights, hf, dims, s.per_rank, ShardTable.of(s.shards, s.ranks),
                            dense_matrices(s))
    return dense.requantization(hf, {n: m for n, m in tensors.items() if m.format_class in classes},
                                s.weight_formats)


def report(s: ir.ScheduleIR, sched) -> dict[str, dict]:
    """Per requantizing class: its format and, with a checkpoint, the measured error (values
    moved, inexact blocks, max abs, relative RMS). With a checkpoint directory as the model,
    the checkpoint is checked as packing will read it: its names, shapes and dtypes, and
    every value (`mkc.checkpoint.verify_values`: no non-finite float, no NaN E8M0 scale).
    MkcError at the class's `format` line where its matrices cannot be held exactly and the
    spec did not say `rounded`, or hold a value that cannot be requantized; at the `model`
    line for any other problem of the checkpoint."""
    classes = requantizing(s)
    root = s.checkpoint
    if not root:
        return {cls: {"format": f.spelled, "measured": False,
                      "note": "its error against the checkpoint is measured when weights are "
                              "packed (the module's requantized_weights), or here with "
                              "--model CHECKPOINT_DIR"}
                for cls, f in classes.items()}
    from mkc.checkpoint import CheckpointError, checkpoint_error, load_checkpoint, verify_values
    from mkc.diagnostics import fail
    from mkc.model import registry
    from mkc.model.family import FormatError
    from mkc.model.sharding import ShardTable
    from mkc.resolve.formats import format_error, format_span
    try:
        _, hf = load_checkpoint(root, lazy=True)
    except CheckpointError as e:
        raise checkpoint_error(e, s.setting_spans["model"]) from None
    family = registry.get(s.family)
    dims = family.read_dims(s.model_config, s.model)
    weights = importlib.import_module(f"{s.family_package}.weights")
    measured: dict[str, dict] = {}
    read: set[str] = set()
    # one class at a time, in the spec's order: an error is at its class's line
    for cls, fmt in sorted(classes.items(), key=lambda c: format_span(sched, c[0]).line):
        try:
            if fmt.channel:
                held, one = dense_requantization(s, weights, hf, dims, {cls})
            else:
                held, one = weights.requantization(hf, dims, {cls: fmt},
                                                   ShardTable.of(s.shards, s.ranks))
        except FormatError as e:
            where = fmt.where + ": "
            text = str(e)[len(where):] if str(e).startswith(where) else str(e)
            raise format_error(FormatError(e.cls, text, e.hint), sched) from None
        except CheckpointError as e:
            raise fail("E-CHECKPOINT", f"`format {cls} {fmt.spelled}` cannot requantize the "
                       f"checkpoint: {e}", format_span(sched, cls), hint=e.hint) from None
        measured |= one
        read |= set(held)
    try:
        verify_values(hf, skip=read)
    except CheckpointError as e:
        raise checkpoint_error(e, s.setting_spans["model"]) from None
    return {cls: {**measured[cls], "measured": True, "checkpoint": str(root)} for cls in classes}


def lines(rep: dict[str, dict]) -> list[str]:
    """The report for people: one line per class."""
    out = []
    for cls, r in rep.items():
        unit = "columns" if "channel" in r["format"] else "blocks"
        if not r.get("measured"):
            out.append(f"{cls} ({r['format']}): requantized from the checkpoint's values "
                       f"when weights are packed; {r['note']}")
            continue
        out.append(f"{cls} ({r['format']}): " + (
            "exact (every block's values fit one scale)" if r["exact"] else
            f"{r['changed']} of {r['values']} values rounded in {r['inexact_blocks']} of "
            f"{r['blocks']} {unit}, max abs error {r['max_abs_error']:.3g}, relative RMS "
            f"{r['relative_rms_error']:.3g}") + " against the checkpoint's values")
    return out
