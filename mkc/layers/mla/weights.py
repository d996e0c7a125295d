"""Where `MLA`'s per-rank tensors come from in an upstream checkpoint (`self_attn.q_a_proj`,
`q_a_layernorm`, `q_b_proj`, `kv_a_proj_with_mqa`, `kv_a_layernorm`, `kv_b_proj`, `g_proj`,
`o_proj`): q_down and kv_down whole (kv_down's columns zero padded to the cache row), q_b_proj
split per head into its nope and rope rows (`split_q_b_proj`), kv_b_proj into the key and value
up-projections (`split_kv_b_proj`), g_proj's and o_proj's rows of a heads part's heads. With
`rope_interleave` the rope rows of q_b_proj (per head) and kv_a_proj_with_mqa are permuted
evens first, then odds (`rope_permutation`): the kernel's rotate-half rotation of the permuted
values is upstream's interleaved rotation, its output in upstream's (de-interleaved) layout."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from mkc.layers.mla import MLA, cache_width, interleaved
from mkc.layers.weights import tensor
from mkc.model.sharding import ShardTable, rank_parts


def tensor_names(s: MLA, d: Any) -> tuple[str, ...]:
    return ("q_down", "kv_down", "q_up", "key_up", "value_up", *(("gate",) if s.output_gate else ()),
            "o_proj", *(("input_norm",) if s.residual else ()), "q_norm", "kv_norm")


def rope_permutation(rope: int) -> np.ndarray:
    """Rope dims `(2i, 2i + 1)` pairs -> rotate-half pairs `(i, i + rope / 2)`: evens, odds."""
    return np.concatenate([np.arange(0, rope, 2), np.arange(1, rope, 2)])


def _heads(w: np.ndarray, num_heads: int, heads: Sequence[int] | None) -> np.ndarray:
    """PyTorch [num_heads * per_head, in] -> [len(heads), per_head, in]."""
    w = np.asarray(w).reshape(num_heads, -1, np.asarray(w).shape[-1])
    return w if heads is None else w[list(heads)]


def split_q_b_proj(w: np.ndarray, num_heads: int, nope_dim: int,
                   heads: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``q_b_proj.weight`` [num_heads*(nope+extra), q_lora] -> K-major (w_q_nope
    [q_lora, nh*nope], w_q_extra [q_lora, nh*extra]) for the selected heads (a rank's share)."""
    w = _heads(w, num_heads, heads)
    nh = w.shape[0]
    return (w[:, :nope_dim].reshape(nh * nope_dim, -1).T.copy(),
            w[:, nope_dim:].reshape(nh * (w.shape[1] - nope_dim), -1).T.copy())


def split_kv_b_proj(w: np.ndarray, num_heads: int, nope_dim: int,
                    heads: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``kv_b_proj.weight`` [num_heads*(nope+v), R] -> (w_uk [nh*nope, R], w_uv [R, nh*v]):
    the layouts ``mla_absorb_query`` and ``mla_value_up`` multiply by, for the selected heads."""
    w = _heads(w, num_heads, heads)
    nh, v_dim = w.shape[0], w.shape[1] - nope_dim
    return (w[:, :nope_dim].reshape(nh * nope_dim, -1).copy(),
            w[:, nope_dim:].reshape(nh * v_dim, -1).T.copy())


def _part_heads(d: Any, rank: int, shards: ShardTable) -> list[int]:
    n = d.num_attention_heads // shards.ways("heads")
    part = shards.part("heads", rank)
    return list(range(part * n, (part + 1) * n))


def matrix(s: MLA, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    """Matrix `name` of `rank`'s heads part, [in, out] f32."""
    return matrix_of_heads(s, hf, d, prefix, name, _part_heads(d, rank, shards))


def matrix_of_heads(s: MLA, hf: Mapping, d: Any, prefix: str, name: str, heads: list[int]) -> np.ndarray:
    """Matrix `name` of the consecutive attention heads `heads`, [in, out] f32."""
    a, nope, rope, v = prefix + s.prefix, d.qk_nope_head_dim, d.qk_rope_head_dim, d.v_head_dim
    perm = rope_permutation(rope) if s.rope and interleaved(d) else np.arange(rope)
    if name == "q_down":
        return tensor(hf, a + "q_a_proj.weight").T
    if name == "kv_down":
        m = tensor(hf, a + "kv_a_proj_with_mqa.weight").T                     # [H, lora + rope]
        m = np.concatenate([m[:, :d.kv_lora_rank], m[:, d.kv_lora_rank:][:, perm]], axis=1)
        return np.pad(m, ((0, 0), (0, cache_width(d) - m.shape[1])))
    if name == "q_up":
        w_nope, w_rope = split_q_b_proj(tensor(hf, a + "q_b_proj.weight"), d.num_attention_heads, nope, heads)
        w_rope = w_rope.reshape(w_rope.shape[0], len(heads), rope)[:, :, perm].reshape(w_rope.shape[0], -1)
        return np.concatenate([w_nope, w_rope], axis=1)
    if name in ("key_up", "value_up"):
        uk, uv = split_kv_b_proj(tensor(hf, a + "kv_b_proj.weight"), d.num_attention_heads, nope, heads)
        return uk if name == "key_up" else uv
    rows = slice(heads[0] * v, (heads[-1] + 1) * v)
    if name == "gate":
        return tensor(hf, a + "g_proj.weight", rows).T
    if name == "o_proj":
        return tensor(hf, a + "o_proj.weight", (slice(None), rows)).T
    raise KeyError(f"no MLA matrix {name!r}")


def vector(s: MLA, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable | None
           ) -> np.ndarray:
    a = prefix + s.prefix
    source = {"input_norm": prefix + "input_layernorm.weight", "q_norm": a + "q_a_layernorm.weight",
              "kv_norm": a + "kv_a_layernorm.weight"}
    return tensor(hf, source[name])[None, :]


def reference_states(s: MLA, state: Mapping, d: Any, per_rank: dict, shards: ShardTable, kind: str,
                     layers: list[int]) -> dict[str, np.ndarray]:
    """The latent caches [B, T, kv_lora_rank + qk_rope_head_dim] of the kind's (model) layers:
    every rank holds the whole cache; rank 0's, its row's padding dropped."""
    if not layers:
        return {}
    cache = rank_parts(state[f"{kind}__latent"], [0])[0]     # [layers, B, T, latent row]
    row = d.kv_lora_rank + d.qk_rope_head_dim
    return {f"layers.{layer}.latent_cache": cache[i, :, :, :row].astype(np.float32)
            for i, layer in enumerate(layers)}


def kernel_states(s: MLA, ref: Mapping, d: Any, per_rank: dict, shards: ShardTable, kind: str,
                  layers: list[int], shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """The inverse of `reference_states`: the reference's latent caches [S, T, row] as the
    kernel's `{kind}__latent` [ranks, layers, S, T, latent row] (every rank a copy, the row's
    padding zero). `shapes`: the kernel's per-rank state table."""
    name = f"{kind}__latent"
    if not layers or name not in shapes:
        return {}
    shape, dtype = shapes[name]
    latent = np.zeros((shards.ranks, *shape), dtype)
    row = d.kv_lora_rank + d.qk_rope_head_dim
    for i, layer in enumerate(layers):
        latent[:, i, :, :, :row] = np.asarray(ref[f"layers.{layer}.latent_cache"],
                                               np.float32)[None, :, :latent.shape[3]]
    return {name: latent}
