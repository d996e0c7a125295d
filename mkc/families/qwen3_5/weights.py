"""Where each per-rank weight family of qwen3_5_text comes from in the HF checkpoint.

`family_matrix` returns the [in, out] matrix one rank multiplies by (HF Linear weights are
[out, in]); `vector` returns a per-rank vector family. A rank's share is its part of each
class in the schedule's shard table, the one the graph split the shapes by. Generated `pack_weights` functions
tile and order these as their schedule says.
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from mkc.families.qwen3_5.config import AttentionDims as ModelDims
from mkc.families.qwen3_5.graph import kv_heads_of
from mkc.model.graph import lane_pad
from mkc.model.sharding import ShardTable, rank_parts


def _w(hf: Mapping[str, np.ndarray], name: str, index=None) -> np.ndarray:
    """Tensor `name` (its part `index`) as f32, indexed before it is converted: a lazily loaded
    checkpoint (`mkc.checkpoint.StoredTensor`) then reads only this rank's part."""
    return np.asarray(hf[name] if index is None else hf[name][index]).astype(np.float32)


def _pad_cols(m: np.ndarray, width: int) -> np.ndarray:
    return np.pad(m, ((0, 0), (0, width - m.shape[1])))


def family_matrix(hf: Mapping[str, np.ndarray], d: ModelDims, layer: int, family: str,
                  rank: int, shards: ShardTable) -> np.ndarray:
    """The [in, out] matrix `family` of model layer `layer` on `rank`: its part of the class
    the family splits (`shards`, the schedule's shard table, as the graph splits it)."""
    p = f"model.layers.{layer}."
    H = d.hidden_size
    if family in ("gate_up", "down"):
        n = d.intermediate_size // shards.ways("mlp")
        part = shards.part("mlp", rank)
        cols = slice(part * n, (part + 1) * n)
        if family == "gate_up":
            return np.concatenate([_w(hf, p + "mlp.gate_proj.weight", cols).T,
                                   _w(hf, p + "mlp.up_proj.weight", cols).T], axis=1)
        return _w(hf, p + "mlp.down_proj.weight", (slice(None), cols)).T
    heads, part = shards.ways("heads"), shards.part("heads", rank)
    if family in ("in_proj", "out_proj"):
        nk = d.linear_num_key_heads // heads
        nv = d.linear_num_value_heads // heads
        dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
        if family == "out_proj":
            return _w(hf, p + "linear_attn.out_proj.weight",
                      (slice(None), slice(part * nv * dv, (part + 1) * nv * dv))).T
        qkv = p + "linear_attn.in_proj_qkv.weight"
        key_dim = d.linear_num_key_heads * dk
        q = _w(hf, qkv, slice(part * nk * dk, (part + 1) * nk * dk))
        k = _w(hf, qkv, slice(key_dim + part * nk * dk, key_dim + (part + 1) * nk * dk))
        v = _w(hf, qkv, slice(2 * key_dim + part * nv * dv, 2 * key_dim + (part + 1) * nv * dv))
        z = _w(hf, p + "linear_attn.in_proj_z.weight", slice(part * nv * dv, (part + 1) * nv * dv))
        b = _w(hf, p + "linear_attn.in_proj_b.weight", slice(part * nv, (part + 1) * nv))
        a = _w(hf, p + "linear_attn.in_proj_a.weight", slice(part * nv, (part + 1) * nv))
        return np.concatenate([q.T, k.T, v.T, z.T, _pad_cols(b.T, lane_pad(nv)),
                               _pad_cols(a.T, lane_pad(nv))], axis=1)
    if family in ("qkv_gate", "o_proj"):
        nq = d.num_attention_heads // heads
        hd = d.head_dim
        if family == "o_proj":
            return _w(hf, p + "self_attn.o_proj.weight",
                      (slice(None), slice(part * nq * hd, (part + 1) * nq * hd))).T
        mine = _w(hf, p + "self_attn.q_proj.weight",               # [nq, 2, hd, H]
                  slice(part * nq * 2 * hd, (part + 1) * nq * 2 * hd)).reshape(nq, 2, hd, H)
        q = mine[:, 0].reshape(nq * hd, H)
        gate = mine[:, 1].reshape(nq * hd, H)
        kv = kv_heads_of(d, part, heads)
        kw = _w(hf, p + "self_attn.k_proj.weight").reshape(d.num_key_value_heads, hd, H)[kv]
        vw = _w(hf, p + "self_attn.v_proj.weight").reshape(d.num_key_value_heads, hd, H)[kv]
        return np.concatenate([q.T, gate.T, kw.reshape(-1, H).T, vw.reshape(-1, H).T], axis=1)
    if family == "lm_head":
        n = d.vocab_size // shards.ways("vocab")
        part = shards.part("vocab", rank)
        return _w(hf, "lm_head.weight", slice(part * n, (part + 1) * n)).T
    raise KeyError(f"no HF source for weight family {family!r}")


