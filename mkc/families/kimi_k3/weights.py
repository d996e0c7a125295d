"""Where each per-rank weight family of kimi_k3 comes from in the checkpoint.

Names are the text-only checkpoint names `mkc.families.kimi_k3.reference.param_shapes` lists. Matrices
come back `[in, out]` f32 (Linear weights are `[out, in]`), cut to one rank's share as
`mkc.families.kimi_k3.graph` shapes it; routed experts come back as MXFP4 codes and scales in the
kernel's K-major layout (`mkc.layers.expert_formats.weights`), or in the spec's format (FP8 codes;
FP4 codes requantized to one scale per block: `requantized`, `requantization`). A split that
does not fill the last ranks (the latent, latent_up's columns, the router's experts) leaves
zeros there, so the all-gathered result is the real width followed by zero padding.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from mkc.families.kimi_k3.config import BLOCK_SCALE, KimiDims
from mkc.families.kimi_k3.graph import (ATTENTION, MOE, KimiGeometry, KimiSharding, expert_formats,
                                        kimi_k3_geometry, pack_groups)
from mkc.ir import WeightFormat
from mkc.layers.expert_formats import MX_BLOCK
from mkc.layers.expert_formats.weights import (fp4_checkpoint_tensors, fp4_from_mxfp4,
                                               fp8_codes_from_kernel_mxfp4, held_fp4, pack_bf16_scales,
                                               pack_mxfp4_for_kernel)
from mkc.layers.kda import weights as kda_weights
from mkc.layers.mla import weights as mla_weights
from mkc.model.mxfp4 import RequantizationError, Requantized
from mkc.model.sharding import ShardTable

# the layer library's attention kinds (their tensors: `mkc.layers.kda.weights`, `mkc.layers.mla.weights`)
KDA, MLA = ATTENTION["kda"], ATTENTION["mla"]


def _w(hf: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(hf[name]).astype(np.float32)


def _block(m: np.ndarray, axis: int, index: int, width: int) -> np.ndarray:
    """Block `index` of `width` along `axis`, zero padded where it runs past the end."""
    start = index * width
    part = np.take(m, np.arange(start, min(start + width, m.shape[axis])), axis=axis)
    pad = [(0, 0)] * m.ndim
    pad[axis] = (0, width - part.shape[axis])
    return np.pad(part, pad)


def _heads(part: int, g: KimiGeometry) -> list[int]:
    """The attention heads of heads part `part` (`KimiSharding.head_part`)."""
    return list(range(part * g.heads, (part + 1) * g.heads))


def _mla_matrix(hf, d, g, sh, p, family, rank):
    return mla_weights.matrix_of_heads(MLA, hf, d, p, family, _heads(sh.head_part(rank), g))


def _kda_matrix(hf, d, g, sh, p, family, rank):
    return kda_weights.matrix_of_heads(KDA, hf, d, p, family, _heads(sh.head_part(rank), g))


def _swiglu(hf, prefix: str, family: str, rank: int, width: int) -> np.ndarray:
    """A SwiGLU MLP's rank share, `width` of its columns: gate|up [in, 2 x width] or down."""
    if family == "gate_up":
        return np.concatenate([_block(_w(hf, prefix + f"{x}_proj.weight"), 0, rank, width)
                               for x in ("gate", "up")], axis=0).T
    return _block(_w(hf, prefix + "down_proj.weight").T, 0, rank, width)


def _dense_matrix(hf, d, g, sh, p, family, rank):
    if family in ("gate_up", "down"):
        return _swiglu(hf, p + "mlp.", family, rank, g.inter)
    raise KeyError(f"no dense weight family {family!r}")


def _mla_vector(hf, d, g, sh, p, name, rank):
    return mla_weights.vector(MLA, hf, d, p, name, rank, None)


def _kda_vector(hf, d, g, sh, p, name, rank):
    return kda_weights.vector_of_heads(KDA, hf, d, p, name, _heads(sh.head_part(rank), g))


def _no_vectors(hf, d, g, sh, p, name, rank):
    raise KeyError(f"no dense vector family {name!r}")


# Per sublayer kind: (its matrices, its vectors), each as (checkpoint, dims, geometry, sharding,
# layer prefix, family, rank) -> one rank's f32 array.
_KIND_TENSORS = {"mla": (_mla_matrix, _mla_vector), "kda": (_kda_matrix, _kda_vector),
                 "dense": (_dense_matrix, _no_vectors)}
