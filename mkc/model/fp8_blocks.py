"""FP8 checkpoints with f32 block scales (DeepSeek-V3's published one): the one home of the
format's facts, its config, its values and the random draws a MINI model stores in it.

Facts (the deepseek-ai/DeepSeek-V3 checkpoint, its config.json and `inference/fp8_cast_bf16.py`;
transformers 5.25 `integrations/finegrained_fp8.py`): `quantization_config` is {"quant_method":
"fp8", "fmt": "e4m3", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}. Each
quantized linear weight `W [out, in]` is stored as `float8_e4m3fn` codes (safetensors
`F8_E4M3`) beside `weight_scale_inv`, f32 `[ceil(out / 128), ceil(in / 128)]`: one scale per
128 x 128 block of `[out, in]` (`weight_block_size` is [out, in]). The weight is `code * scale`
blockwise (`weight_dequant`: the code widened to f32, times its block's scale, in f32).
transformers 5 stores a model's routed experts fused, `mlp.experts.gate_up_proj [E, 2I, H]`
beside `mlp.experts.gate_up_proj_scale_inv [E, 2I / 128, H / 128]`; the published checkpoint
per expert (`mlp.experts.{e}.gate_proj.weight` and `.weight_scale_inv`), which the loader stacks
(`mkc.model.family.ExpertLayout`). Embeddings, norms, the router (`mlp.gate`, not a Linear),
its correction bias and `lm_head` are not quantized. "dynamic" activations: DeepSeek's own
inference quantizes each row's activations per 128 inputs on the fly for an fp8 x fp8 GEMM;
mkc's kernels feed bf16 activations (the weights are the checkpoint's, the activations are not
quantized), as transformers' dequantizing path does.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import ml_dtypes
import numpy as np

from mkc.model.family import ConfigError
from mkc.model.scales import ScaleRange

E4M3 = ml_dtypes.float8_e4m3fn
E4M3_NAME = "float8_e4m3fn"       # its numpy name, as a weight table types it
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale_inv"       # `W.weight` -> `W.weight_scale_inv`, `experts.down_proj` -> `..._scale_inv`
# What a stored scale may be, checked where the checkpoint loader reads it: f32 as the published
# checkpoint stores it (an f16 or bf16 scale is another checkpoint's rounding, not this format's),
# an f32 normal (0, a negative, a subnormal such as 1e-45: no block is scaled by them), and no
# larger than keeps the largest code's value finite in bf16 (a 3e38 scale made infinities).
SCALE_DTYPE = "float32"
SCALE_MIN = float(np.finfo(np.float32).tiny)
SCALE_MAX = float(ml_dtypes.finfo(ml_dtypes.bfloat16).max) / E4M3_MAX
SCALES = ScaleRange("block scale(s)", SCALE_MIN, SCALE_MAX, "an f32 normal that keeps e4m3's "
                    "largest code finite")
# The quantization_config mkc computes: key -> (the value it must hold, the hint).
_SETTINGS = {
    "quant_method": ("fp8", "an FP8 checkpoint with block scales says \"quant_method\": \"fp8\""),
    "fmt": ("e4m3", "its codes are e4m3 (\"fmt\": \"e4m3\"); e5m2 codes are not computed"),
    "activation_scheme": ("dynamic", "static activation scales are not computed: the kernels "
                                     "feed bf16 activations (\"activation_scheme\": \"dynamic\")"),
}


def read_quantization(raw: Mapping) -> tuple[int, int] | None:
    """The config's FP8 block size `weight_block_size` ([out, in] per scale), or None without a
    `quantization_config`; ConfigError for a quantization mkc does not compute."""
    quant = raw.get("quantization_config")
    if quant is None:
        return None
    if not isinstance(quant, Mapping):
        raise ConfigError(f"quantization_config = {quant!r} is not an object",
                          "an FP8 checkpoint's is {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", "
                          "\"weight_block_size\": [128, 128], \"activation_scheme\": \"dynamic\"}")
    for key, (want, hint) in _SETTINGS.items():
        if quant.get(key, want) != want:
            raise ConfigError(f"quantization_config {key} = {quant.get(key)!r} is not computed", hint)
    if quant.get("modules_to_not_convert"):
        raise ConfigError(f"quantization_config modules_to_not_convert = "
                          f"{quant['modules_to_not_convert']!r} is not computed",
                          "mkc reads every linear weight but the lm_head as FP8, as the published "
                          "checkpoint stores them: drop modules_to_not_convert")
    block = quant.get("weight_block_size")
    if (not isinstance(block, (list, tuple)) or len(block) != 2
            or not all(type(b) is int and 1 <= b <= 1 << 16 for b in block)):
        raise ConfigError(f"quantization_config weight_block_size = {block!r} is not two block sizes",
                          "write the [out, in] sizes of a block under one scale, e.g. [128, 128]")
    return int(block[0]), int(block[1])


def checked_scales(scales: Any, what: str) -> np.ndarray:
    """Block scales as packing reads them (arrays handed to a module's `place_weights`, not
    only a checkpoint the loader read): f32 values in the format's range, else ValueError
    naming `what` and the first bad index."""
    a = np.asarray(scales)
    if a.dtype != np.dtype(SCALE_DTYPE):
        raise ValueError(f"{what}: block scales of dtype {a.dtype}, expected {SCALE_DTYPE}")
    return SCALES.checked(a, what)


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """`weight_scale_inv`'s shape for a weight `[..., out, in]`: a scale per started block."""
    *lead, out, inp = shape
    return (*lead, -(-out // block[0]), -(-inp // block[1]))


def scale_name(name: str) -> str:
    return name + SCALE_SUFFIX


def expand_scales(scales, shape: tuple[int, ...], block: tuple[int, int], xp: Any = np):
    """Scales `[..., out / b0, in / b1]` -> one a value, `[..., out, in]` (`xp`: numpy or
    jax.numpy, traced or not)."""
    *_, out, inp = shape
    wide = xp.repeat(xp.repeat(scales, block[0], axis=-2), block[1], axis=-1)
    return wide[..., :out, :inp]


def dequantize(codes, scales, block: tuple[int, int], xp: Any = np):
    """The checkpoint's values of FP8 codes `[..., out, in]` under their block `scales`, as
    DeepSeek's `weight_dequant` computes them: the code widened to f32, times its block's
    scale, in f32."""
    codes = xp.asarray(codes).astype(xp.float32)
    return codes * expand_scales(xp.asarray(scales).astype(xp.float32), codes.shape, block, xp)


def widen(codes, scales, block: tuple[int, int], xp: Any = np):
    """The bf16 weight DeepSeek's `fp8_cast_bf16.py` writes for FP8 codes under their block
    `scales`: `dequantize`'s f32 values rounded to bf16 (to nearest, ties to even). What a
    kernel's bf16 tiles hold of an FP8 checkpoint's linear weights, and so what the references
    read (their rounding emulation takes a matrix's weights as the bf16 values a tile holds)."""
    return dequantize(codes, scales, block, xp).astype(ml_dtypes.bfloat16 if xp is np else xp.bfloat16)


def quantize(w: np.ndarray, block: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Values `[..., out, in]` -> (e4m3 codes, f32 scales per block) as DeepSeek's FP8 recipe
    makes them (its `act_quant`, per block): scale = the block's largest magnitude / 448 (1 for
    an all-zero block), code = the e4m3 value nearest value / scale. For MINI draws stored as
    the published checkpoint is; the values they stand for are `dequantize`'s, not `w`."""
    w = np.asarray(w, np.float32)
    *lead, out, inp = w.shape
    rows, cols = scale_shape(w.shape, block)[-2:]
    padded = np.pad(w, [(0, 0)] * len(lead) + [(0, rows * block[0] - out), (0, cols * block[1] - inp)])
    blocks = padded.reshape(*lead, rows, block[0], cols, block[1])
    amax = np.max(np.abs(blocks), axis=(-3, -1))
    scales = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    codes = (w / expand_scales(scales, w.shape, block)).astype(E4M3)
    return codes, scales


def has_scales(name: str, params: Mapping) -> bool:
    """Whether `name` is a linear weight stored as FP8 codes with its `weight_scale_inv`
    beside it (routed experts, stored fused, are not: their codes are read as they are)."""
    return name.endswith(".weight") and scale_name(name) in params


def values(params: Mapping, block: tuple[int, int], xp: Any = np) -> dict:
    """`params` with each linear weight stored as FP8 codes (`has_scales`) replaced by its
    bf16 weight (`widen`; `xp`: numpy, or jax.numpy on traced arrays)."""
    return {name: widen(w, params[scale_name(name)], block, xp) if has_scales(name, params) else w
            for name, w in params.items()}


class Dequantized(Mapping):
    """A checkpoint's tensors (name -> array, or a lazily read `mkc.checkpoint` source) with
    every FP8 linear weight (`has_scales`) read as its bf16 weight (`widen`), whole or indexed
    (`view[name][index]`), when read; every other tensor as it is. How the matrices a kernel
    holds in bf16 tiles are read from an FP8 checkpoint."""

    def __init__(self, hf: Mapping, block: tuple[int, int]):
        self.hf, self.block = hf, block

    def __getitem__(self, name: str):
        if has_scales(name, self.hf):
            return _Values(self.hf[name], self.hf[scale_name(name)], self.block)
        return self.hf[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.hf)

    def __len__(self) -> int:
        return len(self.hf)


class _Values:
    """One FP8 weight's bf16 weight, computed when read."""

    def __init__(self, codes, scales, block: tuple[int, int]):
        self.codes, self.scales, self.block = codes, scales, block
        self.shape, self.dtype = tuple(codes.shape), np.dtype(ml_dtypes.bfloat16)

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        out = widen(np.asarray(self.codes), checked_scales(self.scales, "an FP8 weight"), self.block)
        return out if dtype is None else out.astype(dtype)

    def __getitem__(self, index) -> np.ndarray:
        return np.asarray(self)[index]


def quantized_weights(shapes: Mapping[str, tuple[tuple[int, ...], str]], block: tuple[int, int]
                      ) -> dict[str, tuple[tuple[int, ...], str]]:
    """A bf16 model's weight table (name -> (shape, dtype)) as its FP8 checkpoint stores it:
    every linear weight (`*_proj*.weight`, and the fused experts `*_proj`) but the lm_head as
    e4m3 codes followed by its f32 `_scale_inv`; the rest as it is."""
    out: dict[str, tuple[tuple[int, ...], str]] = {}
    for name, (shape, dtype) in shapes.items():
        if is_quantized(name):
            out[name] = (shape, E4M3_NAME)
            out[scale_name(name)] = (scale_shape(shape, block), "float32")
        else:
            out[name] = (shape, dtype)
    return out


def is_quantized(name: str) -> bool:
    """Whether an FP8 checkpoint stores weight `name` as codes and scales: its linear layers'
    weights (a `..._proj...` module's `weight`, the fused experts' `..._proj`), not the lm_head, embeddings,
    norms or the router."""
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
        return True
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and "_proj" in module.rpartition(".")[2] and name != "lm_head.weight"
