"""Read a Hugging Face style config.json (upstream key names) into the dimensions mkc needs."""
from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mkc.model import registry
from mkc.diagnostics import Span, did_you_mean, fail
from mkc.model.family import ConfigError

CONFIG_DIR = Path(__file__).with_name("configs")
INDEX_FILE = "model.safetensors.index.json"      # a sharded checkpoint's name -> file table

MAX_CONFIG_BYTES = 4 << 20
MAX_LAYERS = 1024
MAX_DIM = 1 << 24          # far above any real width or head count; keeps loops bounded
# A checkpoint's weight table has a few tensors per layer per routed expert (per-expert
# layouts: 497,052 for full K3, 93 x 896 expert-layers), so the product is bounded, not just
# each factor: a config asking for 10**6 experts is refused before any table is built.
MAX_EXPERTS = 1 << 14
MAX_EXPERT_LAYERS = 1 << 18
# A model's constants (a soft cap, a scale factor, RoPE's base) multiply f32 values: at most
# 2**64, a constant's product with a value up to 2**64 stays finite in f32 (3.4e38); no model's
# comes near (RoPE bases reach 1e7). An epsilon (a dims field `*_eps`) keeps a norm's rsqrt off
# zero and lies under 1: from 1 up it outweighs a unit-RMS activation's mean square.
MAX_CONSTANT = 2.0 ** 64


def resolve_config_path(model: str, relative_to: Path | None = None) -> Path:
    """A shipped config name (e.g. "qwen3_8_27b") or a path to a config.json / checkpoint dir."""
    shipped = CONFIG_DIR / f"{model}.json"
    if _probe(shipped.exists):
        return shipped
    p = Path(model)
    if not p.is_absolute() and relative_to is not None:
        p = relative_to / p
    return p / "config.json" if _probe(p.is_dir) else p


def checkpoint_dir(config_path: Path) -> Path | None:
    """The checkpoint directory a model's config.json is in (beside safetensors files or an
    index of them), or None."""
    root = config_path.parent if config_path.name == "config.json" else None
    try:
        holds_weights = root is not None and (any(root.glob("*.safetensors")) or
                                              (root / INDEX_FILE).exists())
    except OSError:
        holds_weights = False
    return root if holds_weights else None


def _probe(test) -> bool:
    """A path test that is False, not an error, for names the OS refuses (too long, NUL)."""
    try:
        return test()
    except (OSError, ValueError):
        return False


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def model_name(path: Path) -> str:
    """A model's name: its config file's stem, or its checkpoint directory's for a config.json."""
    path = Path(path)
    return path.parent.name if path.name == "config.json" else path.stem


def upstream_config(path_or_dict: str | os.PathLike[str] | Mapping[str, Any]) -> tuple[Mapping, str]:
    """(the text model's config object, the model's name), for a family's reference: from a
    dict, a config.json path or a checkpoint directory; a composite config's `text_config`."""
    if isinstance(path_or_dict, Mapping):
        raw, name = path_or_dict, "model"
    else:
        path = Path(path_or_dict)
        path = path / "config.json" if path.is_dir() else path
        raw, name = read_json(path, MAX_CONFIG_BYTES), model_name(path)
    text = raw.get("text_config")
    return (text if isinstance(text, Mapping) else raw), name


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a model dimension can take")


def read_json(path: Path, max_bytes: int) -> Any:
    """A JSON file of at most `max_bytes`, strict (no NaN or Infinity), read no further than
    the cap: ValueError (JSON, UTF-8, nesting and size alike) or OSError."""
    with Path(path).open("rb") as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ValueError(f"it is larger than {_bytes(max_bytes)}, the most mkc reads of it")
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except RecursionError:
        raise ValueError("it nests too deeply") from None


