"""The plug-in interface of a model family: what a family package gives the compiler core.

A family package (`mkc/families/<name>/`) defines `FAMILY = Family(...)`. The core reads
configs, builds graphs, checks and lowers schedules through these fields only, so it holds no
family names. Modules that import jax (ops, weights, reference) are named, not imported, so
checking a spec never loads them.
"""
from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


class FormatError(ValueError):
    """A family's graph builder cannot store matrix class `cls` as the spec asks (message and
    hint); resolve points at the spec's `format` line."""

    def __init__(self, cls: str, message: str, hint: str):
        super().__init__(message)
        self.cls, self.hint = cls, hint


class ConfigError(ValueError):
    """A family's config reader met a value its lowering does not take (message and hint)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.hint = hint


def identifier(stem: str) -> str:
    """A model name safe for file names and generated source: identifier characters only."""
    return re.sub(r"[^A-Za-z0-9_]", "_", stem) or "model"


# A family's weight table (`reference.param_shapes`) gives each tensor's dtype; what may be
# stored for it: integer codes (MXFP4 blocks and E8M0 scales) exactly, floats in any of these
# (Qwen3.5 ships A_log and linear_attn.norm.weight as f32, the rest as bf16).
STORED_FLOATS = frozenset({"bfloat16", "float16", "float32"})


def stored_dtypes(table_dtype: str) -> frozenset[str]:
    """The numpy dtype names a checkpoint may hold for a tensor its family's table types as
    `table_dtype` (the checkpoint loader and the module's weight check both ask this)."""
    return STORED_FLOATS if table_dtype in STORED_FLOATS else frozenset({table_dtype})


@dataclass(frozen=True)
class Family:
    name: str                          # the dims' `family`, the IR's `family`
    model_types: tuple[str, ...]       # config.json `model_type` values it reads
    # (raw config, model name) -> dims; raises ConfigError, KeyError, ValueError or TypeError.
    read_dims: Callable[[dict, str], Any]
    shard_classes: tuple[str, ...]     # the classes a spec places with `shard CLASS over GROUP`
    # (dims, shard rules {class: (ways, stride)}, ranks, {class: mkc.ir.WeightFormat}) ->
    # mkc.model.graph.FamilyGraph; raises mkc.model.graph.ShardingError or FormatError.
    build: Callable[[Any, dict, int, dict], Any]
    package: str                       # e.g. "mkc.families.qwen3_5"
    lowered_ops: frozenset[str]        # the ops its `lowering` module has compute bodies for
    # Compiler scratch libtpu allocates beyond mkc's buffers: (batch, bytes) points measured by
    # benchmarks/vmem_probe.py, interpolated over batch.
    compiler_scratch: tuple[tuple[int, int], ...]
    # (dims, batch) -> the kernel inputs its module passes in VMEM, as IR buffers with their
    # batch axis.
    vmem_inputs: Callable[[Any, int], list] = lambda dims, batch: []
    plain_state_tolerance: float = 1.5e-2   # vs the plain reference (mkc.numerics)
    # Checkpoint names: upstream prefixes renamed on load, and prefixes of parts it skips.
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    skipped_prefixes: tuple[str, ...] = ()
    # The generated module imports the dims class from (module, name).
    dims_import: tuple[str, str] = ("", "")
    # Matrix classes a spec may store in another format (`format CLASS FORMAT`): class ->
    # the formats its lowering and packing take, the checkpoint's (the default) first.
    weight_formats: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def default_formats(self) -> dict:
        from mkc.ir import WeightFormat
        return {cls: WeightFormat(formats[0]) for cls, formats in self.weight_formats}

    def module(self, part: str) -> ModuleType:
        """One of its modules by role: "ops", "weights", "lowering", "reference"."""
        return importlib.import_module(f"{self.package}.{part}")
