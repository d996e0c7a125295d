"""Hugging Face checkpoint directories (config.json + safetensors) <-> numpy parameter dicts.

The config's ``model_type`` (or its ``text_config``'s) picks the family. Loading validates the
tensor names and shapes against the family reference's ``param_shapes`` before reading any
tensor data, so a wrong or partial download fails fast with a message naming the offending
tensors. A family may rename stored prefixes and skip parts the decode step does not use (Qwen3.5
checkpoints are multimodal: ``model.language_model.`` becomes ``model.``, and the vision tower
and multi-token-prediction head are skipped, as upstream's ForCausalLM does).
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy API needs)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mkc.model import registry
from mkc.model.family import Family, stored_dtypes

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

_MAX_LISTED = 8


class CheckpointError(Exception):
    """A checkpoint directory is unreadable or does not match its config."""


def _listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


def _canonical(family: Family, name: str) -> str | None:
    """The ForCausalLM name of a stored tensor, or None if the tensor is not ours to load."""
    if name.startswith(family.skipped_prefixes):
        return None
    for old, new in family.renamed_prefixes:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def family_of(config: Mapping[str, Any]) -> Family:
    """The family whose `model_type` the config (or its text_config) names."""
    text = config.get("text_config")
    for model_type in (config.get("model_type"), isinstance(text, Mapping) and text.get("model_type")):
        family = registry.for_model_type(model_type)
        if family is not None:
            return family
    raise ValueError(f"model_type {config.get('model_type')!r} is not one of {registry.model_types()}")


def _weight_files(root: Path) -> dict[Path, list[str] | None]:
    """Safetensors files to read -> the tensor names the index promises in each (None: no index)."""
    index_path = root / INDEX_FILE
    if index_path.is_file():
        try:
            weight_map = json.loads(index_path.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"{index_path}: not a valid safetensors index ({e})") from e
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index_path}: weight_map is not a name -> file mapping")
        files: dict[Path, list[str]] = {}
        for name, file in weight_map.items():
            files.setdefault(root / file, []).append(name)
        missing = [p.name for p in files if not p.is_file()]
        if missing:
            raise CheckpointError(f"{root}: {INDEX_FILE} lists shard files that do not exist: "
                                  f"{_listing(missing)}")
        return {p: names for p, names in files.items()}
    single = root / SINGLE_FILE
    if single.is_file():
        return {single: None}
    found = sorted(root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{root}: no {SINGLE_FILE}, no {INDEX_FILE} and no other *.safetensors file")
    return {p: None for p in found}


_NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "U8": np.uint8}
_DTYPE_NAMES = {code: np.dtype(d).name for code, d in _NUMPY_DTYPES.items()}   # as stored_dtypes names them


class StoredTensor:
    """One tensor of a safetensors file, read only when used: its shape and dtype come from the
    file's header; ``np.asarray`` reads it whole, and indexing (``t[e]``, ``t[:, a:b]``) reads
    just that part. A generated module's ``place_weights`` packs rank by rank, so with these a
    full-size checkpoint is never held in memory at once (``load_checkpoint(lazy=True)``)."""

    __slots__ = ("file", "name", "shape", "dtype")

    def __init__(self, file: Path, name: str, shape: tuple[int, ...], dtype: np.dtype):
        self.file, self.name, self.shape, self.dtype = file, name, shape, np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        with safe_open(self.file, framework="np") as f:
            a = f.get_tensor(self.name)
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        with safe_open(self.file, framework="np") as f:
            return f.get_slice(self.name)[index]

    def __repr__(self) -> str:
        return f"StoredTensor({self.file.name}:{self.name}, {self.dtype}{list(self.shape)})"


def load_checkpoint(path: str | os.PathLike[str], lazy: bool = False
                    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read an HF checkpoint directory into (config.json as a dict, HF name -> numpy array).

    Arrays keep their stored dtype (bf16 as ``ml_dtypes.bfloat16``, or f32 where the checkpoint
    stores f32); names are the ForCausalLM ones of the family reference's ``param_shapes``.
    ``lazy``: each value is a ``StoredTensor`` instead, read when packed (for full-size models:
    ``place_weights`` then holds one rank's packed bytes and one tensor at a time).
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    config, family, cfg = _read_config(root)
    expected = family.module("reference").param_shapes(cfg)
    # Pass 1: names, shapes and dtypes from the headers only.
    headers = _read_headers(root, family, expected)
    headers.raise_mismatches(root, cfg.num_hidden_layers, expected)
    if lazy:
        return config, {name: StoredTensor(*headers.located[name], expected[name][0],
                                           _NUMPY_DTYPES[headers.stored_codes[name]])
                        for name in expected}
    # Pass 2: the data.
    return config, _read_tensors(headers.located, expected)


def _read_config(root: Path) -> tuple[dict[str, Any], Family, Any]:
    """(config.json as a dict, its family, the family reference's config)."""
    config_path = root / CONFIG_FILE
    if not config_path.is_file():
        raise CheckpointError(f"{root}: missing {CONFIG_FILE}")
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        family = family_of(config)
        cfg = family.module("reference").load_config(config)
    except (json.JSONDecodeError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise CheckpointError(f"{config_path}: unusable config ({e})") from e
    return config, family, cfg


@dataclass
class _Headers:
    """What the safetensors headers say against the tensors the config expects."""

    located: dict[str, tuple[Path, str]] = field(default_factory=dict)  # name -> (file, stored name)
    stored_codes: dict[str, str] = field(default_factory=dict)          # name -> safetensors dtype code
    problems: list[str] = field(default_factory=list)                   # wrong shapes and dtypes
    unexpected: list[str] = field(default_factory=list)                 # stored names not expected

    def raise_mismatches(self, root: Path, layers: int, expected: dict) -> None:
        """Every missing, unexpected or mis-shaped tensor in one error (none: return)."""
        problems = list(self.problems)
        missing = [n for n in expected if n not in self.located]
        if missing:
            problems.insert(0, f"missing {len(missing)} tensor(s): {_listing(missing)}")
        if self.unexpected:
            problems.insert(0, f"{len(self.unexpected)} unexpected tensor(s): "
                               f"{_listing(self.unexpected)}")
        if problems:
            raise CheckpointError(f"{root} does not match its config "
                                  f"({layers} layers):\n  " + "\n  ".join(problems))


def _read_headers(root: Path, family: Family, expected: dict) -> _Headers:
    headers = _Headers()
    for file, promised in _weight_files(root).items():
        try:
            with safe_open(file, framework="np") as f:
                stored = set(f.keys())
                if promised is not None and (absent := sorted(set(promised) - stored)):
                    raise CheckpointError(f"{file}: tensors listed for it in {INDEX_FILE} are not in "
                                          f"the file: {_listing(absent)}")
                for stored_name in sorted(stored):
                    name = _canonical(family, stored_name)
                    if name is None:
                        continue
                    if name not in expected:
                        headers.unexpected.append(stored_name)
                        continue
                    if name in headers.located:
                        raise CheckpointError(f"{root}: tensor {name} is stored twice "
                                              f"({headers.located[name][0].name} and {file.name})")
                    headers.located[name] = (file, stored_name)
                    view = f.get_slice(stored_name)
                    _check_header(headers, name, tuple(view.get_shape()), view.get_dtype(),
                                  expected[name])
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
    return headers


def _check_header(headers: _Headers, name: str, shape: tuple, dtype: str, want: tuple) -> None:
    """Note a stored tensor's dtype code, and a problem if its shape or dtype is not `want`'s."""
    headers.stored_codes[name] = dtype
    if shape != want[0]:
        headers.problems.append(f"{name}: shape {list(shape)}, expected {list(want[0])}")
    accepted = stored_dtypes(want[1])
    if _DTYPE_NAMES.get(dtype) not in accepted:
        codes = sorted(c for c, d in _DTYPE_NAMES.items() if d in accepted)
        headers.problems.append(f"{name}: dtype {dtype}, expected {' or '.join(codes)}")


def _read_tensors(located: dict[str, tuple[Path, str]], expected: dict) -> dict[str, np.ndarray]:
    """The located tensors' data in `expected`'s order, file by file so each file is opened once."""
    params: dict[str, np.ndarray] = {}
    by_file: dict[Path, list[tuple[str, str]]] = {}
    for name, (file, stored_name) in located.items():
        by_file.setdefault(file, []).append((name, stored_name))
    for file, names in by_file.items():
        with safe_open(file, framework="np") as f:
            for name, stored_name in names:
                params[name] = f.get_tensor(stored_name)
    return {name: params[name] for name in expected}


def save_checkpoint(path: str | os.PathLike[str], config: Mapping[str, Any],
                    params: Mapping[str, np.ndarray], *, max_shard_bytes: int | None = None) -> None:
    """Write config.json and the tensors (as given, unvalidated, so tests can write broken ones).

    With ``max_shard_bytes`` the tensors are split, in order, into
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    (root / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2) + "\n", encoding="utf-8")
    tensors = {name: np.ascontiguousarray(a) for name, a in params.items()}
    metadata = {"format": "pt"}  # what transformers expects in the header
    if max_shard_bytes is None:
        save_file(tensors, root / SINGLE_FILE, metadata=metadata)
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in tensors.items():
        if shards[-1] and size + a.nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.nbytes
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, start=1):
        file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, root / file, metadata=metadata)
        weight_map |= dict.fromkeys(shard, file)
    index = {"metadata": {"total_size": sum(a.nbytes for a in tensors.values())}, "weight_map": weight_map}
    (root / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
