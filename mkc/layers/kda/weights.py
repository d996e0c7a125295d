"""Where `KDA`'s per-rank tensors come from in an upstream checkpoint (Kimi Linear's
`self_attn.` names): the projection's columns are q_proj's, k_proj's, v_proj's and g_proj's rows
of a heads part's heads, then b_proj's (padded to a lane tile); gate_down is f_a_proj whole,
gate_up f_b_proj's rows of the part's heads, o_proj its columns; the conv taps of the part's
q, k and v channels; A_log repeated over each head's key channels (`expand_a_log`), dt_bias per
channel; the output norm's weight whole."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mkc.layers.kda import KDA
from mkc.layers.weights import tensor
from mkc.model.graph import lane_pad
from mkc.model.sharding import ShardTable, rank_parts


def tensor_names(s: KDA, d: Any) -> tuple[str, ...]:
    return ("gate_down", "gate_up", "projection", "o_proj", *(("input_norm",) if s.residual else ()),
            "conv_weight", "a_log", "dt_bias", "o_norm")


def expand_a_log(a_log: np.ndarray, head_dim: int) -> np.ndarray:
    """``A_log`` [H] -> [1, H*head_dim] f32, each head's value over its key channels."""
    return np.repeat(np.asarray(a_log, np.float32), head_dim)[None, :]


def _part_heads(d: Any, rank: int, shards: ShardTable) -> list[int]:
    n = d.kda_num_heads // shards.ways("heads")
    part = shards.part("heads", rank)
    return list(range(part * n, (part + 1) * n))


def _rows(heads: list[int], per_head: int) -> slice:
    """The rows of the consecutive heads `heads` in a tensor of `per_head` rows a head."""
    return slice(heads[0] * per_head, (heads[-1] + 1) * per_head)


def matrix(s: KDA, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    """Matrix `name` of `rank`'s heads part, [in, out] f32."""
    return matrix_of_heads(s, hf, d, prefix, name, _part_heads(d, rank, shards))


def matrix_of_heads(s: KDA, hf: Mapping, d: Any, prefix: str, name: str, heads: list[int]) -> np.ndarray:
    """Matrix `name` of the consecutive heads `heads`, [in, out] f32."""
    a, rows = prefix + s.prefix, _rows(heads, d.kda_head_dim)
    if name == "projection":
        cols = [tensor(hf, a + f"{x}_proj.weight", rows) for x in "qkvg"]
        beta = tensor(hf, a + "b_proj.weight", _rows(heads, 1))
        beta = np.pad(beta, ((0, lane_pad(len(heads)) - beta.shape[0]), (0, 0)))
        return np.concatenate(cols + [beta], axis=0).T
    if name == "gate_down":
        return tensor(hf, a + "f_a_proj.weight").T
    if name == "gate_up":
        return tensor(hf, a + "f_b_proj.weight", rows).T
    if name == "o_proj":
        return tensor(hf, a + "o_proj.weight", (slice(None), rows)).T
    raise KeyError(f"no KDA matrix {name!r}")


def vector(s: KDA, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    """A per-layer vector of `rank`'s heads part, 2-D [rows, width] f32."""
    return vector_of_heads(s, hf, d, prefix, name, _part_heads(d, rank, shards))


def vector_of_heads(s: KDA, hf: Mapping, d: Any, prefix: str, name: str, heads: list[int]) -> np.ndarray:
    """A per-layer vector of the consecutive heads `heads`, 2-D [rows, width] f32."""
    a, hd = prefix + s.prefix, d.kda_head_dim
    if name == "input_norm":
        return tensor(hf, prefix + "input_layernorm.weight")[None, :]
    if name == "conv_weight":                      # [taps, 3P]: row t multiplies tap t
        return np.concatenate([tensor(hf, a + f"{x}_conv1d.weight")[_rows(heads, hd), 0, :]
                               for x in "qkv"], axis=0).T
    if name == "a_log":
        return expand_a_log(tensor(hf, a + "A_log")[_rows(heads, 1)], hd)
    if name == "dt_bias":
        return tensor(hf, a + "dt_bias")[_rows(heads, hd)][None, :]
    if name == "o_norm":
        return tensor(hf, a + "o_norm.weight")[None, :]
    raise KeyError(f"no KDA vector {name!r}")


def reference_states(s: KDA, state: Mapping, d: Any, per_rank: dict, shards: ShardTable, kind: str,
                     layers: list[int]) -> dict[str, np.ndarray]:
    """The decode state gathered over one holder of each heads part into the reference's
    layouts: conv [B, 3 * heads * head_dim, K-1] with channels [q | k | v], recurrent
    [B, heads, D, D]."""
    if not layers:
        return {}
    width = per_rank["heads"] * d.kda_head_dim
    holders = shards.holders("heads")
    out = {}
    # only the ranks read are copied, each converted after it is sliced (`rank_parts`)
    conv = rank_parts(state[f"{kind}__conv"], holders)       # rank -> [layers, K-1, B, 3 * width]
    rec = rank_parts(state[f"{kind}__recurrent"], holders)   # rank -> [layers, B, heads, D, D]
    for i, layer in enumerate(layers):
        # [B, 3 * width, K-1] each
        pieces = [np.transpose(conv[r][i].astype(np.float32), (1, 2, 0)) for r in holders]
        parts = [np.concatenate([c[:, j * width:(j + 1) * width] for c in pieces], axis=1) for j in range(3)]
        out[f"layers.{layer}.conv_state"] = np.concatenate(parts, axis=1)
        out[f"layers.{layer}.recurrent_state"] = np.concatenate([rec[r][i] for r in holders], axis=1)
    return out


def kernel_states(s: KDA, ref: Mapping, d: Any, per_rank: dict, shards: ShardTable, kind: str,
                  layers: list[int], shapes: Mapping[str, tuple]) -> dict[str, np.ndarray]:
    """The inverse of `reference_states`: conv [S, 3 * heads * head_dim, K-1] (channels
    [q | k | v]) and recurrent [S, heads, D, D] states as the kernel's per-rank `{kind}__conv`
    [ranks, layers, K-1, S, 3 * width] and `{kind}__recurrent` [ranks, layers, S, heads, D, D],
    each rank its heads part's heads. `shapes`: the kernel's per-rank state table."""
    names = f"{kind}__conv", f"{kind}__recurrent"
    if not layers or any(n not in shapes for n in names):
        return {}
    out = {n: np.zeros((shards.ranks, *shapes[n][0]), shapes[n][1]) for n in names}
    heads = per_rank["heads"]
    width = heads * d.kda_head_dim
    for i, layer in enumerate(layers):
        conv = np.asarray(ref[f"layers.{layer}.conv_state"], np.float32)       # [S, 3 * total, K-1]
        rec = np.asarray(ref[f"layers.{layer}.recurrent_state"], np.float32)
        total = conv.shape[1] // 3
        for r in range(shards.ranks):
            part = shards.part("heads", r)
            ch = np.concatenate([j * total + part * width + np.arange(width) for j in range(3)])
            out[names[0]][r, i] = np.transpose(conv[:, ch], (2, 0, 1))
            out[names[1]][r, i] = rec[:, part * heads:(part + 1) * heads]
    return out
