"""Where `MoE`'s per-rank tensors come from in an upstream checkpoint: the router `mlp.gate`
and its correction bias (replicated), the shared expert's gate and up rows of an `mlp` part
side by side and its down_proj's columns of it, its gate vector, the post-attention norm; and
each routed expert whole on the rank that holds it (`expert`), from the fused
`mlp.experts.gate_up_proj [E, 2I, H]` (gate rows first) and `mlp.experts.down_proj [E, H, I]`
(`mkc.checkpoint` fuses a per-expert checkpoint's into these; with a lazy load each
`hf[name][e]` reads one expert). A class the spec stores as FP8 (`format expert.gate_up fp8
block N rounded`) is requantized, block by block of input rows
(`mkc.model.mxfp4.requantize_fp8_blocks`), into codes and E8M0 scales (`requantization` reports
the error); from an FP8 checkpoint (`fp8 block R x C`) its codes and f32 block scales are
copied as they are (`fp8_expert_matrix`). An MXFP4 checkpoint's experts (GPT-OSS's `*_blocks`
`[E, out, in/32, 16]` and `*_scales` `[E, out, in/32]`) are moved, never decoded
(`mxfp4_expert`): gate_up's rows into `[gate | up]` halves padded to the slot's `expert_half`
(`gate_up_halves`: de-interleaved where the checkpoint alternates them), down's input columns
padded to the same width with zero codes, both put K-major in pack groups, or turned into FP8
codes where the spec's format says so; with `expert_bias` each matrix's bias row (bf16, the
checkpoint's dtype) after it, cut the same way. `int4 block N rounded` requantizes a rank's
slice of a bf16 checkpoint (`int4_slot`), `nvfp4` cuts an NVFP4 checkpoint's byte for byte
(`nvfp4_slot`)."""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import ml_dtypes
import numpy as np

from mkc.ir import WeightFormat
from mkc.layers.expert_formats import FOUR_BIT, MX_BLOCK
from mkc.layers.expert_formats.weights import (fp4_checkpoint_tensors, fp4_from_mxfp4, fp8_checkpoint_blocks,
                                               fp8_codes_from_kernel_mxfp4, held_fp4, int4_expert_slice,
                                               int4_from_bf16, nvfp4_expert_slice, nvfp4_from_bf16,
                                               nvfp4_global_scale, pack_bf16_scales, pack_mxfp4_for_kernel,
                                               pack_nvfp4_for_kernel)
from mkc.layers.moe import BLOCK_SCALE, MoE
from mkc.layers.moe.options import Checkpoint
from mkc.layers.swiglu.weights import mlp_matrix
from mkc.layers.weights import padded_block, tensor
from mkc.layers.weights import no_kernel_states as kernel_states  # noqa: F401  (no state)
from mkc.layers.weights import no_reference_states as reference_states  # noqa: F401
from mkc.model.family import FormatError
from mkc.model.fp8_blocks import scale_name
from mkc.model.mxfp4 import RequantizationError, Requantized, fp8_block_values, requantize_fp8_blocks
from mkc.model.sharding import ShardTable

# Checkpoint tensors of each routed-expert class ([E, out, in], fused), under `experts.`.
_EXPERT_TENSORS = {"expert.gate_up": "gate_up_proj", "expert.down": "down_proj"}
# An NVFP4 checkpoint's tensors beside each fused matrix's codes (`Checkpoint.NVFP4`)
NVFP4_SCALE, NVFP4_GLOBAL = "_weight_scale", "_weight_scale_2"


def tensor_names(s: MoE, d: Any) -> tuple[str, ...]:
    shared = (*(("shared_gate",) if s.shared_gate else ()), "shared_gate_up", "shared_down") \
        if s.shared_expert else ()
    return (*(("post_norm",) if s.residual else ()), "router", *(("router_bias",) if s.router_bias else ()),
            *shared, *s.routing.reads, *(s.latent.tensors() if s.latent else ()))


def _ways(shards: ShardTable) -> dict[str, int]:
    return {cls: ways for cls, ways, _ in shards.rules}


