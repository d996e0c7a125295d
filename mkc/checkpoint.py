"""Hugging Face checkpoint directories (config.json + safetensors) <-> numpy parameter dicts.

The config's ``model_type`` (or its ``text_config``'s) picks the family. Loading validates the
tensor names and shapes against the family reference's ``param_shapes`` before reading any
tensor data, so a wrong or partial download fails fast with a message naming the offending
tensors. Every file it opens is a regular file inside the checkpoint directory
(`checkpoint_file`: index entries, symlinks and `..` included) and size-capped before it is
read; every value it reads is checked where it enters (`StoredTensor`): a non-finite float,
a NaN E8M0 scale or a scale outside its format's range is refused, naming the tensor. A family
may rename stored prefixes and skip parts the decode step does not use (Qwen3.5 checkpoints are
multimodal: ``model.language_model.`` becomes ``model.``, and the vision tower and
multi-token-prediction head are skipped, as upstream's ForCausalLM does; DeepSeek-V3's MTP
layer, numbered past the decoder's layers, likewise), and declare routed expert tensors a
checkpoint may store fused or per expert (``Family.expert_layouts``): the loader converts the
stored layout into the one the table names, exactly.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import re
import stat
from collections.abc import Collection, Mapping
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors' numpy API needs)
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from mkc.diagnostics import MkcError, Span, fail
from mkc.model import fp8_blocks, nvfp4, registry
from mkc.model.config import INDEX_FILE, MAX_CONFIG_BYTES, read_json
from mkc.model.family import ExpertLayout, Family, stored_dtypes
from mkc.model.scales import ScaleRange

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"

_MAX_LISTED = 8
# Caps on what is read of a file before it is trusted: full K3's index (497,052 tensors) is
# about 60 MB; a safetensors header as long as safetensors itself accepts.
MAX_INDEX_BYTES = 128 << 20
MAX_HEADER_BYTES = 100_000_000
_VERIFY_CHUNK_BYTES = 64 << 20      # `verify_values` reads a tensor this much at a time

_FIX_FILES = "re-download the checkpoint, or re-export it (config.json and its safetensors files)"


class CheckpointError(Exception):
    """A checkpoint directory is unreadable or does not match its config; `hint`: how to fix it."""

    def __init__(self, message: str, hint: str = _FIX_FILES):
        super().__init__(message)
        self.hint = hint


def checkpoint_error(e: CheckpointError, span: Span) -> MkcError:
    """A CheckpointError as a diagnostic at `span` (the spec's `model` line): its first line the
    message, each listed problem (a tensor and what is wrong with it) a note."""
    first, *problems = str(e).split("\n  ")
    return fail("E-CHECKPOINT", first.rstrip(":"), span, hint=e.hint, notes=problems)


class _MissingFile(CheckpointError):
    """A file the checkpoint names does not exist (listed together, not one by one)."""


def _listing(names: list[str]) -> str:
    shown = ", ".join(sorted(names)[:_MAX_LISTED])
    more = len(names) - _MAX_LISTED
    return shown + (f" ... and {more} more" if more > 0 else "")


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _canonical(family: Family, name: str, layers: int) -> str | None:
    """The ForCausalLM name of a stored tensor, or None if the tensor is not ours to load (of
    `layers` decoder layers)."""
    if name.startswith(family.skipped_prefixes):
        return None
    for old, new in family.renamed_prefixes:
        if name.startswith(old):
            name = new + name[len(old):]
            break
    if family.skips_layers_past_config and (m := _LAYER.match(name)) and int(m.group(1)) >= layers:
        return None
    return name


def family_of(config: Mapping[str, Any]) -> Family:
    """The family whose `model_type` the config (or its text_config) names."""
    text = config.get("text_config")
    for model_type in (config.get("model_type"), isinstance(text, Mapping) and text.get("model_type")):
        family = registry.for_model_type(model_type)
        if family is not None:
            return family
    raise ValueError(f"model_type {config.get('model_type')!r} is not one of {registry.model_types()}")


def _containing_dirs(root: Path) -> tuple[Path, ...]:
    """Where a checkpoint's files may resolve to: its directory and, for a Hugging Face hub
    cache snapshot (`models--ORG--NAME/snapshots/REV/FILE`, a symlink to `../../blobs/SHA`),
    its repository's blobs."""
    real = root.resolve()
    blobs = real.parent.parent / "blobs"
    if real.parent.name == "snapshots" and blobs.is_dir():
        return real, blobs.resolve()
    return (real,)


def checkpoint_file(root: Path, given: object, entry: str = "") -> Path:
    """The file a checkpoint names (`given`, relative to its directory `root`), resolved:
    CheckpointError unless it is a regular file inside the checkpoint after resolving `..`,
    absolute paths and symlinks (`_MissingFile` if absent). `entry`: what gave the path, for
    the message (an index's weight_map entry). Every file the loader opens comes from here."""
    what = f"{entry} -> {given!r}" if entry else repr(given)
    if not isinstance(given, str) or not given:
        raise CheckpointError(f"{root}: {what} is not a file name",
                              hint=f"an index maps each tensor name to a file name in {root}")
    try:
        path = (root / given).resolve()
        inside = any(path.is_relative_to(d) for d in _containing_dirs(root))
    except (OSError, ValueError, RuntimeError) as e:      # NUL bytes, symlink loops
        raise CheckpointError(f"{root}: {what} is not a usable path ({e})") from None
    if not inside:
        raise CheckpointError(f"{root}: {what} resolves to {path}, outside the checkpoint directory",
                              hint="a checkpoint reads only files inside its directory: name them "
                                   "relative to it, with no `..`, absolute path or symlink out")
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise _MissingFile(f"{root}: {what} does not exist") from None
    except OSError as e:
        raise CheckpointError(f"{root}: {what} cannot be read ({e.strerror})") from None
    if not stat.S_ISREG(mode):
        raise CheckpointError(f"{root}: {what} is not a regular file")
    return path


def _read_json(root: Path, name: str, max_bytes: int, what: str) -> Any:
    """A JSON file of the checkpoint (`what` it is), read no further than `max_bytes`."""
    path = checkpoint_file(root, name)
    try:
        return read_json(path, max_bytes)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:                   # JSON, UTF-8, nesting and size errors
        raise CheckpointError(f"cannot read {path} as {what}: {e}") from None


def _exists(path: Path) -> bool:
    return path.is_symlink() or path.exists()


def _weight_files(root: Path) -> dict[Path, list[str] | None]:
    """Safetensors files to read -> the tensor names the index promises in each (None: no index)."""
    if _exists(root / INDEX_FILE):
        index = _read_json(root, INDEX_FILE, MAX_INDEX_BYTES, "a safetensors index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{root / INDEX_FILE}: not a valid safetensors index (no weight_map "
                                  "mapping tensor names to files)")
        files: dict[Path, list[str]] = {}
        missing: list[str] = []
        for name, file in weight_map.items():
            try:
                files.setdefault(checkpoint_file(root, file, f"{INDEX_FILE} entry {name!r}"), []).append(name)
            except _MissingFile:
                missing.append(file)
        if missing:
            raise CheckpointError(f"{root}: {INDEX_FILE} lists shard files that do not exist: "
                                  f"{_listing(sorted(set(missing)))}")
        return files
    if _exists(root / SINGLE_FILE):
        return {checkpoint_file(root, SINGLE_FILE): None}
    found = sorted(p.name for p in root.glob("*.safetensors"))
    if not found:
        raise CheckpointError(f"{root}: no {SINGLE_FILE}, no {INDEX_FILE} and no other *.safetensors file")
    return {checkpoint_file(root, name): None for name in found}


def _open_safetensors(path: Path):
    """`safe_open` of a checkpoint's safetensors file (a `checkpoint_file`), its header length
    (the first 8 bytes) checked first: at most MAX_HEADER_BYTES and within the file."""
    with path.open("rb") as f:
        head, size = f.read(8), os.fstat(f.fileno()).st_size
    length = int.from_bytes(head, "little") if len(head) == 8 else -1
    if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
        raise CheckpointError(f"{path}: not a safetensors file (its header length "
                              f"{'is missing' if length < 0 else f'is {length} bytes'}; at most "
                              f"{MAX_HEADER_BYTES} and within the file's {size} bytes)")
    return safe_open(path, framework="np")


_NUMPY_DTYPES = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32, "U8": np.uint8,
                 "F8_E4M3": ml_dtypes.float8_e4m3fn}