def _bytes(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 and n % (1 << 20) == 0 else f"{n} bytes"


def read_config(path: Path, where: Span) -> dict:
    """The config's JSON object: a regular file of bounded size, strict JSON (no NaN)."""
    p = Path(path)
    if not _probe(p.exists):
        shipped = shipped_configs()
        raise fail("E-MODEL", f"model config not found: {path}", where,
                   hint=did_you_mean(model_name(p), shipped) + f"use a shipped config "
                        f"({', '.join(shipped)}) or a path to a config.json or a checkpoint directory")
    if not p.is_file():
        raise fail("E-MODEL", f"model config {path} is not a regular file", where,
                   hint="point `model` at a config.json or a checkpoint directory holding one")
    try:
        raw = read_json(p, MAX_CONFIG_BYTES)
    except OSError as e:
        raise fail("E-MODEL", f"cannot read model config {path}: {e.strerror}", where,
                   hint="check the path and its permissions") from None
    except ValueError as e:                     # JSON, UTF-8, nesting and size errors
        raise fail("E-MODEL", f"cannot read model config {path}: {e}", where,
                   hint="the file must be a Hugging Face style config.json") from None
    if not isinstance(raw, dict):
        raise fail("E-MODEL", f"model config {path} is not a JSON object", where,
                   hint="the file must be a Hugging Face style config.json")
    return raw


def load_dims(path: Path, span: Span | None = None) -> Any:
    """Parse config.json; errors point at the spec's `model` line when a span is given."""
    where = span or Span.unknown(str(path))
    return dims_from_config(read_config(path, where), path, where)


def dims_from_config(raw: dict, path: Path, where: Span) -> Any:
    """The family's dims for a config (its `model_type` picks the family), checked in range."""
    model_type = raw.get("model_type")
    family = registry.for_model_type(model_type)
    if family is None:
        raise fail("E-MODEL", f"model family {model_type!r} is not supported", where,
                   hint=f"supported families: {', '.join(registry.model_types())}; to add one, "
                        "see docs/extending.md, 'A new model family' (a type computed as a "
                        "supported family computes it is that family's alias)")
    try:
        dims = read_checked_dims(family.read_dims, raw, model_name(path))
        eos_token_ids(raw, dims.vocab_size)
    except ConfigError as e:
        raise fail("E-MODEL", f"model config {path}: {e}", where, hint=e.hint) from None
    except (TypeError, ValueError, AttributeError) as e:
        raise fail("E-MODEL", f"model config {path} is malformed: {e}", where,
                   hint="compare with a shipped config in mkc/model/configs") from None
    return dims


def read_checked_dims(read_dims: Callable[[Mapping, str], Any], raw: Mapping, name: str) -> Any:
    """A family's dims of a config, as every path that reads one gets them (`mkc check` and
    compile through `dims_from_config`; a reference's `load_config`, and so `load_checkpoint`,
    a draft model and the example runners): the layer count bounded before `read_dims` builds
    anything per layer (10**9 layers filled memory), an arithmetic failure on a value (a zero
    divisor) a ConfigError, a key the reader needs and the config lacks a ConfigError naming
    it, and every dim in range (`out_of_range`). Raises ConfigError, TypeError or ValueError."""
    for where, config in (("", raw), ("text_config ", raw.get("text_config"))):
        layers = config.get("num_hidden_layers") if isinstance(config, Mapping) else None
        if layers is not None and not (type(layers) is int and 1 <= layers <= MAX_LAYERS):
            raise ConfigError(f"{where}num_hidden_layers = {json.dumps(layers)[:40]} is out of range",
                              f"a whole number of layers from 1 to {MAX_LAYERS}")
    try:
        dims = read_dims(raw, name)
    except KeyError as e:                 # a family reads a key it has no default for
        key = e.args[0] if e.args else e
        raise ConfigError(f"{key} is missing", f"write \"{key}\" as the model's upstream "
                          "config.json does (a shipped one in mkc/model/configs shows it)") from None
    except ArithmeticError as e:          # a family's own checks name the field; this is the net
        raise ConfigError(f"a value of the config cannot be computed with ({e})",
                          "check the config's counts, sizes and constants: a zero, or one out "
                          "of its range, divides or overflows") from None
    return in_range(dims)


def text_setting(config: Mapping, key: str) -> Any:
    """A config value at its top or, for a multimodal config, in its `text_config`."""
    text = config.get("text_config")
    return config.get(key, text.get(key) if isinstance(text, Mapping) else None)


def eos_token_ids(config: Mapping, vocab: int) -> frozenset[int]:
    """The config's `eos_token_id` (one id, a list, or none; at its top or in a multimodal
    config's `text_config`), each a token of the `vocab` ids; ConfigError otherwise (an id
    outside it would never end a generation). `mkc check` and compile refuse such a config at
    the spec's `model` line; `mkc serve` stops generations at these ids."""
    eos = text_setting(config, "eos_token_id")
    ids = [] if eos is None else eos if isinstance(eos, list) else [eos]
    bad = [e for e in ids if type(e) is not int or not 0 <= e < vocab]
    if bad:
        raise ConfigError(f"eos_token_id {json.dumps(eos)[:60]}: {json.dumps(bad[0])} is not a token id "
                          f"of its vocabulary (0 to {vocab - 1})",
                          "give eos_token_id as the config's token id (or a list of them), as upstream does")
    return frozenset(ids)


def in_range(dims: Any) -> Any:
    """The dims, or ConfigError for a value out of range: what a family's reference runs after
    `read_dims`, so it refuses what `mkc check` refuses."""
    error = out_of_range(dims)
    if error is not None:
        raise error
    return dims


def out_of_range(dims) -> ConfigError | None:
    """Every dimension a whole number in range and every constant finite, positive (or of any
    sign, for a dims field marked `metadata={"any_sign": True}`) and at most `MAX_CONSTANT` in
    magnitude, an epsilon under 1: a bad value must not reach the generated module (`EPS =
    nan`), a loop bound, or the model's math as an overflow."""
    for f in dataclasses.fields(dims):
        v = getattr(dims, f.name)
        if f.name in ("family", "name", "layer_kinds"):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and not 1 <= v <= MAX_DIM:   # a flag is no size
            return ConfigError(f"{f.name} = {v} is out of range", f"{f.name} must be a whole number "
                               f"from 1 to {MAX_DIM}")
        if isinstance(v, float) and (error := _constant_out_of_range(f, v)) is not None:
            return error
    experts = getattr(dims, "experts", 1)
    if experts > MAX_EXPERTS:
        return ConfigError(f"experts = {experts} is out of range", f"a model of at most {MAX_EXPERTS} "
                           "routed experts")
    if experts * dims.num_hidden_layers > MAX_EXPERT_LAYERS:
        return ConfigError(f"{dims.num_hidden_layers} layers of {experts} routed experts are "
                           f"{experts * dims.num_hidden_layers} expert-layers, more than mkc reads "
                           f"({MAX_EXPERT_LAYERS})", "check num_hidden_layers and the expert count")
    if getattr(dims, "top_k", 0) > getattr(dims, "experts", 0):
        return ConfigError(f"top-k {dims.top_k} exceeds the {dims.experts} experts",
                           "num_experts_per_token <= num_experts")
    return None


def _constant_out_of_range(f: dataclasses.Field, v: float) -> ConfigError | None:
    """A float dims field's value out of its range (`MAX_CONSTANT`'s comment), or None."""
    any_sign = f.metadata.get("any_sign")
    if not (math.isfinite(v) and (v > 0 or any_sign) and abs(v) <= MAX_CONSTANT):
        return ConfigError(f"{f.name} = {v} is out of range", f"{f.name} must be a finite "
                           f"{'' if any_sign else 'positive '}number of magnitude at most 2**64 "
                           f"({MAX_CONSTANT:.4g}): past it, its products with f32 values overflow")
    if f.name.endswith("_eps") and not v < 1:
        return ConfigError(f"{f.name} = {v} is out of range", f"{f.name} must lie between 0 and 1: "
                           "an epsilon keeps a norm's rsqrt off zero, and from 1 up it outweighs a "
                           "unit-RMS activation (upstream configs use 1e-5 or 1e-6)")
    return None
