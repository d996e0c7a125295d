"""Where each per-rank weight family of Qwen3.5 MoE comes from in the HF checkpoint.

The layer loop runs two sublayers per model layer (attention, then MoE), so `layer` here is a
sublayer index; model layer = layer // 2. The attention sublayers' tensors, the norms and the
vocabulary's are the layer library's (`mkc.layers.weights`). Routed experts come fused, as
upstream declares them: `mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) and
`mlp.experts.down_proj [E, H, I]` (`mkc.checkpoint` fuses a per-expert checkpoint's into
these; with a lazy load each `hf[name][e]` reads one expert). A class the spec stores as FP8
(`format expert.gate_up fp8 block N rounded`) is requantized here, block by block of input
rows (`requantization`, `mkc.model.mxfp4.requantize_fp8_blocks`), into Kimi K3's
codes-and-scales layout.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence

import ml_dtypes
import numpy as np

from mkc.families.qwen3_5_moe.config import Qwen35MoeDims
from mkc.families.qwen3_5_moe.graph import LAYERS, expert_formats
from mkc.ir import WeightFormat
from mkc.layers.weights import DecoderWeights
from mkc.model.mxfp4 import RequantizationError, fp8_block_values, requantize_fp8_blocks
from mkc.model.sharding import ShardTable

# Checkpoint tensors of each routed-expert class ([E, out, in], fused), under `mlp.experts.`.
_EXPERT_TENSORS = {"expert.gate_up": "gate_up_proj", "expert.down": "down_proj"}

_ATTENTION = DecoderWeights(LAYERS, model_layer=lambda layer: layer // 2)
head_vectors, embedding = _ATTENTION.head_vectors, _ATTENTION.embedding


def _w(hf: Mapping[str, np.ndarray], name: str) -> np.ndarray:
    return np.asarray(hf[name]).astype(np.float32)


def moe_matrix(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, layer: int, family: str,
               rank: int, shards: ShardTable) -> np.ndarray:
    """The [in, out] matrix `family` of MoE sublayer `layer` on `rank`."""
    p = f"model.layers.{layer // 2}.mlp."
    if family == "router":
        return _w(hf, p + "gate.weight").T                                   # [H, E]
    n = d.shared_expert_intermediate_size // shards.ways("mlp")
    part = shards.part("mlp", rank)
    cols = slice(part * n, (part + 1) * n)
    if family == "shared_gate_up":
        return np.concatenate([_w(hf, p + "shared_expert.gate_proj.weight")[cols].T,
                               _w(hf, p + "shared_expert.up_proj.weight")[cols].T], axis=1)
    if family == "shared_down":
        return _w(hf, p + "shared_expert.down_proj.weight")[:, cols].T
    raise KeyError(f"no HF source for MoE matrix {family!r}")


def expert_matrix(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, layer: int, local: int,
                  name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """Local expert `local` of `rank`'s share ([in, out]): experts split evenly over the ranks."""
    e = shards.part("experts", rank) * (d.experts // shards.ways("experts")) + local
    p = f"model.layers.{layer // 2}.mlp.experts."
    if name == "gate_up":
        return np.asarray(hf[p + "gate_up_proj"][e]).astype(np.float32).T   # [H, 2I]: gate | up
    if name == "down":
        return np.asarray(hf[p + "down_proj"][e]).astype(np.float32).T      # [I, H]
    raise KeyError(f"no HF source for expert matrix {name!r}")


def matrix(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, per_rank: dict[str, int], layer: int,
           kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """Matrix `name` of loop layer `layer` (kind `kind`; -1 and "tail" after the last layer)."""
    if kind == "moe":
        return moe_matrix(hf, d, layer, name, rank, shards)
    return _ATTENTION.matrix(hf, d, per_rank, layer, kind, name, rank, shards)


def layer_vector(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, per_rank: dict[str, int], layer: int,
                 kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    p = f"model.layers.{layer // 2}."
    if name == "shared_gate":
        return _w(hf, p + "mlp.shared_expert_gate.weight")   # [1, H]
    if name == "post_norm":
        return _w(hf, p + "post_attention_layernorm.weight")[None, :]
    return _ATTENTION.layer_vector(hf, d, per_rank, layer, kind, name, rank, shards)


def expert(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims, per_rank: dict[str, int], layer: int,
           local: int, rank: int, shards: ShardTable,
           formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank` as the pool holds it, [in, out] by matrix: bf16 by its
    name, or FP8 codes and E8M0 scales per block of input rows (`{name}_codes`,
    `{name}_scales`, `mkc.families.kimi_k3.graph.expert_codes`' layout)."""
    out = {}
    for cls, fmt in expert_formats(d, dict(formats or {})).items():
        name = cls.split(".")[1]
        m = expert_matrix(hf, d, layer, local, name, rank, shards)
        if fmt.name == "fp8":
            r = requantize_fp8_blocks(m.T, fmt.block)            # blocks of input rows
            out[f"{name}_codes"] = np.ascontiguousarray(r.codes.T)
            out[f"{name}_scales"] = np.ascontiguousarray(r.scales.T)
        else:
            out[name] = m.astype(ml_dtypes.bfloat16)
    return out


def requantization(hf: Mapping[str, np.ndarray], d: Qwen35MoeDims,
                   formats: Mapping[str, WeightFormat], shards: ShardTable,
                   layers: Sequence[int] | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The routed experts as the kernel holds them, at the checkpoint level: each FP8 class's
    fused tensors requantized expert by expert (blocks of input rows, as packing cuts them:
    experts are whole on every rank), as bf16 (every e4m3 value times a power of two is one,
    so the reference reads the kernel's values exactly), and per class the error against the
    checkpoint's values (values, changed, blocks, inexact blocks, max abs, relative RMS)."""
    fp8 = {cls: f for cls, f in expert_formats(d, dict(formats)).items() if f.name == "fp8"}
    out: dict[str, np.ndarray] = {}
    totals = {cls: RequantizationError() for cls in fp8}
    for layer in range(d.num_hidden_layers) if layers is None else layers:
        for cls, fmt in fp8.items():
            name = f"model.layers.{layer}.mlp.experts.{_EXPERT_TENSORS[cls]}"
            held = []
            for e in range(d.experts):
                r = requantize_fp8_blocks(np.asarray(hf[name][e]).astype(np.float32), fmt.block)
                totals[cls].add(r)
                held.append(fp8_block_values(r).astype(np.float32).astype(ml_dtypes.bfloat16))
            out[name] = np.stack(held)
    return out, {cls: totals[cls].report(fmt.spelled) for cls, fmt in fp8.items()}


def reference_states(state, d: Qwen35MoeDims, per_rank: dict[str, int], shards: ShardTable,
                     kind_layers: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """Qwen3.5's state layouts, keyed by model layer (sublayer // 2)."""
    return _ATTENTION.reference_states(state, d, per_rank, shards, kind_layers)
