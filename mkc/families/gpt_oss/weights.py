"""Where each per-rank weight of GPT-OSS comes from in the published checkpoint
(`GptOssForCausalLM`'s names, `mkc.families.gpt_oss.reference.param_shapes`), cut as
`mkc.families.gpt_oss.graph` shapes it.

The layer loop runs two sublayers per model layer (attention, then MoE), so `layer` here is a
sublayer index; model layer = layer // 2. Matrices come back `[in, out]` f32 (Linear weights
are `[out, in]`), vectors `[1, n]` f32:

* attention (`swa` and `gqa` alike): the layer library's GQA (`mkc.layers.gqa.weights`):
  `qkv` = this heads part's rows of `q_proj` then those of `k_proj` and `v_proj` for the KV
  heads it holds, transposed; `qkv_bias` the same rows of the three biases; `sinks` this
  part's heads; `o_proj` this part's input columns; `o_bias`, the norms whole;
* MoE: `router` and `router_bias` whole (every core scores every expert);
* a routed expert (`expert`): this rank's local expert `local` is expert `rank * local_experts
  + local`. Its MXFP4 `*_blocks [out, in/32, 16]` (16 bytes a block, in order: the codes
  `[out, in/2]` of `mkc.model.mxfp4`) and `*_scales [out, in/32]` are moved, never decoded:
  gate_up's rows de-interleaved into lane-padded `[gate | up]` halves
  (`deinterleave_gate_up`), down's input columns padded to the same half width with zero
  codes, then both put K-major in pack groups (`mkc.layers.expert_formats.weights.pack_mxfp4_for_kernel`,
  `graph.pack_groups`), or turned into FP8 codes when the spec's format says so; the biases
  de-interleaved the same way, as bf16 rows. With a lazily loaded checkpoint `hf[name][e]`
  reads one expert.
"""
from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from mkc.families.gpt_oss.config import MOE_KIND, GptOssDims
from mkc.families.gpt_oss.graph import ATTENTION, expert_formats, pack_groups
from mkc.ir import WeightFormat
from mkc.layers.expert_formats.weights import fp8_codes_from_kernel_mxfp4, pack_mxfp4_for_kernel
from mkc.layers.weights import DecoderWeights
from mkc.model.graph import lane_pad
from mkc.model.sharding import ShardTable


def _w(hf: Mapping[str, np.ndarray], name: str, index=None) -> np.ndarray:
    """Tensor `name` (its part `index`) as f32, indexed before it is converted: a lazily loaded
    checkpoint then reads only this rank's part."""
    return np.asarray(hf[name] if index is None else hf[name][index]).astype(np.float32)