_DTYPE_NAMES = {code: np.dtype(d).name for code, d in _NUMPY_DTYPES.items()}   # as stored_dtypes names them
# Dtypes safetensors' numpy API cannot read (it looks for numpy.float8_e4m3fn): their bytes are
# read from the file where its header places them (`_raw`).
_RAW_DTYPES = frozenset({np.dtype(ml_dtypes.float8_e4m3fn)})


@functools.lru_cache(maxsize=64)
def _data_offsets(path: Path, mtime_ns: int, size: int) -> dict[str, tuple[int, tuple[int, ...]]]:
    """A safetensors file's tensors: name -> (the file offset of its bytes, its shape)."""
    with path.open("rb") as f:
        length = int.from_bytes(f.read(8), "little")
        if not 0 < length <= min(MAX_HEADER_BYTES, size - 8):
            raise CheckpointError(f"{path}: not a safetensors file (header length {length})")
        header = json.loads(f.read(length))
    return {name: (8 + length + int(entry["data_offsets"][0]), tuple(entry["shape"]))
            for name, entry in header.items() if name != "__metadata__"}


def _raw(path: Path, name: str, dtype: np.dtype, region: tuple | None) -> np.ndarray:
    """Tensor `name` (its `region`) of one-byte `dtype` from its bytes in the file: only the
    bytes the region covers are read."""
    st = path.stat()
    offset, shape = _data_offsets(path, st.st_mtime_ns, st.st_size)[name]
    if not shape or 0 in shape:
        return np.zeros(shape, np.uint8).view(dtype)
    data = np.memmap(path, np.uint8, mode="r", offset=offset, shape=shape)
    return np.array(data if region is None else data[region]).view(dtype)


