"""Where each per-rank weight of GPT-OSS comes from in the published checkpoint
(`GptOssForCausalLM`'s names, `mkc.families.gpt_oss.reference.param_shapes`), cut as
`mkc.families.gpt_oss.graph` shapes it.

The layer loop runs two sublayers per model layer (attention, then MoE), so `layer` here is a
sublayer index; model layer = layer // 2. Matrices come back `[in, out]` f32 (Linear weights
are `[out, in]`), vectors `[1, n]` f32:

* attention (`swa` and `gqa` alike): `qkv` = this heads part's rows of `q_proj` then those of
  `k_proj` and `v_proj` for the KV heads it holds (`mkc.layers.gqa.kv_heads_of`),
  transposed; `qkv_bias` the same rows of the three biases; `sinks` this part's heads;
  `o_proj` this part's input columns; `o_bias`, the norms whole;
* MoE: `router` and `router_bias` whole (every core scores every expert);
* a routed expert (`expert`): this rank's local expert `local` is expert `rank * local_experts
  + local`. Its MXFP4 `*_blocks [out, in/32, 16]` (16 bytes a block, in order: the codes
  `[out, in/2]` of `mkc.model.mxfp4`) and `*_scales [out, in/32]` are moved, never decoded:
  gate_up's rows de-interleaved into lane-padded `[gate | up]` halves
  (`ops.deinterleave_gate_up`), down's input columns padded to the same half width with zero
  codes, then both put K-major in pack groups (`mkc.families.kimi_k3.ops.pack_mxfp4_for_kernel`,
  `graph.pack_groups`), or turned into FP8 codes when the spec's format says so; the biases
  de-interleaved the same way, as bf16 rows. With a lazily loaded checkpoint `hf[name][e]`
  reads one expert.
"""
from __future__ import annotations

from collections.abc import Mapping

import ml_dtypes
import numpy as np

from mkc.families.gpt_oss.config import GptOssDims
from mkc.families.gpt_oss.graph import ATTENTION_KINDS, expert_formats, pack_groups
from mkc.families.gpt_oss.ops import deinterleave_gate_up
from mkc.families.kimi_k3.ops import fp8_codes_from_kernel_mxfp4, pack_mxfp4_for_kernel
from mkc.layers.gqa import kv_heads_of
from mkc.ir import WeightFormat
from mkc.model.graph import lane_pad
from mkc.model.sharding import ShardTable, rank_parts


def _w(hf: Mapping[str, np.ndarray], name: str, index=None) -> np.ndarray:
    """Tensor `name` (its part `index`) as f32, indexed before it is converted: a lazily loaded
    checkpoint then reads only this rank's part."""
    return np.asarray(hf[name] if index is None else hf[name][index]).astype(np.float32)


def _heads(d: GptOssDims, rank: int, shards: ShardTable) -> tuple[slice, list[int]]:
    """(this rank's query heads, the KV heads it holds)."""
    ways, part = shards.ways("heads"), shards.part("heads", rank)
    nq = d.num_attention_heads // ways
    return slice(part * nq, (part + 1) * nq), kv_heads_of(d, part, ways)


def _attention_rows(hf: Mapping[str, np.ndarray], d: GptOssDims, p: str, suffix: str,
                    rank: int, shards: ShardTable) -> np.ndarray:
    """This rank's rows of q_proj, then k_proj and v_proj for its KV heads (`suffix` "weight"
    or "bias"), by head: `[(nq + 2 nkv) * D, ...]`."""
    q, kv = _heads(d, rank, shards)
    hd = d.head_dim
    rows = [_w(hf, f"{p}self_attn.q_proj.{suffix}", slice(q.start * hd, q.stop * hd))]
    for proj in ("k_proj", "v_proj"):
        full = _w(hf, f"{p}self_attn.{proj}.{suffix}")
        rows += [full[h * hd:(h + 1) * hd] for h in kv]
    return np.concatenate(rows, axis=0)


def family_matrix(hf: Mapping[str, np.ndarray], d: GptOssDims, layer: int, kind: str, family: str,
                  rank: int, shards: ShardTable) -> np.ndarray:
    """The `[in, out]` matrix `family` of sublayer `layer` (kind `kind`; -1 and "tail": the
    lm_head) on `rank`."""
    if kind == "tail" and family == "lm_head":
        n = d.vocab_size // shards.ways("vocab")
        part = shards.part("vocab", rank)
        return _w(hf, "lm_head.weight", slice(part * n, (part + 1) * n)).T
    p = f"model.layers.{layer // 2}."
    if kind in ATTENTION_KINDS and family == "qkv":
        return _attention_rows(hf, d, p, "weight", rank, shards).T
    if kind in ATTENTION_KINDS and family == "o_proj":
        q, _ = _heads(d, rank, shards)
        cols = slice(q.start * d.head_dim, q.stop * d.head_dim)
        return _w(hf, p + "self_attn.o_proj.weight", (slice(None), cols)).T
    if kind == "moe" and family == "router":
        return _w(hf, p + "mlp.router.weight").T                                # [H, E]
    raise KeyError(f"no checkpoint source for {kind} matrix {family!r}")