# the residual mixes' and norms' vectors every sublayer kind holds
_SUBLAYER_VECTORS = {"attn_res_norm": "self_attention_res_norm.weight",
                     "attn_res_proj": "self_attention_res_proj.weight",
                     "mlp_res_norm": "mlp_res_norm.weight", "mlp_res_proj": "mlp_res_proj.weight",
                     "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}


def family_matrix(hf: Mapping[str, np.ndarray], d: KimiDims, g: KimiGeometry, sh: KimiSharding,
                  layer: int, kind: str, family: str, rank: int) -> np.ndarray:
    """One rank's [in, out] matrix of a sublayer kind's family, as f32."""
    return _KIND_TENSORS[kind][0](hf, d, g, sh, f"model.layers.{layer}.", family, rank)


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


def vector(hf: Mapping[str, np.ndarray], d: KimiDims, g: KimiGeometry, sh: KimiSharding,
           layer: int, kind: str, name: str, rank: int) -> np.ndarray:
    """One rank's per-layer vector family, [rows, width] f32."""
    p = f"model.layers.{layer}."
    if name in _SUBLAYER_VECTORS:
        return _w(hf, p + _SUBLAYER_VECTORS[name]).reshape(1, -1)
    return _KIND_TENSORS[kind][1](hf, d, g, sh, p, name, rank)


def global_tensor(hf: Mapping[str, np.ndarray], d: KimiDims, sh: KimiSharding, name: str,
                  rank: int) -> np.ndarray:
    vocab = d.vocab_size // sh.ranks
    if name == "embed":
        # indexed before it is an array: a lazily loaded checkpoint reads just this part
        return np.asarray(hf["model.embed_tokens.weight"][rank * vocab:(rank + 1) * vocab])
    if name == "lm_head":
        return _w(hf, "lm_head.weight")[rank * vocab:(rank + 1) * vocab].T
    names = {"final_norm": "model.norm.weight", "output_res_norm": "model.output_attn_res_norm.weight",
             "output_res_proj": "model.output_attn_res_proj.weight"}
    return _w(hf, names[name]).reshape(1, -1)


# ---- the host layout API the generic module template calls ---------------------------------
def _layout(d: KimiDims, shards: ShardTable) -> tuple[KimiGeometry, KimiSharding]:
    """The K3 geometry of the schedule's shard table, as the graph derived it."""
    sh = KimiSharding.from_rules({c: (w, s) for c, w, s in shards.rules}, shards.ranks)
    return kimi_k3_geometry(d, sh), sh


def matrix(hf: Mapping[str, np.ndarray], d: KimiDims, per_rank: dict[str, int], layer: int, kind: str,
           name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """Matrix `name` of loop layer `layer` (a sublayer: model layer layer // 2), or of the tail."""
    g, sh = _layout(d, shards)
    if kind == "tail":
        return global_tensor(hf, d, sh, name, rank)
    if kind == "moe":          # the library MoE's latent cuts (`mkc.layers.moe.weights`)
        return MOE.module("weights").matrix(MOE, hf, d, f"model.layers.{layer // 2}.", name, rank, shards)
    return family_matrix(hf, d, g, sh, layer // 2, kind, name, rank)


def layer_vector(hf: Mapping[str, np.ndarray], d: KimiDims, per_rank: dict[str, int], layer: int,
                 kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    g, sh = _layout(d, shards)
    if kind == "moe" and name not in _SUBLAYER_VECTORS:
        return MOE.module("weights").vector(MOE, hf, d, f"model.layers.{layer // 2}.", name, rank, shards)
    return vector(hf, d, g, sh, layer // 2, kind, name, rank)


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
    _, sh = _layout(d, shards)
    return np.concatenate([global_tensor(hf, d, sh, name, rank)
                           for name in ("final_norm", "output_res_norm", "output_res_proj")])


def embedding(hf: Mapping[str, np.ndarray], d: KimiDims, rank: int, shards: ShardTable) -> np.ndarray:
    return np.asarray(global_tensor(hf, d, _layout(d, shards)[1], "embed", rank))


def _model_layers(kind_layers: dict[str, list[int]], kind: str) -> list[int]:
    """The model layers of loop layers of `kind` (a model layer's attention sublayer: loop layer
    2 i)."""
    return [layer // 2 for layer in kind_layers.get(kind, [])]


def reference_states(state, d: KimiDims, per_rank: dict[str, int], shards: ShardTable,
                     kind_layers: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The decode state gathered over ranks into the reference's layouts, each attention
    kind's by its library weights module (`mkc.layers.kda.weights`: conv and recurrent states,
    `mkc.layers.mla.weights`: the latent caches)."""
    out: dict[str, np.ndarray] = {}
    for kind, sub in ATTENTION.items():
        out |= sub.module("weights").reference_states(sub, state, d, per_rank, shards, kind,
                                                      _model_layers(kind_layers, kind))
    return out


def kernel_states(ref: Mapping[str, np.ndarray], d: KimiDims, per_rank: dict[str, int],
                  shards: ShardTable, kind_layers: dict[str, list[int]],
                  shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """The inverse of `reference_states`: the reference's states as the kernel's per-rank state
    arrays (`shapes`: the kernel's per-rank state table)."""
    out: dict[str, np.ndarray] = {}
    for kind, sub in ATTENTION.items():
        out |= sub.module("weights").kernel_states(sub, ref, d, per_rank, shards, kind,
                                                   _model_layers(kind_layers, kind), shapes)
    return out
