"""Host-side requantization of the dense classes' matrices into 8-bit codes with one scale per
output column (`mkc.layers.dense_formats`, whose rules use `QMAX`), at weight-load time (numpy,
no jax: packing in `mkc.runtime.host` and `mkc.requantize` use it).

A kernel matrix is cut from checkpoint tensors (`[out, in]` PyTorch weights, each kernel column
one of their rows) by the family's `weights.matrix`. A column's scale is its checkpoint row's,
over all of the row's inputs, so every rank holding part of a row-parallel matrix's inputs
multiplies its partial sum by the same scale. The checkpoint tensors a class reads are found by
asking `weights.matrix` for each of its matrices from a checkpoint that records what is read
(`sources`); a tensor read by matrices of two formats is refused (it cannot hold both).

`held(hf, sources)` is the checkpoint as the kernel holds it: each such tensor's values codes x
scale (exact in f32), lazily, row by row where a rank reads whole rows (`Channel`); `scales(hf,
sources)` the same tensors holding each row's scale in every input, so that `weights.matrix`
of them gives each kernel column's scale. `kernel_codes` turns a rank's matrix of held values
and its scales into the codes packing stores.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from mkc.model.family import FormatError
from mkc.model.mxfp4 import RequantizationError, Requantized

# Each code type's largest magnitude: a column's scale maps its largest value onto it.
QMAX = {"fp8": 448.0, "int8": 127.0}


def channel_scales(w: np.ndarray, codes: str) -> np.ndarray:
    """Each row's scale of `w` [out, in]: the bf16 value nearest its largest magnitude over the
    code's largest (f32 [out]; 0 for an all-zero row). Rounding to nearest keeps the largest
    code at its largest: |a / s - q| <= q 2**-8 < 0.5 (int8), and e4m3's 448 is the nearest of
    its values to anything within 448 (1 +- 2**-8)."""
    top = np.abs(np.asarray(w, np.float64)).max(axis=-1, initial=0.0)
    return (top / QMAX[codes]).astype(np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def quantize(w: np.ndarray, scale: np.ndarray, codes: str) -> np.ndarray:
    """Rows of `w` [out, in] over their `scale` [out] as codes' values (f64; the nearest code,
    ties to even, clipped to the code's range; 0 where the scale is)."""
    s = np.asarray(scale, np.float64)[:, None]
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(s > 0, np.asarray(w, np.float64) / s, 0.0)
    v = np.clip(v, -QMAX[codes], QMAX[codes])
    if codes == "int8":
        return np.rint(v)
    return v.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)


def requantize(w: np.ndarray, codes: str) -> tuple[np.ndarray, np.ndarray, Requantized]:
    """`w` [out, in] -> (its values as held: codes x scale, f32 exact; the row scales, f32;
    how far it moved, one "block" a row)."""
    w = np.asarray(w, np.float32)
    if not np.isfinite(w).all():
        raise ValueError("a value that is not finite cannot be requantized")
    scale = channel_scales(w, codes)
    held = (quantize(w, scale, codes) * scale[:, None]).astype(np.float32)
    err = np.abs(held.astype(np.float64) - w)
    moved = (err != 0).any(axis=-1)
    return held, scale, Requantized(
        codes=np.empty(0, np.uint8), scales=scale, block=w.shape[-1], values=int(err.size),
        changed=int(np.count_nonzero(err)), blocks=int(moved.size), inexact_blocks=int(moved.sum()),
        max_abs=float(err.max(initial=0.0)), sq_err=float(np.sum(err * err)),
        sq_ref=float(np.sum(w.astype(np.float64) ** 2)))


