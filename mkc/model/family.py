"""The plug-in interface of a model family: what a family package gives the compiler core.

A family package (`mkc/families/<name>/`) defines `FAMILY = Family(...)`. The core reads
configs, builds graphs, checks and lowers schedules through these fields only, so it holds no
family names. Modules that import jax (ops, lowering, weights, reference) are named, not
imported, so checking a spec never loads them; `module` checks each against its role's
contract (`mkc.model.contracts`) when it imports it.
"""
from __future__ import annotations

import functools
import importlib
import importlib.resources
import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from mkc.model.contracts import ROLES, ContractError, missing_members


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


def config_int(value: object, key: str) -> int:
    """A config value that must be a whole number: a JSON integer, nothing Python would also
    take (`true` is an int to it, and int() reads "4096" and truncates 4096.5)."""
    if type(value) is not int:
        raise ConfigError(f"{key} = {_json(value)} is not a whole number",
                          f"write {key} as a JSON integer, as upstream configs do")
    return value


def config_float(value: object, key: str) -> float:
    """A config value that must be a number: a JSON integer or fraction, not `true` or text."""
    if type(value) not in (int, float):
        raise ConfigError(f"{key} = {_json(value)} is not a number",
                          f"write {key} as a JSON number, as upstream configs do")
    return float(value)