def vector(hf: Mapping[str, np.ndarray], d: ModelDims, layer: int, family: str,
           rank: int, shards: ShardTable) -> np.ndarray:
    """A per-layer vector family, 2-D [rows, width] f32."""
    p = f"model.layers.{layer}."
    heads, part = shards.ways("heads"), shards.part("heads", rank)
    nk = d.linear_num_key_heads // heads
    nv = d.linear_num_value_heads // heads
    dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
    simple = {
        "input_norm": p + "input_layernorm.weight",
        "post_norm": p + "post_attention_layernorm.weight",
        "q_norm": p + "self_attn.q_norm.weight",
        "k_norm": p + "self_attn.k_norm.weight",
        "norm": p + "linear_attn.norm.weight",
    }
    if family in simple:
        return _w(hf, simple[family])[None, :]
    if family in ("A_log", "dt_bias"):
        return _w(hf, p + f"linear_attn.{family}")[part * nv:(part + 1) * nv][None, :]
    if family == "conv_weight":
        w = _w(hf, p + "linear_attn.conv1d.weight")[:, 0, :]          # [C, K]
        key_dim = d.linear_num_key_heads * dk
        ch = np.concatenate([
            np.arange(part * nk * dk, (part + 1) * nk * dk),
            key_dim + np.arange(part * nk * dk, (part + 1) * nk * dk),
            2 * key_dim + np.arange(part * nv * dv, (part + 1) * nv * dv)])
        return w[ch].T                                                  # [K, C_local]
    raise KeyError(f"no HF source for vector family {family!r}")


def global_tensor(hf: Mapping[str, np.ndarray], d: ModelDims, name: str, rank: int,
                  shards: ShardTable) -> np.ndarray:
    if name == "embed":
        n = d.vocab_size // shards.ways("vocab")
        part = shards.part("vocab", rank)
        # indexed before it is an array: a lazily loaded checkpoint reads just this part
        return np.asarray(hf["model.embed_tokens.weight"][part * n:(part + 1) * n])
    if name == "final_norm":
        return _w(hf, "model.norm.weight")[None, :]
    raise KeyError(name)


def reference_states(state, d: ModelDims, per_rank: dict[str, int], shards: ShardTable,
                     kind_layers: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The decode state gathered over one holder of each heads part into the reference's
    (upstream) layouts: recurrent [B, Hv, Dk, Dv] f32, conv [B, conv_dim, K-1] with channels
    [q | k | v], and the KV caches [B, Hkv, T, D] (from the first part holding each KV head)."""
    nk, dk, nkv, hd = per_rank["nk"], per_rank["dk"], per_rank["nkv"], d.head_dim
    holders = shards.holders("heads")
    out = {}
    # only the ranks read are copied, each converted after it is sliced (`rank_parts`)
    rec = rank_parts(state["gdn__recurrent"], holders)   # rank -> [layers, B, nv, dk, dv]
    conv = rank_parts(state["gdn__conv"], holders)       # rank -> [layers, K-1, B, conv channels]
    for i, layer in enumerate(kind_layers.get("gdn", [])):
        out[f"layers.{layer}.recurrent_state"] = np.concatenate([rec[r][i] for r in holders], axis=1)
        parts = [np.transpose(conv[r][i].astype(np.float32), (1, 2, 0)) for r in holders]  # [B, C, K-1]
        q = [c[:, :nk * dk] for c in parts]
        k = [c[:, nk * dk:2 * nk * dk] for c in parts]
        v = [c[:, 2 * nk * dk:] for c in parts]
        out[f"layers.{layer}.conv_state"] = np.concatenate(q + k + v, axis=1)
    ways = len(holders)
    first_holder = [holders[h * ways // d.num_key_value_heads] for h in range(d.num_key_value_heads)]
    split = nkv * ways == d.num_key_value_heads     # heads split: each part holds nkv
    for c, name in (("key", "key_cache"), ("value", "value_cache")):
        if not kind_layers.get("gqa"):
            continue
        # rank -> [layers, B, T, nkv * hd]
        cache = rank_parts(state[f"gqa__{c}"], holders if split else first_holder)
        for i, layer in enumerate(kind_layers["gqa"]):
            if split:
                heads = [cache[r][i, :, :, j * hd:(j + 1) * hd] for r in holders for j in range(nkv)]
            else:                                              # replicated: one head per part
                heads = [cache[r][i] for r in first_holder]
            out[f"layers.{layer}.{name}"] = np.stack(heads, axis=1).astype(np.float32)
    return out


# ---- the host layout API the generic module template calls ---------------------------------
def matrix(hf: Mapping[str, np.ndarray], d: ModelDims, per_rank: dict[str, int], layer: int, kind: str,
           name: str, rank: int, shards: ShardTable) -> np.ndarray:
    """Matrix `name` of loop layer `layer` (kind `kind`; -1 and "tail" after the last layer)."""
    return family_matrix(hf, d, layer, name, rank, shards)


def layer_vector(hf: Mapping[str, np.ndarray], d: ModelDims, per_rank: dict[str, int], layer: int,
                 kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    return vector(hf, d, layer, name, rank, shards)


def head_vectors(hf: Mapping[str, np.ndarray], d: ModelDims, rank: int,
                 shards: ShardTable) -> np.ndarray:
    """The rows of the `head_norm` block the final compute body reads: the final norm."""
    return global_tensor(hf, d, "final_norm", rank, shards)


def embedding(hf: Mapping[str, np.ndarray], d: ModelDims, rank: int, shards: ShardTable) -> np.ndarray:
    return np.asarray(global_tensor(hf, d, "embed", rank, shards))