_ATTENTION = DecoderWeights(ATTENTION, model_layer=lambda layer: layer // 2)
head_vectors, embedding = _ATTENTION.head_vectors, _ATTENTION.embedding


def deinterleave_gate_up(rows: np.ndarray, half: int) -> np.ndarray:
    """The checkpoint's gate|up along axis 0 (``[2I, ...]``: gate at even indices, up at odd,
    upstream's ``gate_up[..., ::2]`` and ``[..., 1::2]``) -> ``[2 * half, ...]``: the gate rows,
    zeros up to ``half``, the up rows, zeros up to ``2 * half``. Works on any trailing axes (a
    weight's MXFP4 codes or scales, a bias), so packing moves bytes and rounds nothing."""
    rows = np.asarray(rows)
    width = rows.shape[0] // 2
    if rows.shape[0] % 2 or half < width:
        raise ValueError(f"{rows.shape[0]} gate|up rows do not make two halves of at most {half}")
    pad = [(0, half - width)] + [(0, 0)] * (rows.ndim - 1)
    return np.concatenate([np.pad(rows[0::2], pad), np.pad(rows[1::2], pad)], axis=0)


def _codes(blocks: np.ndarray) -> np.ndarray:
    """`*_blocks [out, in/32, 16]` -> the codes `[out, in/2]` (each block's bytes in order)."""
    blocks = np.asarray(blocks, np.uint8)
    return blocks.reshape(blocks.shape[0], -1)


def expert_arrays(hf: Mapping[str, np.ndarray], d: GptOssDims, layer: int, expert: int,
                  formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Routed expert `expert` of sublayer `layer` as its slot holds it (module docstring):
    codes and scales K-major in the resolved formats, biases bf16 `[1, n]`."""
    p = f"model.layers.{layer // 2}.mlp.experts."
    half = lane_pad(d.intermediate_size)
    groups = pack_groups(d)
    gate_up = pack_mxfp4_for_kernel(
        deinterleave_gate_up(_codes(hf[p + "gate_up_proj_blocks"][expert]), half),
        deinterleave_gate_up(np.asarray(hf[p + "gate_up_proj_scales"][expert], np.uint8), half),
        groups["gate_up"])
    pad = half - d.intermediate_size                  # down's input columns: zero codes
    down = pack_mxfp4_for_kernel(
        np.pad(_codes(hf[p + "down_proj_blocks"][expert]), ((0, 0), (0, pad // 2))),
        np.pad(np.asarray(hf[p + "down_proj_scales"][expert], np.uint8), ((0, 0), (0, pad // 32))),
        groups["down"])
    resolved = expert_formats(d, dict(formats or {}))
    out = {}
    for name, (codes, scales) in (("gate_up", gate_up), ("down", down)):
        fmt = resolved[f"expert.{name}"]
        if fmt.name == "fp8":
            codes, scales = fp8_codes_from_kernel_mxfp4(codes, scales, groups[name], fmt.block)
        out[f"{name}_codes"], out[f"{name}_scales"] = codes, scales
        bias = np.asarray(hf[p + f"{name}_proj_bias"][expert]).astype(np.float32)
        bias = deinterleave_gate_up(bias, half) if name == "gate_up" else bias
        out[f"{name}_bias"] = bias[None, :].astype(ml_dtypes.bfloat16)
    return {n: out[n] for n in ("gate_up_codes", "gate_up_scales", "gate_up_bias",
                                "down_codes", "down_scales", "down_bias")}


# ---- the host layout API the generic module template calls (contracts.Weights) -------------
def matrix(hf: Mapping[str, np.ndarray], d: GptOssDims, per_rank: dict[str, int], layer: int,
           kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """The `[in, out]` matrix `name` of sublayer `layer` (kind `kind`; -1 and "tail": the
    lm_head) on `rank`: the router's here, the rest the library's."""
    if kind == MOE_KIND and name == "router":
        return _w(hf, f"model.layers.{layer // 2}.mlp.router.weight").T          # [H, E]
    return _ATTENTION.matrix(hf, d, per_rank, layer, kind, name, rank, shards)


def layer_vector(hf: Mapping[str, np.ndarray], d: GptOssDims, per_rank: dict[str, int], layer: int,
                 kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """A per-layer vector of sublayer `layer` on `rank`, `[1, n]` f32."""
    moe = {"post_norm": "post_attention_layernorm.weight", "router_bias": "mlp.router.bias"}
    if kind == MOE_KIND:
        return _w(hf, f"model.layers.{layer // 2}.{moe[name]}")[None, :]
    return _ATTENTION.layer_vector(hf, d, per_rank, layer, kind, name, rank, shards)


def expert(hf: Mapping[str, np.ndarray], d: GptOssDims, per_rank: dict[str, int], layer: int,
           local: int, rank: int, shards: ShardTable,
           formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank` (experts split evenly over every core, in id order)."""
    e = shards.part("experts", rank) * per_rank["local_experts"] + local
    return expert_arrays(hf, d, layer, e, formats)


def reference_states(state, d: GptOssDims, per_rank: dict[str, int], shards: ShardTable,
                     kind_layers: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The KV caches in the reference's layouts, keyed by model layer (sublayer // 2)."""
    return _ATTENTION.reference_states(state, d, per_rank, shards, kind_layers)


def kernel_states(ref: Mapping[str, np.ndarray], d: GptOssDims, per_rank: dict[str, int],
                  shards: ShardTable, kind_layers: dict[str, list[int]],
                  shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """The inverse of `reference_states`: the KV caches of each model layer as the kernel's."""
    return _ATTENTION.kernel_states(ref, d, per_rank, shards, kind_layers, shapes)