def _json(value: object) -> str:
    """A config value as its JSON spells it, cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


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
class ExpertLayout:
    """One routed-expert tensor a checkpoint may store in either of two layouts: fused, all
    experts in one `[E, rows, ...]` tensor named `fused`, or per expert, the tensors `parts`
    (`{e}` stands for the expert id) of `[rows / len(parts), ...]` each, expert e's parts
    concatenated in order along its rows (transformers' `MergeModulelist(dim=0)` then
    `Concatenate(dim=1)`). Both are names under a layer's prefix (`model.layers.{i}.`). The
    checkpoint loader hands out the layout the family's weight table names and converts the
    other into it, exactly (a copy of the same bytes)."""

    fused: str
    parts: tuple[str, ...]


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
    # (dims, batch) -> the kernel inputs its module passes in VMEM, as IR buffers with their
    # batch axis.
    vmem_inputs: Callable[[Any, int], list] = lambda dims, batch: []
    plain_state_tolerance: float = 1.5e-2   # vs the plain reference (mkc.numerics)
    plain_logits_tolerance: float = 0.03    # of the largest logit, likewise
    # Checkpoint names: upstream prefixes renamed on load, and prefixes of parts it skips.
    renamed_prefixes: tuple[tuple[str, str], ...] = ()
    skipped_prefixes: tuple[str, ...] = ()
    # Skip the tensors of layers `model.layers.{i}.` past the config's num_hidden_layers: a
    # multi-token-prediction layer numbered after the decoder's (DeepSeek-V3's `model.layers.61.`)
    # that decode does not run.
    skips_layers_past_config: bool = False
    # Routed-expert tensors a checkpoint may store fused or per expert (either loads).
    expert_layouts: tuple[ExpertLayout, ...] = ()
    # Name suffixes of the uint8 tensors that hold E8M0 scales (MXFP4's), where 255 is NaN:
    # the checkpoint loader refuses such a scale as it refuses a non-finite float.
    e8m0_suffixes: tuple[str, ...] = ()
    # The generated module imports the dims class from (module, name).
    dims_import: tuple[str, str] = ("", "")
    # Matrix classes a spec may store in another format (`format CLASS FORMAT`): class ->
    # the formats its lowering and packing take, the checkpoint's (the default) first.
    weight_formats: tuple[tuple[str, tuple[str, ...]], ...] = ()
    # Where they depend on the model's checkpoint: dims -> its `weight_formats` (DeepSeek-V3's
    # experts from its FP8 checkpoint take that checkpoint's blocks); None: the same for all.
    model_formats: Callable[[Any], tuple[tuple[str, tuple[str, ...]], ...]] | None = None
    # Formats whose packing requantizes the checkpoint's values and may round them, so a spec
    # may (or must) say `format CLASS NAME ... rounded`; the family's `weights.requantization`
    # requantizes them and reports the error (`mkc.requantize`). K3's fp4 (from MXFP4), Qwen3.5
    # MoE's fp8 (from bf16).
    rounding_formats: tuple[str, ...] = ()
    # Classes of streamed bf16 matrices a spec may store as 8-bit codes with a scale per output
    # column (`format attention int8 channel rounded`, `mkc.layers.dense_formats`): each its
    # matrices' `Tensor.format_class`, and its reference emulates their dots.
    dense_classes: tuple[str, ...] = ()
    # Its layer kinds composed from the layer library (`mkc.layers.sublayer.Composition`: kind
    # -> sublayers); their bodies are the lowering module's `BODIES` table, the one place a
    # body is registered.
    layers: Any = field(default=None, hash=False)
    # Its lowering module's `final_logits(k, logits, vocab_rule)` post-processes the lm_head's
    # logits in the kernel (e.g. `mkc.layers.decoder.lowering.softcapped_logits`, Muse Spark's
    # soft cap and padded vocabulary), the reference doing the same (`DecoderReference(softcap)`).
    final_logits: bool = False

    def measured_scratch(self) -> tuple:
        """What libtpu allocated beyond mkc's buffers for each kernel the family measured
        (`mkc.ir.ScratchMeasure`s from the package's compiler_scratch.json, written by
        benchmarks/compiler_scratch.py); () when it has measured none."""
        return _measured_scratch(self.package)

    def formats_for(self, dims: Any = None) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The classes with a choice of format and the formats each takes, the checkpoint's
        first, for the model `dims` (`model_formats`), else for any model."""
        return self.model_formats(dims) if self.model_formats and dims is not None else self.weight_formats

    def default_formats(self, dims: Any = None) -> dict:
        from mkc.ir import WeightFormat
        return {cls: WeightFormat(formats[0]) for cls, formats in self.formats_for(dims)}

    @functools.cached_property
    def lowered_ops(self) -> frozenset[str]:
        """The ops its `lowering` module has compute bodies for: its composed sublayers'
        (checking a spec imports no jax)."""
        # each composed sublayer (`mkc.layers.sublayer.Sublayer`) names the ops it lowers
        return frozenset(op for subs in (self.layers or {}).values() for sub in subs
                         for op in sub.op_names())

    def module(self, part: str) -> ModuleType:
        """One of its modules by role: "ops", "weights", "lowering", "reference"; a role with a
        contract (`mkc.model.contracts.ROLES`) is checked against it: ContractError names the
        family, the role and what is missing."""
        module = importlib.import_module(f"{self.package}.{part}")
        if part in ROLES and (missing := missing_members(module, ROLES[part])):
            raise ContractError(f"family {self.name}: its {part} module {module.__name__} lacks "
                                f"{', '.join(missing)} (see mkc.model.contracts.{ROLES[part].__name__})")
        if part == "lowering":
            registered = {op for _, op in getattr(module, "BODIES", {})}
            if registered != self.lowered_ops:
                raise ContractError(f"family {self.name}: its lowering module's BODIES hold ops "
                                    f"{sorted(registered)} but its composition declares "
                                    f"{sorted(self.lowered_ops)}: build BODIES = "
                                    "body_table(LAYERS) from FAMILY.layers")
            if self.final_logits and not hasattr(module, "final_logits"):
                raise ContractError(f"family {self.name}: final_logits is set but its lowering module "
                                    f"{module.__name__} has no final_logits(k, logits, vocab_rule)")
        return module


SCRATCH_FILE = "compiler_scratch.json"


@functools.cache
def _measured_scratch(package: str) -> tuple:
    from mkc.ir import ScratchMeasure
    try:
        text = importlib.resources.files(package).joinpath(SCRATCH_FILE).read_text()
    except (FileNotFoundError, ModuleNotFoundError):
        return ()
    return tuple(ScratchMeasure(**(m | {"key": tuple(tuple(kv) for kv in m["key"])}))
                 for m in json.loads(text)["measures"])
