"""Kimi K3's weights: the layer library's, as `graph.LAYERS` composes them (`DecoderWeights`,
the text-only checkpoint names `mkc.families.kimi_k3.reference.param_shapes` lists), and its
routed experts, which the checkpoint holds per expert in compressed-tensors MXFP4
(`block_sparse_moe.experts.{e}.w{1,3,2}.weight_packed / .weight_scale`): a rank's width slice
as MXFP4 codes and scales in the kernel's K-major layout (`mkc.layers.expert_formats.weights`),
or in the spec's format (FP8 codes; FP4 codes requantized to one scale per block:
`requantized`, `requantization`).
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mkc.families.kimi_k3.config import BLOCK_SCALE, KimiDims
from mkc.families.kimi_k3.graph import (LAYERS, KimiGeometry, KimiSharding, expert_formats,
                                        kimi_k3_geometry, pack_groups)
from mkc.ir import WeightFormat
from mkc.layers.expert_formats import MX_BLOCK
from mkc.layers.expert_formats.weights import (fp4_checkpoint_tensors, fp4_from_mxfp4,
                                               fp8_codes_from_kernel_mxfp4, held_fp4, pack_bf16_scales,
                                               pack_mxfp4_for_kernel)
from mkc.layers.block_residuals import weights as block_weights
from mkc.layers.sublayer import paired
from mkc.layers.weights import DecoderWeights
from mkc.model.mxfp4 import RequantizationError, Requantized
from mkc.model.sharding import ShardTable

# Every tensor but the routed experts' asked of the library kind that owns it; model layer =
# loop layer // 2 (the attention, then the MLP).
_WEIGHTS = DecoderWeights(LAYERS, model_layer=paired)
matrix, layer_vector, embedding = _WEIGHTS.matrix, _WEIGHTS.layer_vector, _WEIGHTS.embedding
reference_states, kernel_states = _WEIGHTS.reference_states, _WEIGHTS.kernel_states


def expert_arrays(hf: Mapping[str, np.ndarray], d: KimiDims, g: KimiGeometry, sh: KimiSharding,
                  layer: int, expert: int, rank: int,
                  formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """One rank's width slice of a routed expert: gate|up and down codes and scales, K-major,
    each matrix in its format (`mkc.layers.expert_formats.tensors`)."""
    e = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
    part, w = rank % sh.expert_tp, g.expert_width
    groups = pack_groups(d, g)
    resolved = expert_formats(d, g, dict(formats or {}))
    # The checkpoint's MXFP4 slices of this rank, [out, in/2] codes and [out, in/32] scales:
    # gate and up: output rows part*w ... (part+1)*w; down: input columns part*w ... (part+1)*w.
    sliced = {x: (np.asarray(hf[e + f"{x}.weight_packed"])[part * w:(part + 1) * w],
                  np.asarray(hf[e + f"{x}.weight_scale"])[part * w:(part + 1) * w])
              for x in ("w1", "w3")}
    sliced["w2"] = (np.asarray(hf[e + "w2.weight_packed"])[:, part * w // 2:(part + 1) * w // 2],
                    np.asarray(hf[e + "w2.weight_scale"])[:, part * w // MX_BLOCK:(part + 1) * w // MX_BLOCK])
    out = {}
    for name, matrices in (("gate_up", ("w1", "w3")), ("down", ("w2",))):
        fmt = resolved[f"expert.{name}"]
        if fmt.name == "fp4":      # e2m1 codes as the checkpoint orders them, [in/2, out]
            parts = [_held(hf, e + x, part * w, w, x == "w2", fmt)
                     or _codes_and_scales(requantized(*sliced[x], fmt, layer, expert, x,
                                                      *((0, part * w) if x == "w2" else (part * w, 0))))
                     for x in matrices]
            packed = [(np.ascontiguousarray(c.T), np.ascontiguousarray(sc.T)) for c, sc in parts]
        else:
            packed = [pack_mxfp4_for_kernel(*sliced[x], groups[name]) for x in matrices]
        out[f"{name}_codes"] = np.concatenate([c for c, _ in packed], axis=1)
        out[f"{name}_scales"] = np.concatenate([sc for _, sc in packed], axis=1)
        if fmt.scale == "bf16":
            out[f"{name}_scales"] = pack_bf16_scales(out[f"{name}_scales"])
    for cls, fmt in resolved.items():
        name = cls.split(".")[1]
        if fmt.name == "fp8":
            try:
                out[f"{name}_codes"], out[f"{name}_scales"] = fp8_codes_from_kernel_mxfp4(
                    out[f"{name}_codes"], out[f"{name}_scales"], groups[name], fmt.block)
            except ValueError as e:
                raise ValueError(f"layer {layer} expert {expert} {cls}, rank {rank}'s slice: {e}; "
                                 f"write `format {cls} fp8` (a scale per {MX_BLOCK} rows, "
                                 "always exact) or a smaller block") from None
    return out


def _codes_and_scales(r: Requantized) -> tuple[np.ndarray, np.ndarray]:
    return r.codes, r.scales


def _held(hf: Mapping[str, np.ndarray], matrix: str, first: int, width: int, columns: bool,
          fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray] | None:
    """A rank's slice of a routed expert matrix a requantized checkpoint already holds in
    `fmt` (`held_fp4`); None where the checkpoint holds MXFP4."""
    if f"{matrix}.{BLOCK_SCALE}" not in hf:
        return None
    return held_fp4(hf[f"{matrix}.weight_packed"], hf[f"{matrix}.weight_scale"],
                    hf[f"{matrix}.{BLOCK_SCALE}"], fmt, first, width, columns, matrix)


_EXPERT_CLASS = {"w1": "expert.gate_up", "w3": "expert.gate_up", "w2": "expert.down"}
_MATRIX_NAME = {"w1": "gate", "w3": "up", "w2": "down"}


def requantized(codes: np.ndarray, scales: np.ndarray, fmt: WeightFormat, layer: int,
                expert: int, matrix: str, out0: int = 0, in0: int = 0) -> Requantized:
    """Checkpoint MXFP4 codes and scales of routed expert matrix `matrix` (w1, w3, w2)
    requantized to `fmt`'s fp4 blocks (`mkc.layers.expert_formats.weights.fp4_from_mxfp4`)."""
    return fp4_from_mxfp4(codes, scales, fmt, _EXPERT_CLASS[matrix],
                          f"layer {layer} expert {expert}'s {_MATRIX_NAME[matrix]} ({matrix})", out0, in0)