class _OpenFiles:
    """Safetensors files opened on first use and kept open until the block ends, so reading
    many tensors (an expert stack's parts) opens each shard once."""

    def __init__(self) -> None:
        self._stack = ExitStack()
        self._files: dict[Path, Any] = {}

    def __enter__(self) -> _OpenFiles:
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def __call__(self, path: Path):
        if path not in self._files:
            self._files[path] = self._stack.enter_context(_open_safetensors(path))
        return self._files[path]


class StoredTensor:
    """One tensor of a safetensors file, read only when used: its shape and dtype come from the
    file's header; ``np.asarray`` reads it whole, and indexing (``t[e]``, ``t[:, a:b]``) reads
    just that part. A generated module's ``place_weights`` packs rank by rank, so with these a
    full-size checkpoint is never held in memory at once (``load_checkpoint(lazy=True)``).
    ``part``: the tensor is that index of the stored one (one expert's rows of a fused tensor).
    Every read is checked (`_checked`): values enter mkc only through here.
    ``e8m0``: its uint8 values are E8M0 scales (``Family.e8m0_suffixes``), 255 being NaN.
    ``scale``: its values are scales of a format with a range (`scale_range`)."""

    __slots__ = ("file", "name", "shape", "dtype", "part", "e8m0", "scale")

    def __init__(self, file: Path, name: str, shape: tuple[int, ...], dtype: np.dtype,
                 part: tuple | None = None, e8m0: bool = False, scale: ScaleRange | None = None):
        self.file, self.name, self.shape, self.dtype = file, name, shape, np.dtype(dtype)
        self.part, self.e8m0, self.scale = part, e8m0, scale

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self, open_file: _OpenFiles, rows: slice | None = None) -> np.ndarray:
        """The tensor (its `part`), or of a whole stored tensor just `rows`."""
        region = self.part if self.part is not None else None if rows is None else (rows,)
        return self._checked(self._get(open_file, region), region)

    def _get(self, open_file: _OpenFiles, region: tuple | None) -> np.ndarray:
        if self.dtype in _RAW_DTYPES:
            return _raw(self.file, self.name, self.dtype, region)
        f = open_file(self.file)
        return f.get_tensor(self.name) if region is None else f.get_slice(self.name)[region]

    def _checked(self, a: np.ndarray, region: tuple | None) -> np.ndarray:
        """`a` (the stored tensor's `region`), or CheckpointError naming the tensor and the
        first bad value's index: a non-finite float, or an E8M0 scale of 255 (NaN), is never
        a weight a model can serve; nor a scale outside its format's range (`_scale_problem`)."""
        if self.e8m0 and a.dtype == np.uint8:
            bad, what = a == 255, "E8M0 scale(s) of 255 (NaN)"
        elif a.dtype != np.uint8:
            bad, what = ~np.isfinite(a), "non-finite value(s)"
        else:
            return a
        if not bad.any() and (self.e8m0 or self.scale is not None):
            bad, what = self._scale_problem(a)
        if not bad.any():
            return a
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        value = "" if a.dtype == np.uint8 else f" ({a[first]:.6g})"
        cause = "a non-finite weight" if what == "non-finite value(s)" else "a scale outside its range"
        raise CheckpointError(
            f"{self.file}: tensor {self.name} holds {int(bad.sum())} {what}, the first{value} "
            f"at index {list(_absolute(region, first))}",
            hint=f"{cause} cannot be served: " + _FIX_FILES)

    def _scale_problem(self, a: np.ndarray) -> tuple[np.ndarray, str]:
        """Where scales `a` leave their format's range, and what that range is: an E8M0 scale
        past `mxfp4.SCALE_LARGEST` overflows its block's values; the others' `ScaleRange`."""
        if self.e8m0:
            from mkc.model.mxfp4 import SCALE_LARGEST
            return a > SCALE_LARGEST, (f"E8M0 scale(s) above {SCALE_LARGEST} (2**{SCALE_LARGEST - 127}: "
                                       "its block's values overflow bf16)")
        return self.scale.outside(a), self.scale.text

    def verify(self, open_file: _OpenFiles) -> None:
        """Read (and so check) every value, at most `_VERIFY_CHUNK_BYTES` at a time."""
        if self.part is not None or not self.shape:
            self.read(open_file)
            return
        row_bytes = int(np.prod(self.shape[1:], dtype=np.int64)) * self.dtype.itemsize
        step = max(1, _VERIFY_CHUNK_BYTES // max(1, row_bytes))
        for start in range(0, self.shape[0], step):
            self.read(open_file, slice(start, min(start + step, self.shape[0])))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        with _OpenFiles() as open_file:
            a = self.read(open_file)
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        if self.part is not None:
            return np.asarray(self)[index]
        region = index if isinstance(index, tuple) else (index,)
        with _OpenFiles() as open_file:
            return self._checked(self._get(open_file, region), region)

    def __repr__(self) -> str:
        part = "" if self.part is None else f"[{self.part}]"
        return f"StoredTensor({self.file.name}:{self.name}{part}, {self.dtype}{list(self.shape)})"


def _absolute(region: tuple | None, index: tuple[int, ...]) -> tuple[int, ...]:
    """`index` into the part `region` of a tensor read (ints and slices from 0 up, as the
    loader reads them), as an index into the whole tensor; else `index` as it is."""
    if region is None:
        return index
    if not all(isinstance(r, (int, np.integer)) and r >= 0 or isinstance(r, slice)
               and (r.start or 0) >= 0 and r.step in (None, 1) for r in region):
        return index
    out, rest = [], iter(index)
    for r in region:
        out.append(int(r) if not isinstance(r, slice) else (r.start or 0) + next(rest))
    return (*out, *rest)


class StackedExperts:
    """A fused ``[E, rows, ...]`` expert tensor of a checkpoint that stores it per expert
    (``mkc.model.family.ExpertLayout``): expert e is its parts concatenated along their rows.
    ``np.asarray`` stacks every expert; ``t[e]`` and ``t[e, ...]`` read expert e's parts only
    (how a generated module packs experts), so a lazy load stays one expert at a time."""

    __slots__ = ("experts", "shape", "dtype")

    def __init__(self, experts: list[list[StoredTensor]], shape: tuple[int, ...], dtype: np.dtype):
        self.experts, self.shape, self.dtype = experts, shape, np.dtype(dtype)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def _expert(self, e: int, open_file: _OpenFiles) -> np.ndarray:
        return np.concatenate([p.read(open_file) for p in self.experts[e]], axis=0)

    def verify(self, open_file: _OpenFiles) -> None:
        """Read (and so check) every value, one part at a time."""
        for parts in self.experts:
            for p in parts:
                p.verify(open_file)

    def read(self, open_file: _OpenFiles) -> np.ndarray:
        return np.stack([self._expert(e, open_file) for e in range(len(self.experts))])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        with _OpenFiles() as open_file:
            a = self.read(open_file)
        return a if dtype is None else a.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if not isinstance(first, (int, np.integer)):
            return np.asarray(self)[index]
        e = range(len(self.experts))[first]            # negative ids, and IndexError past E
        with _OpenFiles() as open_file:
            a = self._expert(e, open_file)
        return a[rest] if rest else a

    def __repr__(self) -> str:
        first = self.experts[0][0]
        return f"StackedExperts({first.file.name}:{first.name} ..., {self.dtype}{list(self.shape)})"


Source = StoredTensor | StackedExperts


def verify_values(hf: Mapping[str, Source], skip: Collection[str] = ()) -> None:
    """Read every value of a lazy load (`load_checkpoint(lazy=True)`) but those of `skip`'s
    tensors (read already), so each is checked; CheckpointError names the first bad tensor.
    Memory stays at one chunk of one tensor."""
    with _OpenFiles() as open_file:
        for name, source in hf.items():
            if name not in skip:
                source.verify(open_file)


def load_checkpoint(path: str | os.PathLike[str], lazy: bool = False
                    ) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
    """Read an HF checkpoint directory into (config.json as a dict, HF name -> numpy array).

    Arrays keep their stored dtype (bf16 as ``ml_dtypes.bfloat16``, or f32 where the checkpoint
    stores f32); names are the ForCausalLM ones of the family reference's ``param_shapes``,
    routed experts in the layout that table names whichever the checkpoint stores (the
    family's ``expert_layouts``). ``lazy``: each value is a ``StoredTensor`` (or, for experts
    stored per expert, a ``StackedExperts``) instead, read when packed (for full-size models:
    ``place_weights`` then holds one rank's packed bytes and one tensor at a time).
    """
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory does not exist")
    config, family, cfg = _read_config(root)
    expected = family.module("reference").param_shapes(cfg)
    # Pass 1: names, shapes and dtypes from the headers only.
    headers = _read_headers(root, family, expected, cfg.num_hidden_layers)
    _convert_layouts(headers, family, expected)
    headers.raise_mismatches(root, cfg.num_hidden_layers, expected)
    if lazy:
        return config, {name: headers.sources[name] for name in expected}
    # Pass 2: the data, each shard opened once.
    with _OpenFiles() as open_file:
        return config, {name: headers.sources[name].read(open_file) for name in expected}


def _read_config(root: Path) -> tuple[dict[str, Any], Family, Any]:
    """(config.json as a dict, its family, the family reference's config)."""
    if not _exists(root / CONFIG_FILE):
        raise CheckpointError(f"{root}: missing {CONFIG_FILE}")
    config = _read_json(root, CONFIG_FILE, MAX_CONFIG_BYTES, "a Hugging Face config")
    try:
        if not isinstance(config, dict):
            raise TypeError("not a JSON object")
        family = family_of(config)
        cfg = family.module("reference").load_config(config)
    except (ValueError, KeyError, TypeError, AttributeError, OverflowError) as e:
        raise CheckpointError(f"{root / CONFIG_FILE}: unusable config ({e})",
                              hint=getattr(e, "hint", "") or "compare it with a shipped config in "
                                                             "mkc/model/configs") from None
    return config, family, cfg


@dataclass
class _Headers:
    """What the safetensors headers say against the tensors the config expects."""

    sources: dict[str, Source] = field(default_factory=dict)           # name -> where its data is
    problems: list[str] = field(default_factory=list)                   # wrong shapes and dtypes
    unexpected: list[str] = field(default_factory=list)                 # stored names not expected
    # Tensors stored in the other expert layout than the table's (`_convert_layouts`):
    # name the table expects -> the stored tensors it is made of, with their layout.
    other_layout: dict[str, list[tuple[tuple, StoredTensor, str]]] = field(default_factory=dict)
    explained: set[str] = field(default_factory=set)   # absent with a problem that says why

    def raise_mismatches(self, root: Path, layers: int, expected: dict) -> None:
        """Every missing, unexpected or mis-shaped tensor in one error (none: return)."""
        problems = list(self.problems)
        missing = [n for n in expected if n not in self.sources and n not in self.explained]
        if missing:
            problems.insert(0, f"missing {len(missing)} tensor(s): {_listing(missing)}")
        if self.unexpected:
            problems.insert(0, f"{len(self.unexpected)} unexpected tensor(s): "
                               f"{_listing(self.unexpected)}")
        if problems:
            raise CheckpointError(f"{root} does not match its config "
                                  f"({layers} layers):\n  " + "\n  ".join(problems))


def _read_headers(root: Path, family: Family, expected: dict, layers: int) -> _Headers:
    headers = _Headers()
    for file, promised in _weight_files(root).items():
        try:
            with _open_safetensors(file) as f:
                stored = set(f.keys())
                if promised is not None and (absent := sorted(set(promised) - stored)):
                    raise CheckpointError(f"{file}: tensors listed for it in {INDEX_FILE} are not in "
                                          f"the file: {_listing(absent)}")
                for stored_name in sorted(stored):
                    name = _canonical(family, stored_name, layers)
                    if name is None:
                        continue
                    view = f.get_slice(stored_name)
                    shape, code = tuple(view.get_shape()), view.get_dtype()
                    tensor = StoredTensor(file, stored_name, shape, _NUMPY_DTYPES.get(code, np.uint8),
                                          e8m0=name.endswith(family.e8m0_suffixes),
                                          scale=scale_range(name, code))
                    if name in expected:
                        _locate(headers, root, name, tensor, code, expected[name])
                    elif (other := _other_layout(family, name, expected)) is not None:
                        headers.other_layout.setdefault(other[0], []).append((other[1], tensor, code))
                    else:
                        headers.unexpected.append(stored_name)
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from e
    return headers


def scale_range(name: str, code: str) -> ScaleRange | None:
    """The range of the scales tensor `name` (stored as safetensors dtype `code`) holds, by the
    formats' names: an FP8 checkpoint's block scales (`_scale_inv`), NVFP4's e4m3 block scales
    and f32 global scales; None for any other tensor."""
    if name.endswith(fp8_blocks.SCALE_SUFFIX):
        return fp8_blocks.SCALES
    if name.endswith(nvfp4.GLOBAL_SCALE_SUFFIX):
        return nvfp4.GLOBAL_SCALES
    if name.endswith(nvfp4.BLOCK_SCALE_SUFFIX) and _DTYPE_NAMES.get(code) == nvfp4.BLOCK_SCALE_DTYPE.name:
        return nvfp4.BLOCK_SCALES
    return None


def _locate(headers: _Headers, root: Path, name: str, tensor: StoredTensor, code: str,
            want: tuple) -> None:
    """Record a stored tensor of the table's own name, and a problem if its shape or dtype is
    not `want`'s."""
    if name in headers.sources:
        raise CheckpointError(f"{root}: tensor {name} is stored twice "
                              f"({headers.sources[name].file.name} and {tensor.file.name})")
    headers.sources[name] = tensor
    if tensor.shape != want[0]:
        headers.problems.append(f"{name}: shape {list(tensor.shape)}, expected {list(want[0])}")
    if (problem := _dtype_problem(code, want[1], name)) is not None:
        headers.problems.append(f"{name}: {problem}")


def _dtype_problem(code: str, table_dtype: str, name: str) -> str | None:
    """What is wrong with stored dtype `code` for tensor `name` the table types `table_dtype`:
    a float table entry takes any float but an FP8 block scale, which only as its format stores
    it (`fp8_blocks.SCALE_DTYPE`: a bf16 scale is not the published checkpoint's)."""
    accepted = (frozenset({fp8_blocks.SCALE_DTYPE}) if name.endswith(fp8_blocks.SCALE_SUFFIX)
                else stored_dtypes(table_dtype))
    if _DTYPE_NAMES.get(code) in accepted:
        return None
    codes = sorted(c for c, d in _DTYPE_NAMES.items() if d in accepted)
    return f"dtype {code}, expected {' or '.join(codes)}"


# ---------------------------------------------------------------------------------------------
# Routed experts stored in the other layout than the family's table (fused or per expert).


@functools.cache
def _part_pattern(part: str) -> re.Pattern:
    """`layer prefix` + a per-expert name, `{e}` the expert id."""
    return re.compile("(?P<layer>.*)" + re.escape(part).replace(r"\{e\}", r"(?P<e>\d+)") + "$")


def _other_layout(family: Family, name: str, expected: dict
                  ) -> tuple[str, tuple[ExpertLayout, tuple[int, int] | None]] | None:
    """Whether stored tensor `name` (not in the table) is an expert tensor in the layout the
    table does not use: (the fused name it belongs to, (its layout, (expert, part) or None
    for a fused one)); None if it is not."""
    for layout in family.expert_layouts:
        for p, part in enumerate(layout.parts):
            if (m := _part_pattern(part).match(name)) and m["layer"] + layout.fused in expected:
                return m["layer"] + layout.fused, (layout, (int(m["e"]), p))
        layer = name.removesuffix(layout.fused)
        if layer != name and layer + layout.parts[0].format(e=0) in expected:
            return name, (layout, None)
    return None


def _convert_layouts(headers: _Headers, family: Family, expected: dict) -> None:
    """Sources for the table's expert tensors from the stored ones of the other layout: a
    per-expert set stacked into the fused tensor, or a fused tensor sliced per expert; a
    partial set, a wrong shape or dtype, or both layouts of one tensor is a problem naming it."""
    for fused, pieces in headers.other_layout.items():
        if fused in expected:
            _stack(headers, fused, pieces, expected[fused])
        else:
            _split(headers, fused, pieces, expected)


def _stack(headers: _Headers, fused: str, pieces: list, want: tuple) -> None:
    """The table's fused `[E, rows, ...]` tensor from its per-expert parts."""
    layout: ExpertLayout = pieces[0][0][0]
    layer, count, n = fused.removesuffix(layout.fused), want[0][0], len(layout.parts)
    part_shape = (want[0][1] // n, *want[0][2:])
    problems: list[str] = []
    if fused in headers.sources:
        names = [t.name for _, t, _ in pieces]
        problems.append(f"{fused}: stored both fused ({headers.sources.pop(fused).name}) and per "
                        f"expert ({_listing(names)}): keep one layout")
    grid: dict[tuple[int, int], StoredTensor] = {}
    for (_, (e, p)), tensor, code in pieces:
        if e >= count:
            headers.unexpected.append(tensor.name)
            continue
        if (e, p) in grid:
            problems.append(f"{tensor.name}: stored twice ({grid[e, p].file.name} and {tensor.file.name})")
        grid[e, p] = tensor
        if tensor.shape != part_shape:
            problems.append(f"{tensor.name}: shape {list(tensor.shape)}, expected {list(part_shape)} "
                            f"(expert {e} of {fused} {list(want[0])})")
        if (problem := _dtype_problem(code, want[1], fused)) is not None:
            problems.append(f"{tensor.name}: {problem}")
    if len({t.dtype for t in grid.values()}) > 1:
        problems.append(f"{fused}: its per-expert tensors mix dtypes "
                        f"{sorted({t.dtype.name for t in grid.values()})}: store them in one")
    absent = [layer + part.format(e=e) for e in range(count) for p, part in enumerate(layout.parts)
              if (e, p) not in grid]
    if absent:
        problems.append(f"{fused}: stored per expert, but {len(absent)} of its {count * n} "
                        f"per-expert tensors are missing: {_listing(absent)}")
    if problems:
        headers.problems += problems
        headers.explained.add(fused)
        return
    experts = [[grid[e, p] for p in range(n)] for e in range(count)]
    headers.sources[fused] = StackedExperts(experts, want[0], experts[0][0].dtype)


def _split(headers: _Headers, fused: str, pieces: list, expected: dict) -> None:
    """The table's per-expert tensors as slices of a stored fused one."""
    (layout, _), tensor, code = pieces[0]
    layer = fused.removesuffix(layout.fused)
    count = next(e for e in itertools.count() if layer + layout.parts[0].format(e=e) not in expected)
    names = [[layer + part.format(e=e) for part in layout.parts] for e in range(count)]
    part_shape, table_dtype = expected[names[0][0]]
    rows = part_shape[0]
    want = (count, rows * len(layout.parts), *part_shape[1:])
    headers.explained.update(n for per_expert in names for n in per_expert)
    stored_per_expert = [n for per_expert in names for n in per_expert if n in headers.sources]
    if len(pieces) > 1:
        headers.problems.append(f"{fused}: stored twice ({pieces[0][1].file.name} and "
                                f"{pieces[1][1].file.name})")
    elif stored_per_expert:
        headers.problems.append(f"{fused}: stored both fused ({tensor.name}) and per expert "
                                f"({_listing(stored_per_expert)}): keep one layout")
    elif tensor.shape != want:
        headers.problems.append(f"{tensor.name}: shape {list(tensor.shape)}, expected {list(want)} "
                                f"(the fused form of {count} experts' {', '.join(layout.parts)})")
    elif (problem := _dtype_problem(code, table_dtype, names[0][0])) is not None:
        headers.problems.append(f"{tensor.name}: {problem}")
    else:
        for e, per_expert in enumerate(names):
            for p, name in enumerate(per_expert):
                headers.sources[name] = StoredTensor(tensor.file, tensor.name, part_shape, tensor.dtype,
                                                     part=(e, slice(p * rows, (p + 1) * rows)),
                                                     e8m0=tensor.e8m0, scale=tensor.scale)


def save_checkpoint(path: str | os.PathLike[str], config: Mapping[str, Any],
                    params: Mapping[str, np.ndarray], *, max_shard_bytes: int | None = None) -> None:
    """Write config.json and the tensors (as given, unvalidated, so tests can write broken ones).

    With ``max_shard_bytes`` the tensors are split, in order, into
    ``model-0000i-of-0000n.safetensors`` shards plus ``model.safetensors.index.json``.
    """
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    # strict JSON: a NaN or infinite value is a ValueError, never a file mkc's reader refuses
    (root / CONFIG_FILE).write_text(json.dumps(dict(config), indent=2, allow_nan=False) + "\n",
                                    encoding="utf-8")
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