def matrix(s: MoE, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    """A rank's [in, out] matrix: the router (its share of the experts' columns when split),
    a latent projection's share of its columns (zero padded), or the shared expert's part."""
    p = prefix + s.prefix
    if name == "router":
        if s.routing.weight_pair:
            return router_pair(tensor(hf, p + s.router_prefix + "weight")).T     # [H, 2E]
        router = tensor(hf, p + s.router_prefix + "weight").T                   # [H, E]
        if not s.router_split:
            return router
        return padded_block(router, 1, shards.part("router", rank), s.router_cols(d, _ways(shards)))
    if name in ("latent_down", "latent_up"):
        cols = dict(zip(("latent_down", "latent_up"), s.latent_cols(d, _ways(shards))))[name]
        return padded_block(tensor(hf, p + s.latent.tensors()[name]).T, 1, shards.part(name, rank), cols)
    return mlp_matrix(hf, p + s.shared_prefix, d.shared_expert_intermediate_size,
                      name.removeprefix("shared_"), rank, shards)


def router_pair(w: np.ndarray) -> np.ndarray:
    """An f32 router weight ``[E, H]`` as a bf16 pair's values stacked on the output axis,
    ``[hi; lo]`` (``[2E, H]``): hi the weight rounded to bf16, lo the remainder rounded; the
    kernel sums the pair's products (`Router.weight_pair`)."""
    w = np.asarray(w, np.float32)
    hi = w.astype(ml_dtypes.bfloat16).astype(np.float32)
    return np.concatenate([hi, (w - hi).astype(ml_dtypes.bfloat16).astype(np.float32)], axis=0)


def vector(s: MoE, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    if name == "shared_gate":
        return tensor(hf, prefix + s.prefix + "shared_expert_gate.weight")     # [1, H]
    if name in s.routing.reads:       # [1, E], zero padded to a split router's columns
        bias = tensor(hf, prefix + s.prefix + s.routing.vector_tensor(name))
        columns = s.router_cols(d, _ways(shards)) * shards.ways("router") if s.router_split else d.experts
        return np.pad(bias, (0, columns - bias.shape[0]))[None, :]
    if name in ("latent_norm", "expert_norm"):
        return tensor(hf, prefix + s.prefix + s.latent.tensors()[name])[None, :]
    if name == "router_bias":
        return tensor(hf, prefix + s.prefix + s.router_prefix + "bias")[None, :]         # [1, E]
    return tensor(hf, prefix + "post_attention_layernorm.weight")[None, :]


def global_expert(d: Any, shards: ShardTable, rank: int, local: int) -> int:
    """The model-wide id of local expert `local` of `rank`'s expert group (experts split evenly
    over the groups)."""
    return shards.part("experts", rank) * (d.experts // shards.ways("experts")) + local


def fused_tensor(s: MoE, prefix: str, cls: str) -> str:
    """The checkpoint's fused tensor (`[E, out, in]`) of routed-expert class `cls` in the layer
    under `prefix`."""
    return f"{prefix}{s.prefix}experts.{_EXPERT_TENSORS[cls]}"


def expert_tp(shards: ShardTable) -> int:
    """The ranks sharing each routed expert's width (`shard expert_mlp over N`; 1 without)."""
    return shards.ways("expert_mlp") if any(c == "expert_mlp" for c, _, _ in shards.rules) else 1


def expert_matrix(s: MoE, hf: Mapping, d: Any, prefix: str, local: int, name: str, rank: int,
                  shards: ShardTable) -> np.ndarray:
    """Local expert `local` of `rank`'s expert group ([in, out]): experts split evenly over the
    groups, the rank's width slice of it (its gate and up columns, down's rows)."""
    e = global_expert(d, shards, rank, local)
    m = np.asarray(hf[fused_tensor(s, prefix, "expert." + name)][e]).astype(np.float32)
    tp = expert_tp(shards)
    if tp > 1:
        width = d.moe_intermediate_size // tp
        cols = slice(shards.part("expert_mlp", rank) * width, (shards.part("expert_mlp", rank) + 1) * width)
        m = m.reshape(2, -1, m.shape[-1])[:, cols].reshape(2 * width, -1) if name == "gate_up" else m[:, cols]
    return m.T                                        # gate_up [H, 2I]: gate | up; down [I, H]


def expert_slice(d: Any, name: str, part: int, tp: int, io: int | None = None
                 ) -> tuple[list[int], list[int], int]:
    """The checkpoint rows and columns (`[out, in]`, fused) of width part `part` of `tp` of an
    expert matrix, in the order its slot holds them ([in, out]: gate's columns, then up's),
    and the width of its runs of output columns (`io`: the experts' input and output width,
    `MoE.expert_io`; the hidden size if None)."""
    width, io = d.moe_intermediate_size // tp, d.hidden_size if io is None else io
    mine = list(range(part * width, (part + 1) * width))
    if name == "gate_up":
        return mine + [d.moe_intermediate_size + i for i in mine], list(range(io)), width
    return list(range(io)), mine, io


def _rank_slice(s: MoE, d: Any, name: str, rank: int, shards: ShardTable) -> tuple[list[int], list[int], int]:
    """`expert_slice` of `rank`'s width part."""
    tp = expert_tp(shards)
    return expert_slice(d, name, shards.part("expert_mlp", rank) if tp > 1 else 0, tp, s.expert_io(d))


def four_bit_expert_matrix(s: MoE, hf: Mapping, d: Any, prefix: str, local: int, name: str, rank: int,
                           shards: ShardTable, fmt: WeightFormat) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank`, `fmt` its `int4 block N` or `nvfp4`: the rank's slice
    as its slot holds it (`int4_slot`, `nvfp4_slot`)."""
    e = global_expert(d, shards, rank, local)
    stored = fused_tensor(s, prefix, "expert." + name)
    out_index, in_index, _ = _rank_slice(s, d, name, rank, shards)
    what = f"layer {_layer_of(prefix)} expert {e}'s {name}"
    slot = int4_slot if fmt.name == "int4" else nvfp4_slot
    codes, scales = slot(hf, stored, e, out_index, in_index, fmt, what)
    return {f"{name}_codes": codes, f"{name}_scales": scales}


def _class_of(stored: str) -> str:
    """The expert class of a fused checkpoint tensor (`..experts.gate_up_proj`)."""
    return next(cls for cls, name in _EXPERT_TENSORS.items() if stored.endswith("experts." + name))


def int4_slot(hf: Mapping, stored: str, e: int, out_index: list[int], in_index: list[int],
              fmt: WeightFormat, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Expert `e` of the bf16 checkpoint's fused `stored`, its output rows `out_index` and input
    columns `in_index` (`expert_slice`), requantized to `fmt`'s int4 blocks and packed
    (`int4_expert_slice`: FormatError where values move and `fmt` does not say `rounded`)."""
    if stored + BLOCK_SCALE in hf:
        raise ValueError(f"{stored} holds codes under bf16 block scales (a requantized checkpoint), "
                         f"which `{fmt.spelled}` does not take as they are: pack the checkpoint itself")
    codes, scales, _ = int4_expert_slice(hf[stored][e], out_index, in_index, fmt, _class_of(stored), what)
    return codes, scales


def nvfp4_slot(hf: Mapping, stored: str, e: int, out_index: list[int], in_index: list[int],
               fmt: WeightFormat, what: str) -> tuple[np.ndarray, np.ndarray]:
    """Expert `e` of the NVFP4 checkpoint's fused `stored` (its codes, `_weight_scale` and
    `_weight_scale_2`; any dtype holding their values), its output rows `out_index` and input
    columns `in_index`, as its slot holds them (`nvfp4_expert_slice`, byte for byte); a layer
    the checkpoint keeps bf16 requantized to NVFP4 (`nvfp4_from_bf16`, the whole matrix's global
    scale: as `requantization` gives it the reference), where `fmt` says `rounded`."""
    if stored + NVFP4_SCALE in hf:
        return nvfp4_expert_slice(np.asarray(hf[stored][e]).astype(np.uint8),
                                  np.asarray(hf[stored + NVFP4_SCALE][e]).astype(ml_dtypes.float8_e4m3fn),
                                  np.asarray(hf[stored + NVFP4_GLOBAL][e], np.float32), out_index, in_index)
    if not fmt.rounded:
        cls = _class_of(stored)
        raise FormatError(cls, f"{what} is bf16 in the NVFP4 checkpoint, which `{fmt.spelled}` would "
                          "requantize", f"write `format {cls} nvfp4 rounded`")
    values = np.asarray(hf[stored][e], np.float32)
    r = nvfp4_from_bf16(values[np.ix_(out_index, in_index)], nvfp4_global_scale(values))
    return pack_nvfp4_for_kernel(r.codes, r.block_scales, r.global_scale)


def fp8_expert_matrix(s: MoE, hf: Mapping, d: Any, prefix: str, local: int, name: str, rank: int,
                      shards: ShardTable, fmt: WeightFormat) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank` from an FP8 checkpoint, `fmt` its `fp8 block R x C`: the
    rank's slice of its codes and the block scales over it, byte for byte the checkpoint's
    (`mkc.layers.expert_formats.weights.fp8_checkpoint_blocks`)."""
    e = global_expert(d, shards, rank, local)
    stored = fused_tensor(s, prefix, "expert." + name)
    out_index, in_index, width = _rank_slice(s, d, name, rank, shards)
    codes, scales = fp8_checkpoint_blocks(hf[stored][e], hf[scale_name(stored)][e], out_index, in_index,
                                          fmt, width)
    return {f"{name}_codes": codes, f"{name}_scales": scales}


def expert(s: MoE, hf: Mapping, d: Any, prefix: str, local: int, rank: int, shards: ShardTable,
           formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Local expert `local` of `rank` as the pool holds it (its width slice), [in, out] by
    matrix: bf16 by its name, or FP8 codes and E8M0 scales per block of input rows
    (`{name}_codes`, `{name}_scales`); an MXFP4 checkpoint's as `mxfp4_expert` moves it."""
    if s.checkpoint is Checkpoint.MXFP4_PACKED:
        e = global_expert(d, shards, rank, local)
        tp = expert_tp(shards)
        part = shards.part("expert_mlp", rank) if tp > 1 else 0
        return packed_mxfp4_expert(s, hf, d, prefix, e, rank, part, tp, formats)
    if s.checkpoint.decoded_in_kernel:
        e = global_expert(d, shards, rank, local)
        return mxfp4_expert(s, hf, d, prefix, e, formats)
    out = {}
    for cls, fmt in s.layer_formats(d, prefix, dict(formats or {}), expert_tp(shards)).items():
        name = cls.split(".")[1]
        if fmt.name in FOUR_BIT:
            out |= four_bit_expert_matrix(s, hf, d, prefix, local, name, rank, shards, fmt)
            continue
        if fmt.cols:                                   # an FP8 checkpoint's blocks, as they are
            out |= fp8_expert_matrix(s, hf, d, prefix, local, name, rank, shards, fmt)
            continue
        m = expert_matrix(s, hf, d, prefix, local, name, rank, shards)
        if fmt.name == "fp8":
            held = _held(s, hf, d, prefix, local, name, rank, shards, fmt)
            codes, scales = held or _requantized(m.T, fmt)      # blocks of input rows
            out[f"{name}_codes"] = np.ascontiguousarray(codes.T)
            out[f"{name}_scales"] = (pack_bf16_scales(scales.T) if fmt.scale == "bf16"
                                     else np.ascontiguousarray(scales.T))
        else:
            out[name] = m.astype(ml_dtypes.bfloat16)
    return out


def _requantized(m: np.ndarray, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray]:
    r = requantize_fp8_blocks(m, fmt.block, fmt.scale)
    return r.codes, r.scales


def _held(s: MoE, hf: Mapping, d: Any, prefix: str, local: int, name: str, rank: int,
          shards: ShardTable, fmt: WeightFormat) -> tuple[np.ndarray, np.ndarray] | None:
    """A rank's slice of local expert `local` that a requantized checkpoint already holds as
    e4m3 values under bf16 block scales (`BLOCK_SCALE`): its codes `[out, in]` and scales
    `[out, in/block]`, taken as they are; None for a checkpoint's own values."""
    stored = fused_tensor(s, prefix, "expert." + name)
    if stored + BLOCK_SCALE not in hf:
        return None
    e = global_expert(d, shards, rank, local)
    values, scales = np.asarray(hf[stored][e], np.float32), np.asarray(hf[stored + BLOCK_SCALE][e])
    block = values.shape[1] // scales.shape[1]
    if fmt.scale != "bf16" or block != fmt.block:
        raise ValueError(f"{stored} holds codes under bf16 scales per {block} rows (a requantized "
                         f"checkpoint), which `{fmt.spelled}` cannot take as they are: pack the "
                         "checkpoint itself")
    out_index, in_index, _ = _rank_slice(s, d, name, rank, shards)
    codes = values[np.ix_(out_index, in_index)].astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    return codes, scales[np.ix_(out_index, [i // block for i in in_index[::block]])]


def gate_up_halves(s: MoE, rows: np.ndarray, half: int) -> np.ndarray:
    """The checkpoint's gate|up along axis 0 (``[2I, ...]``: gate rows first, or at even
    indices and up at odd ones with `gate_up_interleaved`, upstream GPT-OSS's ``gate_up[...,
    ::2]`` and ``[..., 1::2]``) -> ``[2 * half, ...]``: the gate rows, zeros up to ``half``, the
    up rows, zeros up to ``2 * half``. Works on any trailing axes (a weight's MXFP4 codes or
    scales, a bias), so packing moves bytes and rounds nothing."""
    rows = np.asarray(rows)
    width = rows.shape[0] // 2
    if rows.shape[0] % 2 or half < width:
        raise ValueError(f"{rows.shape[0]} gate|up rows do not make two halves of at most {half}")
    gate, up = (rows[0::2], rows[1::2]) if s.gate_up_interleaved else (rows[:width], rows[width:])
    pad = [(0, half - width)] + [(0, 0)] * (rows.ndim - 1)
    return np.concatenate([np.pad(gate, pad), np.pad(up, pad)], axis=0)


def mxfp4_expert(s: MoE, hf: Mapping, d: Any, prefix: str, e: int,
                 formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Routed expert `e` of an MXFP4 checkpoint as its slot holds it (whole: the experts split
    over every core): codes and scales K-major in the resolved formats, moved, never decoded
    (module docstring); with `expert_bias` the bias rows bf16 `[1, n]`."""
    p = f"{prefix}{s.prefix}experts."
    half, groups = s.expert_half(d), s.pack_groups(d)

    def codes(name: str) -> np.ndarray:       # `*_blocks [out, in/32, 16]` -> codes [out, in/2]
        blocks = np.asarray(hf[p + f"{name}_proj_blocks"][e], np.uint8)
        return blocks.reshape(blocks.shape[0], -1)

    def scales(name: str) -> np.ndarray:
        return np.asarray(hf[p + f"{name}_proj_scales"][e], np.uint8)

    pad = half - d.moe_intermediate_size              # down's input columns: zero codes
    stored = {"gate_up": (gate_up_halves(s, codes("gate_up"), half),
                          gate_up_halves(s, scales("gate_up"), half)),
              "down": (np.pad(codes("down"), ((0, 0), (0, pad // 2))),
                       np.pad(scales("down"), ((0, 0), (0, pad // MX_BLOCK))))}
    resolved = s.expert_formats(d, dict(formats or {}))
    out = {}
    for name, (kernel_codes, kernel_scales) in stored.items():
        kernel_codes, kernel_scales = pack_mxfp4_for_kernel(kernel_codes, kernel_scales, groups[name])
        fmt = resolved[f"expert.{name}"]
        if fmt.name == "fp8":
            kernel_codes, kernel_scales = fp8_codes_from_kernel_mxfp4(kernel_codes, kernel_scales,
                                                                      groups[name], fmt.block)
        out[f"{name}_codes"], out[f"{name}_scales"] = kernel_codes, kernel_scales
        if s.expert_bias:
            bias = np.asarray(hf[p + f"{name}_proj_bias"][e]).astype(np.float32)
            bias = gate_up_halves(s, bias, half) if name == "gate_up" else bias
            out[f"{name}_bias"] = bias[None, :].astype(ml_dtypes.bfloat16)
    return out


def requantization(s: MoE, hf: Mapping, d: Any, formats: Mapping[str, WeightFormat],
                   prefixes: Sequence[str], shards: ShardTable | None = None
                   ) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The routed experts of the layers under `prefixes` as the kernel holds them: each FP8
    class's fused tensors requantized expert by expert (blocks of input rows, as packing cuts
    them: experts are whole on every rank), as bf16 (every e4m3 value times a power of two is
    one, so the reference reads the kernel's values exactly; `scale bf16`: the codes' values,
    their scales beside them as `BLOCK_SCALE`); an int4 class's likewise (`four_bit_requantized`);
    and per class the error against the checkpoint's values (values, changed, blocks, inexact
    blocks, max abs, relative RMS). MXFP4 experts' FP8 codes are exact (`mxfp4_expert` refuses
    the others): none."""
    if s.checkpoint is Checkpoint.MXFP4_PACKED:
        return packed_requantization(s, hf, d, formats, prefixes, expert_tp(shards) if shards else 1)
    if s.checkpoint.decoded_in_kernel:
        return {}, {}
    resolved = s.expert_formats(d, dict(formats), expert_tp(shards) if shards else 1)
    fp8 = {cls: f for cls, f in resolved.items()
           if f.name == "fp8" and not f.cols}           # an FP8 checkpoint's blocks: as they are
    out: dict[str, np.ndarray] = {}
    totals = {cls: RequantizationError() for cls in fp8}
    for prefix in prefixes:
        for cls, fmt in fp8.items():
            name = fused_tensor(s, prefix, cls)
            held, scales = [], []
            for e in range(d.experts):
                r = requantize_fp8_blocks(np.asarray(hf[name][e]).astype(np.float32), fmt.block, fmt.scale)
                totals[cls].add(r)
                if r.scale == "bf16":       # the codes' values; their scales beside them
                    held.append(r.codes.view(ml_dtypes.float8_e4m3fn).astype(ml_dtypes.bfloat16))
                    scales.append(r.scales)
                else:
                    held.append(fp8_block_values(r).astype(np.float32).astype(ml_dtypes.bfloat16))
            out[name] = np.stack(held)
            if scales:
                out[name + BLOCK_SCALE] = np.stack(scales)
    four_bit, errors = four_bit_requantized(s, hf, d, resolved, prefixes)
    return out | four_bit, {cls: totals[cls].report(fmt.spelled) for cls, fmt in fp8.items()} | errors


def four_bit_requantized(s: MoE, hf: Mapping, d: Any, resolved: Mapping[str, WeightFormat],
                         prefixes: Sequence[str]) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The int4 classes' fused tensors (`resolved`: every class's format) of the layers under
    `prefixes` requantized whole, expert by expert (a rank's slice is whole blocks of input rows,
    so its packing requantizes the same values): the codes' integers as bf16 values, their bf16
    scales beside them as `BLOCK_SCALE` (f32 `[E, out, in/block]`), which the reference
    multiplies; an `nvfp4 rounded` class's layers the NVFP4 checkpoint keeps bf16
    (`MoE.bf16_expert_layers`) as NVFP4 tensors (`nvfp4_from_bf16`: codes, `_weight_scale`,
    `_weight_scale_2`), which the reference decodes as it decodes the others. With the error per
    class against the checkpoint's values (an nvfp4 class's NVFP4 layers held as they are count
    none); FormatError where int4 moves a value and the class does not say `rounded`."""
    classes = {cls: f for cls, f in resolved.items() if f.name in FOUR_BIT}
    out: dict[str, np.ndarray] = {}
    totals = {cls: RequantizationError() for cls in classes}
    for prefix in prefixes:
        if s.layer_checkpoint(d, prefix) is not Checkpoint.BF16:
            continue                             # an NVFP4 layer: held as it is
        for cls, fmt in classes.items():
            if fmt.name == "nvfp4" and not fmt.rounded:
                continue                         # held bf16 (`MoE.holds_bf16_layers`) or refused
            name = fused_tensor(s, prefix, cls)
            parts: list[list[np.ndarray]] = [[], [], []]
            for e in range(d.experts):
                values = np.asarray(hf[name][e], np.float32)
                what = f"layer {_layer_of(prefix)} expert {e}'s {cls.split('.')[1]}"
                if fmt.name == "int4":
                    r = int4_from_bf16(values, fmt, cls, what)
                    held = (r.codes.astype(ml_dtypes.bfloat16), r.scales)
                else:
                    r = nvfp4_from_bf16(values)
                    held = (r.codes, r.block_scales, np.asarray(r.global_scale, np.float32))
                totals[cls].add(r)
                for part, array in zip(parts, held):
                    part.append(array)
            suffixes = ("", BLOCK_SCALE) if fmt.name == "int4" else ("", NVFP4_SCALE, NVFP4_GLOBAL)
            out |= {name + suffix: np.stack(part) for suffix, part in zip(suffixes, parts)}
    return out, {cls: totals[cls].report(fmt.spelled) for cls, fmt in classes.items()}


# ---- compressed-tensors MXFP4 experts, per expert (`Checkpoint.MXFP4_PACKED`: Kimi K3's) ----
# `experts.{e}.w{1,3,2}.weight_packed` ([out, in/2] e2m1 codes) and `.weight_scale` ([out,
# in/32] E8M0), w1 gate, w3 up, w2 down; a requantized checkpoint's bf16 block scales beside
# them (`format expert.* fp4 block N rounded scale bf16`), f32 [out, in/block], under 32-row
# scales of 1: not a checkpoint's, what the kernel holds.
PACKED_BLOCK_SCALE = "weight_block_scale"
_PACKED = (("gate_up", ("w1", "w3")), ("down", ("w2",)))
_PACKED_CLASS = {"w1": "expert.gate_up", "w3": "expert.gate_up", "w2": "expert.down"}
_PACKED_NAME = {"w1": "gate", "w3": "up", "w2": "down"}


def _layer_of(prefix: str) -> str:
    return prefix.removeprefix("model.layers.").rstrip(".")


def packed_requantized(codes: np.ndarray, scales: np.ndarray, fmt: WeightFormat, layer: str, expert: int,
                       matrix: str, out0: int = 0, in0: int = 0) -> Requantized:
    """Matrix `matrix` (w1, w3, w2) of expert `expert` requantized to `fmt`'s fp4 blocks
    (`mkc.layers.expert_formats.weights.fp4_from_mxfp4`)."""
    return fp4_from_mxfp4(codes, scales, fmt, _PACKED_CLASS[matrix],
                          f"layer {layer} expert {expert}'s {_PACKED_NAME[matrix]} ({matrix})", out0, in0)


def packed_mxfp4_expert(s: MoE, hf: Mapping, d: Any, prefix: str, e: int, rank: int, part: int, tp: int,
                        formats: Mapping[str, WeightFormat] | None = None) -> dict[str, np.ndarray]:
    """Width part `part` of `tp` of expert `e` (rank `rank`'s): gate|up and down codes and scales, K-major,
    each matrix in its format (`mkc.layers.expert_formats.tensors`); fp4 requantized (or taken
    as a requantized checkpoint holds it), fp8 from the MXFP4 codes."""
    p, w, layer = f"{prefix}{s.prefix}experts.{e}.", d.moe_intermediate_size // tp, _layer_of(prefix)
    groups = s.pack_groups(d, tp)
    resolved = s.expert_formats(d, dict(formats or {}), tp)
    # this part's MXFP4 slices: gate and up output rows part*w ... (part+1)*w; down's input columns
    sliced = {x: (np.asarray(hf[p + f"{x}.weight_packed"])[part * w:(part + 1) * w],
                  np.asarray(hf[p + f"{x}.weight_scale"])[part * w:(part + 1) * w]) for x in ("w1", "w3")}
    sliced["w2"] = (np.asarray(hf[p + "w2.weight_packed"])[:, part * w // 2:(part + 1) * w // 2],
                    np.asarray(hf[p + "w2.weight_scale"])[:, part * w // MX_BLOCK:(part + 1) * w // MX_BLOCK])
    out = {}
    for name, matrices in _PACKED:
        fmt = resolved[f"expert.{name}"]
        if fmt.name == "fp4":      # e2m1 codes as the checkpoint orders them, [in/2, out]
            parts = [_held_packed(hf, p + x, part * w, w, x == "w2", fmt)
                     or _codes(packed_requantized(*sliced[x], fmt, layer, e, x,
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
            except ValueError as err:
                raise ValueError(f"layer {layer} expert {e} {cls}, rank {rank}'s slice: {err}; "
                                 f"write `format {cls} fp8` (a scale per {MX_BLOCK} rows, "
                                 "always exact) or a smaller block") from None
    return out


def _codes(r: Requantized) -> tuple[np.ndarray, np.ndarray]:
    return r.codes, r.scales


def _held_packed(hf: Mapping, matrix: str, first: int, width: int, columns: bool, fmt: WeightFormat
                 ) -> tuple[np.ndarray, np.ndarray] | None:
    """A part of a matrix a requantized checkpoint already holds in `fmt` (`held_fp4`); None
    where the checkpoint holds MXFP4."""
    if f"{matrix}.{PACKED_BLOCK_SCALE}" not in hf:
        return None
    return held_fp4(hf[f"{matrix}.weight_packed"], hf[f"{matrix}.weight_scale"],
                    hf[f"{matrix}.{PACKED_BLOCK_SCALE}"], fmt, first, width, columns, matrix)


def packed_requantization(s: MoE, hf: Mapping, d: Any, formats: Mapping[str, WeightFormat],
                          prefixes: Sequence[str], tp: int) -> tuple[dict[str, np.ndarray], dict[str, dict]]:
    """The experts of the layers under `prefixes` as the kernel holds them, at the checkpoint
    level: each fp4 class's matrices requantized (their blocks of input rows are those of every
    width part's slice: a block divides it), as MXFP4 tensors whose 32-row scales are equal
    within a block, or (`scale bf16`) codes under unit scales with their bf16 block scales
    beside them (`fp4_checkpoint_tensors`), and per class the error against the checkpoint's
    values. FormatError where a class without `rounded` cannot be held exactly."""
    fp4 = {cls: f for cls, f in s.expert_formats(d, dict(formats), tp).items() if f.name == "fp4"}
    out: dict[str, np.ndarray] = {}
    totals = {cls: RequantizationError() for cls in fp4}
    for prefix in prefixes:
        for e in range(d.experts):
            p = f"{prefix}{s.prefix}experts.{e}."
            for x in ("w1", "w3", "w2"):
                fmt = fp4.get(_PACKED_CLASS[x])
                if fmt is None:
                    continue
                r = packed_requantized(np.asarray(hf[p + f"{x}.weight_packed"]),
                                       np.asarray(hf[p + f"{x}.weight_scale"]), fmt, _layer_of(prefix), e, x)
                codes, scales, block_scales = fp4_checkpoint_tensors(r)
                out[p + f"{x}.weight_packed"], out[p + f"{x}.weight_scale"] = codes, scales
                if block_scales is not None:
                    out[p + f"{x}.{PACKED_BLOCK_SCALE}"] = block_scales
                totals[_PACKED_CLASS[x]].add(r)
    return out, {cls: totals[cls].report(fmt.spelled) for cls, fmt in fp4.items()}
