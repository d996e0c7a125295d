"""Where `GQA`'s per-rank tensors come from in an upstream checkpoint: q/k/v_proj cut to a
heads part's query heads and the KV heads it holds (`kv_heads_of`), concatenated as the
projection's columns `[q | gate? | k | v]` (their biases likewise; the gate from q_proj's rows
per head, or Muse Spark's `gate_proj` cut like q_proj); o_proj's rows of those query heads;
the sinks of its query heads; the norms and o_proj's bias whole."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mkc.layers.gqa import GQA, kv_heads_of
from mkc.layers.weights import tensor
from mkc.model.sharding import ShardTable, rank_parts


def tensor_names(s: GQA, d: Any) -> tuple[str, ...]:
    return (s.projection, "o_proj", *(("input_norm",) if s.residual else ()), *s.qk_weights,
            *(("qkv_bias",) if s.bias else ()), *(("o_bias",) if s.o_bias else ()),
            *(("sinks",) if s.sinks else ()))


def _kv_rows(s: GQA, hf: Mapping, d: Any, p: str, suffix: str, part: int, heads: int) -> list[np.ndarray]:
    """k_proj's and v_proj's rows (`suffix` "weight" or "bias") of the KV heads part holds."""
    kv = kv_heads_of(d, part, heads)
    return [tensor(hf, p + f"{n}_proj.{suffix}").reshape(d.num_key_value_heads, d.head_dim, -1)[kv]
            .reshape(len(kv) * d.head_dim, -1) for n in "kv"]


def matrix(s: GQA, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    heads, part = shards.ways("heads"), shards.part("heads", rank)
    nq, hd, H = d.num_attention_heads // heads, d.head_dim, d.hidden_size
    p = prefix + s.prefix
    if name == "o_proj":
        return tensor(hf, p + "o_proj.weight", (slice(None), slice(part * nq * hd, (part + 1) * nq * hd))).T
    mine = slice(part * nq * hd, (part + 1) * nq * hd)
    if s.output_gate == "q_proj":   # q_proj rows per head: [query | gate]
        rows = tensor(hf, p + "q_proj.weight",
                      slice(part * nq * 2 * hd, (part + 1) * nq * 2 * hd)).reshape(nq, 2, hd, H)
        q = [rows[:, 0].reshape(nq * hd, H), rows[:, 1].reshape(nq * hd, H)]
    else:
        q = [tensor(hf, p + "q_proj.weight", mine)]
    if s.output_gate == "rms_gate_proj":
        q.append(tensor(hf, p + "gate_proj.weight", mine))
    return np.concatenate([w.T for w in (*q, *_kv_rows(s, hf, d, p, "weight", part, heads))], axis=1)


def vector(s: GQA, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    heads, part = shards.ways("heads"), shards.part("heads", rank)
    nq, p = d.num_attention_heads // heads, prefix + s.prefix
    if name == "qkv_bias":
        q = tensor(hf, p + "q_proj.bias", slice(part * nq * d.head_dim, (part + 1) * nq * d.head_dim))
        return np.concatenate([q[:, None], *_kv_rows(s, hf, d, p, "bias", part, heads)])[:, 0][None, :]
    if name == "sinks":
        return tensor(hf, p + "sinks", slice(part * nq, (part + 1) * nq))[None, :]
    source = {"input_norm": prefix + "input_layernorm.weight", "q_norm": p + "q_norm.weight",
              "k_norm": p + "k_norm.weight", "o_bias": p + "o_proj.bias"}
    return tensor(hf, source[name])[None, :]


def reference_states(s: GQA, state: Mapping, d: Any, per_rank: dict, shards: ShardTable, kind: str,
                     layers: list[int]) -> dict[str, np.ndarray]:
    """The KV caches [B, Hkv, T, D] of the kind's layers, each KV head from the first heads part
    holding it. A sliding kind's slots are the kernel's window's KV ring of N >= W slots (`kv
    ring N slots`: slot p % N), which the reference computes as it is; without a ring, the
    per-token cache of a context at most the window, where slot p holds position p as in a
    ring of W: padded with unwritten (zero) slots to W."""
    if not layers:
        return {}
    nkv, hd = per_rank["nkv"], d.head_dim
    holders = shards.holders("heads")
    ways = len(holders)
    first_holder = [holders[h * ways // d.num_key_value_heads] for h in range(d.num_key_value_heads)]
    split = nkv * ways == d.num_key_value_heads     # heads split: each part holds nkv
    out = {}
    for c, name in (("key", "key_cache"), ("value", "value_cache")):
        # rank -> [layers, B, T, nkv * hd]; only the ranks read are copied (`rank_parts`)
        cache = rank_parts(state[f"{kind}__{c}"], holders if split else first_holder)
        for i, layer in enumerate(layers):
            if split:
                heads = [cache[r][i, :, :, j * hd:(j + 1) * hd] for r in holders for j in range(nkv)]
            else:                                              # replicated: one head per part
                heads = [cache[r][i] for r in first_holder]
            stacked = np.stack(heads, axis=1).astype(np.float32)
            if s.sliding and stacked.shape[2] < d.sliding_window:
                stacked = np.pad(stacked, ((0, 0), (0, 0), (0, d.sliding_window - stacked.shape[2]), (0, 0)))
            out[f"layers.{layer}.{name}"] = stacked
    return out


def kernel_states(s: GQA, ref: Mapping, d: Any, per_rank: dict, shards: ShardTable, kind: str,
                  layers: list[int], shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """The inverse of `reference_states`: the reference's KV caches [S, Hkv, T, D] of the kind's
    layers as the kernel's `{kind}__key` / `__value` `[ranks, layers, S, slots, nkv * D]`, every
    rank holding its heads part's KV heads (a KV head replicated over parts written to each of
    them). A reference cache of more slots than the kernel's (a sliding window's W past a shorter
    context, where slot p holds position p) keeps the kernel's first slots. `shapes`: the
    kernel's per-rank state table."""
    if not layers:
        return {}
    ways = shards.ways("heads")
    heads = [kv_heads_of(d, shards.part("heads", r), ways) for r in range(shards.ranks)]
    out = {}
    for c, name in (("key", "key_cache"), ("value", "value_cache")):
        shape, dtype = shapes[f"{kind}__{c}"]
        cache = np.zeros((shards.ranks, *shape), dtype)
        for i, layer in enumerate(layers):
            full = np.asarray(ref[f"layers.{layer}.{name}"], np.float32)[:, :, :shape[2]]
            for r, kv in enumerate(heads):
                cache[r, i] = np.concatenate([full[:, h] for h in kv], axis=-1)
        out[f"{kind}__{c}"] = cache
    return out