def requantization(hf: Mapping[str, np.ndarray], d: KimiDims,
                   formats: Mapping[str, WeightFormat], shards: ShardTable,
                   layers: Sequence[int] | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The routed experts as the kernel holds them, at the checkpoint level: each fp4 class's
    matrices requantized (their blocks of input rows are those of every rank's slice: a block
    divides the slice), as MXFP4 tensors whose 32-row scales are equal within a block (so the
    reference decodes the kernel's values exactly; `scale bf16`: codes under 32-row scales of 1
    and the bf16 block scales beside them, `BLOCK_SCALE`), and per class the error against the
    checkpoint's values: values, changed, blocks, inexact blocks, max abs, relative RMS.
    FormatError where a class without `rounded` cannot be held exactly."""
    g, _ = _layout(d, shards)
    fp4 = {cls: f for cls, f in expert_formats(d, g, dict(formats)).items() if f.name == "fp4"}
    out: dict[str, np.ndarray] = {}
    totals = {cls: RequantizationError() for cls in fp4}
    moe_layers = ([i for i, (_, mlp) in enumerate(d.layer_plan()) if mlp == "moe"]
                  if layers is None else layers)
    for layer in moe_layers:
        for e in range(d.experts):
            p = f"model.layers.{layer}.block_sparse_moe.experts.{e}."
            for x in ("w1", "w3", "w2"):
                fmt = fp4.get(_EXPERT_CLASS[x])
                if fmt is None:
                    continue
                r = requantized(np.asarray(hf[p + f"{x}.weight_packed"]),
                                np.asarray(hf[p + f"{x}.weight_scale"]), fmt, layer, e, x)
                codes, scales, block_scales = fp4_checkpoint_tensors(r)
                out[p + f"{x}.weight_packed"], out[p + f"{x}.weight_scale"] = codes, scales
                if block_scales is not None:
                    out[p + f"{x}.{BLOCK_SCALE}"] = block_scales
                totals[_EXPERT_CLASS[x]].add(r)
    report = {cls: totals[cls].report(fmt.spelled) for cls, fmt in fp4.items()}
    return out, report


# ---- the host layout API the generic module template calls ---------------------------------
def _layout(d: KimiDims, shards: ShardTable) -> tuple[KimiGeometry, KimiSharding]:
    """The K3 geometry of the schedule's shard table, as the graph derived it."""
    sh = KimiSharding.from_rules({c: (w, s) for c, w, s in shards.rules}, shards.ranks)
    return kimi_k3_geometry(d, sh), sh


def expert(hf: Mapping[str, np.ndarray], d: KimiDims, per_rank: dict[str, int], layer: int,
           local: int, rank: int, shards: ShardTable,
           formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank`'s group as the pool holds it: codes (in their formats)
    and scales."""
    g, sh = _layout(d, shards)
    group = rank // sh.expert_tp
    return expert_arrays(hf, d, g, sh, layer // 2, group * g.local_experts + local, rank,
                         formats)


def head_vectors(hf: Mapping[str, np.ndarray], d: KimiDims, rank: int, shards: ShardTable) -> np.ndarray:
    """The final norm, then the output mixture's norm and projection."""
    return np.concatenate([_WEIGHTS.head_vectors(hf, d, rank, shards), block_weights.head_vectors(hf)])
