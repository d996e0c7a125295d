"""Where `GatedDeltaNet`'s per-rank tensors come from in an upstream checkpoint (Qwen3.5's
`linear_attn.` names): in_proj_qkv's q, k and v rows of a heads part's key and value heads,
then in_proj_z, in_proj_b and in_proj_a (b and a each padded to a lane tile), as in_proj's
columns; out_proj's rows of its value heads; the conv taps of its channels; per-head A_log and
dt_bias; the gated norm's weight."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mkc.layers.gated_delta_net import GatedDeltaNet
from mkc.layers.weights import tensor
from mkc.model.graph import lane_pad
from mkc.model.sharding import ShardTable, rank_parts


def tensor_names(s: GatedDeltaNet, d: Any) -> tuple[str, ...]:
    return ("in_proj", "out_proj", "conv_weight", "A_log", "dt_bias", "norm", "input_norm")


def _pad_cols(m: np.ndarray, width: int) -> np.ndarray:
    return np.pad(m, ((0, 0), (0, width - m.shape[1])))


def _heads(d: Any, rank: int, shards: ShardTable) -> tuple[int, int, int, int, int]:
    """(the heads part `rank` holds, its key heads, value heads, key and value head dims)."""
    heads = shards.ways("heads")
    return (shards.part("heads", rank), d.linear_num_key_heads // heads, d.linear_num_value_heads // heads,
            d.linear_key_head_dim, d.linear_value_head_dim)


def matrix(s: GatedDeltaNet, hf: Mapping, d: Any, prefix: str, name: str, rank: int,
           shards: ShardTable) -> np.ndarray:
    part, nk, nv, dk, dv = _heads(d, rank, shards)
    p = prefix + s.prefix
    if name == "out_proj":
        return tensor(hf, p + "out_proj.weight", (slice(None), slice(part * nv * dv, (part + 1) * nv * dv))).T
    qkv = p + "in_proj_qkv.weight"
    key_dim = d.linear_num_key_heads * dk
    q = tensor(hf, qkv, slice(part * nk * dk, (part + 1) * nk * dk))
    k = tensor(hf, qkv, slice(key_dim + part * nk * dk, key_dim + (part + 1) * nk * dk))
    v = tensor(hf, qkv, slice(2 * key_dim + part * nv * dv, 2 * key_dim + (part + 1) * nv * dv))
    z = tensor(hf, p + "in_proj_z.weight", slice(part * nv * dv, (part + 1) * nv * dv))
    b = tensor(hf, p + "in_proj_b.weight", slice(part * nv, (part + 1) * nv))
    a = tensor(hf, p + "in_proj_a.weight", slice(part * nv, (part + 1) * nv))
    return np.concatenate([q.T, k.T, v.T, z.T, _pad_cols(b.T, lane_pad(nv)), _pad_cols(a.T, lane_pad(nv))],
                          axis=1)


def vector(s: GatedDeltaNet, hf: Mapping, d: Any, prefix: str, name: str, rank: int,
           shards: ShardTable) -> np.ndarray:
    """A per-layer vector, 2-D [rows, width] f32."""
    part, nk, nv, dk, dv = _heads(d, rank, shards)
    p = prefix + s.prefix
    if name == "input_norm":
        return tensor(hf, prefix + "input_layernorm.weight")[None, :]
    if name == "norm":
        return tensor(hf, p + "norm.weight")[None, :]
    if name in ("A_log", "dt_bias"):
        return tensor(hf, p + name)[part * nv:(part + 1) * nv][None, :]
    w = tensor(hf, p + "conv1d.weight")[:, 0, :]          # conv_weight: [C, K]
    key_dim = d.linear_num_key_heads * dk
    ch = np.concatenate([np.arange(part * nk * dk, (part + 1) * nk * dk),
                         key_dim + np.arange(part * nk * dk, (part + 1) * nk * dk),
                         2 * key_dim + np.arange(part * nv * dv, (part + 1) * nv * dv)])
    return w[ch].T                                          # [K, C_local]


def reference_states(s: GatedDeltaNet, state: Mapping, d: Any, per_rank: dict, shards: ShardTable,
                     kind: str, layers: list[int]) -> dict[str, np.ndarray]:
    """The decode state gathered over one holder of each heads part into the reference's
    (upstream) layouts: recurrent [B, Hv, Dk, Dv] f32, conv [B, conv_dim, K-1] with channels
    [q | k | v]."""
    if not layers:
        return {}
    nk, dk = per_rank["nk"], per_rank["dk"]
    holders = shards.holders("heads")
    out = {}
    # only the ranks read are copied, each converted after it is sliced (`rank_parts`)
    rec = rank_parts(state[f"{kind}__recurrent"], holders)   # rank -> [layers, B, nv, dk, dv]
    conv = rank_parts(state[f"{kind}__conv"], holders)       # rank -> [layers, K-1, B, conv channels]
    for i, layer in enumerate(layers):
        out[f"layers.{layer}.recurrent_state"] = np.concatenate([rec[r][i] for r in holders], axis=1)
        parts = [np.transpose(conv[r][i].astype(np.float32), (1, 2, 0)) for r in holders]  # [B, C, K-1]
        q = [c[:, :nk * dk] for c in parts]
        k = [c[:, nk * dk:2 * nk * dk] for c in parts]
        v = [c[:, 2 * nk * dk:] for c in parts]
        out[f"layers.{layer}.conv_state"] = np.concatenate(q + k + v, axis=1)
    return out


def kernel_states(s: GatedDeltaNet, ref: Mapping, d: Any, per_rank: dict, shards: ShardTable,
                  kind: str, layers: list[int], shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """The inverse of `reference_states`: the reference's recurrent [S, Hv, Dk, Dv] and conv
    [S, conv_dim, K-1] states (channels [q | k | v]) as the kernel's `{kind}__recurrent`
    `[ranks, layers, S, nv, dk, dv]` and `{kind}__conv` `[ranks, layers, K-1, S, channels]`, every
    rank holding its heads part's key and value heads. `shapes`: the kernel's per-rank state
    table."""
    if not layers:
        return {}
    key_dim = d.linear_num_key_heads * d.linear_key_head_dim
    (rec_shape, rec_dtype), (conv_shape, conv_dtype) = shapes[f"{kind}__recurrent"], shapes[f"{kind}__conv"]
    rec = np.zeros((shards.ranks, *rec_shape), rec_dtype)
    conv = np.zeros((shards.ranks, *conv_shape), conv_dtype)
    for r in range(shards.ranks):
        part, nk, nv, dk, dv = _heads(d, r, shards)
        ch = np.concatenate([np.arange(part * nk * dk, (part + 1) * nk * dk),
                             key_dim + np.arange(part * nk * dk, (part + 1) * nk * dk),
                             2 * key_dim + np.arange(part * nv * dv, (part + 1) * nv * dv)])
        for i, layer in enumerate(layers):
            recurrent = np.asarray(ref[f"layers.{layer}.recurrent_state"], np.float32)
            rec[r, i] = recurrent[:, part * nv:(part + 1) * nv]
            taps = np.asarray(ref[f"layers.{layer}.conv_state"], np.float32)[:, ch]      # [S, C, K-1]
            conv[r, i, :, :, :len(ch)] = np.transpose(taps, (2, 0, 1))
    return {f"{kind}__recurrent": rec, f"{kind}__conv": conv}