def kernel_codes(values: np.ndarray, scales: np.ndarray, codes: str, what: str
                 ) -> tuple[np.ndarray, np.ndarray]:
    """A rank's matrix [in, out] of held values and its scales cut the same way (every row the
    columns' scales) -> (the codes' bytes uint8 [in, out], the column scales f32 [out]).
    ValueError where a column's scale varies down it (the layout fed a checkpoint row as an
    input: no per-column scale factors out) or a value is no code times its scale."""
    if scales.shape[0] and (scales != scales[:1]).any():
        raise ValueError(f"{what}: the scales vary down a column, so a checkpoint row feeds it as "
                         "inputs and no per-column scale factors out of its dot")
    col = scales[0] if scales.shape[0] else np.zeros(values.shape[1], np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        v = np.where(col > 0, values.astype(np.float64) / col, 0.0)
    if codes == "int8":
        stored = v.astype(np.int8)
    else:
        stored = v.astype(np.float32).astype(ml_dtypes.float8_e4m3fn)
    if (stored.astype(np.float64) != v).any():
        raise ValueError(f"{what}: a value is not a {codes} code times its column's scale")
    return np.ascontiguousarray(stored.view(np.uint8)), col.astype(np.float32)


# ---- which checkpoint tensors a class reads ---------------------------------------------------
class _Recording(Mapping):
    """A checkpoint that hands out zeros of each tensor's shape and records the names read."""

    def __init__(self, hf: Mapping):
        self.hf = hf
        self.read: set[str] = set()

    def __getitem__(self, name: str):
        shape = self.hf[name].shape
        self.read.add(name)
        return np.broadcast_to(np.zeros((), np.float32), shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.hf)

    def __len__(self) -> int:
        return len(self.hf)


@dataclass(frozen=True)
class Member:
    """A kernel matrix: loop layer (-1: after the last), layer kind ("tail"), family name, its
    codes ("bf16" for a matrix left as it is) and dense class."""

    layer: int
    kind: str
    name: str
    codes: str = "bf16"
    format_class: str = ""


def sources(layout, hf: Mapping, dims, per_rank, shards, matrices: Sequence[Member]
            ) -> dict[str, Member]:
    """The checkpoint tensors each matrix stored as codes reads -> the first such matrix (its
    codes and class). FormatError where a tensor is also read by a matrix stored otherwise."""
    first: dict[str, Member] = {}
    for m in matrices:
        rec = _Recording(hf)
        layout.matrix(rec, dims, per_rank, m.layer, m.kind, m.name, 0, shards)
        for name in sorted(rec.read):
            other = first.setdefault(name, m)
            if other.codes != m.codes:
                a, b = (m, other) if m.codes != "bf16" else (other, m)
                raise FormatError(a.format_class, f"{a.kind}.{a.name} ({a.format_class}, "
                                  f"{a.codes}) reads checkpoint tensor {name}, which "
                                  f"{b.kind}.{b.name} also reads, stored as {b.codes}: one "
                                  "tensor holds one format", f"store "
                                  f"{b.format_class or b.kind + '.' + b.name} as {a.codes} too, "
                                  f"or keep {a.format_class} bf16")
    out = {name: m for name, m in first.items() if m.codes != "bf16"}
    return out


# ---- the checkpoint as the kernel holds it ----------------------------------------------------
class Channel:
    """A checkpoint tensor [out, in] requantized to `codes` with a scale per row, read lazily:
    indexing that keeps whole rows requantizes just those; any other reads the whole tensor.
    `part` "values" gives the held values (codes x scale), "scales" each row's scale in every
    input."""

    def __init__(self, stored, codes: str, part: str = "values"):
        self.stored, self.codes, self.part = stored, codes, part
        self.shape = tuple(stored.shape)
        self.dtype = np.dtype(np.float32)
        self.ndim = len(self.shape)

    def _of(self, w: np.ndarray) -> np.ndarray:
        held, scale, _ = requantize(w, self.codes)
        return held if self.part == "values" else np.broadcast_to(scale[:, None], w.shape)

    def __array__(self, dtype=None, copy=None):
        out = self._of(np.asarray(self.stored))
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, index):
        rows_only = not isinstance(index, tuple) or all(
            isinstance(i, slice) and i == slice(None) for i in index[1:])
        if rows_only:
            first = index[0] if isinstance(index, tuple) else index
            w = np.asarray(self.stored[first])
            return self._of(w.reshape(-1, self.shape[-1])).reshape(w.shape)
        return np.asarray(self)[index]


def held(hf: Mapping, tensors: Mapping[str, Member], part: str = "values") -> dict:
    """`hf` with each tensor of `tensors` (`sources`) as `Channel` reads it: its held values,
    or with `part` "scales" its rows' scales."""
    return {**hf, **{name: Channel(hf[name], m.codes, part) for name, m in tensors.items()}}


def requantization(hf: Mapping, tensors: Mapping[str, Member], formats: Mapping
                   ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The tensors of `tensors` (`sources`) as the kernel holds them (f32: codes x scale,
    exact) and per class the error against the checkpoint's values (values, changed, channels
    as blocks, inexact ones, max abs, relative RMS; `formats`: class -> its WeightFormat)."""
    out: dict[str, np.ndarray] = {}
    totals: dict[str, RequantizationError] = {}
    for name, m in sorted(tensors.items()):
        w = np.asarray(hf[name], np.float32)
        if w.ndim != 2:
            raise FormatError(m.format_class, f"{m.format_class} reads checkpoint tensor {name} "
                              f"of shape {w.shape}: a scale per output column needs [out, in] "
                              "weights", f"keep {m.format_class} bf16")
        values, _, r = requantize(w, m.codes)
        out[name] = values
        totals.setdefault(m.format_class, RequantizationError()).add(r)
    return out, {cls: totals[cls].report(formats[cls].spelled) for cls in sorted(totals)}
