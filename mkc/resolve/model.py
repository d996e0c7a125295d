"""Pass `model`: the schedule's name, and the model it runs (its config, dims and family, and
the checkpoint directory the config is in, if it is in one)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mkc.model import registry
from mkc.model.config import checkpoint_dir, dims_from_config, read_config, resolve_config_path
from mkc.resolve.names import require, validate_module_name
from mkc.resolve.state import ResolveState


def resolve_model(s: ResolveState) -> ResolveState:
    """A `--model` override is looked up as given; the spec's own model line also relative to
    the spec's directory."""
    sched = s.sched
    validate_module_name(sched.name)
    setting = require(sched, "model", 'model "qwen3_8_27b"')
    spec_dir = Path(sched.source_file).parent
    path = resolve_config_path(s.model_override or setting.value,
                               spec_dir if not s.model_override else None)
    config = read_config(path, setting.span)
    dims = dims_from_config(config, path, setting.span)
    checkpoint = checkpoint_dir(path)
    return replace(s, model_config=config, dims=dims, family=registry.get(dims.family),
                   checkpoint=str(checkpoint) if checkpoint else "")