def vector(hf: Mapping[str, np.ndarray], d: GptOssDims, layer: int, kind: str, name: str,
           rank: int, shards: ShardTable) -> np.ndarray:
    """A per-layer vector of sublayer `layer` on `rank`, `[1, n]` f32."""
    p = f"model.layers.{layer // 2}."
    whole = {("moe", "post_norm"): "post_attention_layernorm.weight",
             ("moe", "router_bias"): "mlp.router.bias"}
    whole |= {(k, n): src for k in ATTENTION_KINDS for n, src in (
        ("input_norm", "input_layernorm.weight"), ("o_bias", "self_attn.o_proj.bias"))}
    if (kind, name) in whole:
        return _w(hf, p + whole[kind, name])[None, :]
    if kind in ATTENTION_KINDS and name == "qkv_bias":
        return _attention_rows(hf, d, p, "bias", rank, shards)[None, :]
    if kind in ATTENTION_KINDS and name == "sinks":
        return _w(hf, p + "self_attn.sinks", _heads(d, rank, shards)[0])[None, :]
    raise KeyError(f"no checkpoint source for {kind} vector {name!r}")


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
    return family_matrix(hf, d, layer, kind, name, rank, shards)


def layer_vector(hf: Mapping[str, np.ndarray], d: GptOssDims, per_rank: dict[str, int], layer: int,
                 kind: str, name: str, rank: int, shards: ShardTable) -> np.ndarray:
    return vector(hf, d, layer, kind, name, rank, shards)


def expert(hf: Mapping[str, np.ndarray], d: GptOssDims, per_rank: dict[str, int], layer: int,
           local: int, rank: int, shards: ShardTable,
           formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank` (experts split evenly over every core, in id order)."""
    e = shards.part("experts", rank) * per_rank["local_experts"] + local
    return expert_arrays(hf, d, layer, e, formats)


def head_vectors(hf: Mapping[str, np.ndarray], d: GptOssDims, rank: int,
                 shards: ShardTable) -> np.ndarray:
    """The rows of the `head_norm` block the final compute body reads: the final norm."""
    return _w(hf, "model.norm.weight")[None, :]


def embedding(hf: Mapping[str, np.ndarray], d: GptOssDims, rank: int, shards: ShardTable) -> np.ndarray:
    n = d.vocab_size // shards.ways("vocab")
    part = shards.part("vocab", rank)
    # indexed before it is an array: a lazily loaded checkpoint reads just this part
    return np.asarray(hf["model.embed_tokens.weight"][part * n:(part + 1) * n])


def reference_states(state, d: GptOssDims, per_rank: dict[str, int], shards: ShardTable,
                     kind_layers: dict[str, list[int]]) -> dict[str, np.ndarray]:
    """The KV caches gathered over one holder of each heads part into the reference's
    layouts, `layers.{i}.key_cache` / `value_cache` `[B, Hkv, T, D]` (model layer i): a
    kind's state `{kind}__key` is `[layers of the kind, B, slots, nkv * D]` per rank. A full
    layer's slots are its context. A sliding layer's are the kernel's window's KV ring of N >= W
    slots (`kv ring N slots`: slot p % N), which the reference computes as it is; without a
    ring, the per-token cache of a context at most the window (`graph.window_limit`), where
    slot p holds position p as in a ring of W: padded with unwritten (zero) slots to W."""
    hd, nkv = d.head_dim, per_rank["nkv"]
    holders = shards.holders("heads")
    ways = len(holders)
    split = nkv * ways == d.num_key_value_heads          # KV heads split: each part holds nkv
    # else each holds one replica: take the first part holding each KV head
    ranks = holders if split else [holders[h * ways // d.num_key_value_heads]
                                   for h in range(d.num_key_value_heads)]
    out = {}
    for kind in ATTENTION_KINDS:
        for c, name in (("key", "key_cache"), ("value", "value_cache")):
            if not kind_layers.get(kind):
                continue
            cache = rank_parts(state[f"{kind}__{c}"], ranks)    # rank -> [layers, B, T, nkv * D]
            slots = cache[ranks[0]].shape[2]
            for i, layer in enumerate(kind_layers[kind]):
                heads = ([cache[r][i, :, :, j * hd:(j + 1) * hd] for r in ranks for j in range(nkv)]
                         if split else [cache[r][i] for r in ranks])
                stacked = np.stack(heads, axis=1).astype(np.float32)
                if kind == "swa" and slots < d.sliding_window:   # a context within the window:
                    pad = d.sliding_window - slots   # slot t holds position t as in a ring of W
                    stacked = np.pad(stacked, ((0, 0), (0, 0), (0, pad), (0, 0)))
                out[f"layers.{layer // 2}.{name}"] = stacked
    return out
