"""Which block scale a rounded expert format should keep: E8M0 (a power of two, what mkc
stores), bf16 or f32 (the block's largest magnitude over the code's largest, rounded up so
nothing overflows: vLLM tpu-inference's choice for MXFP4 is f32 absmax / 6), each per block of
the shipped N input rows and per whole column. For each it gives the relative RMS error of the
requantized weights, the bytes a weight takes in HBM (codes and scales), and, with
--bundles, what libtpu schedules for one pack group's mixed dot with that scale
(`benchmarks/format_probe.py`'s kernel: a float scale is read where E8M0's is decoded).

    .venv/bin/python benchmarks/block_scales.py              # errors and bytes (seconds)
    .venv/bin/python benchmarks/block_scales.py --bundles    # and libtpu's bundles (a minute)

Weights are drawn at full size (K3's 7168 / 3072 input rows, Qwen3.5-35B-A3B's 2048 / 512) as
the MINI checkpoints draw them: Gaussian, through MXFP4 for K3 with every 32-row scale lowered
by 0..s octaves for spread s (as benchmarks/format_quality.py does), bf16 for Qwen. E8M0 is
mkc's own requantization (`mkc.model.mxfp4`); the float scales round values the same way
(nearest, ties to even, under the scale).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

import ml_dtypes
import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from mkc.model import mxfp4  # noqa: E402

SCALES = ("e8m0", "bf16", "f32", "bf16 searched")
SCALE_BYTES = {"e8m0": 1, "bf16": 2, "f32": 4, "bf16 searched": 2}
# "bf16 searched": mkc's `scale bf16` (`mkc.model.mxfp4.searched_bf16_scales`)
CODE = {"fp4": (ml_dtypes.float4_e2m1fn, 6.0), "fp8": (ml_dtypes.float8_e4m3fn, 448.0)}
COLS = 256          # columns drawn per matrix: errors are per column, so more add no information


@dataclass(frozen=True)
class Case:
    """A rounded format of a shipped spec: its matrix, the checkpoint's format, the input rows
    at full size and the shipped block."""
    spec: str
    matrix: str
    code: str            # "fp4" or "fp8"
    source: str          # "mxfp4" or "bf16"
    rows: int
    block: int


CASES = (Case("kimi_k3", "expert.gate_up", "fp4", "mxfp4", 7168, 512),
         Case("kimi_k3", "expert.down", "fp4", "mxfp4", 3072, 128),
         Case("qwen3_5_35b_a3b", "expert.gate_up", "fp8", "bf16", 2048, 512),
         Case("qwen3_5_35b_a3b", "expert.down", "fp8", "bf16", 512, 128))


def draw(case: Case, spread: int, rng: np.random.Generator) -> tuple[np.ndarray, tuple | None]:
    """Weights [COLS, rows] (output columns, input rows along the last axis) as the checkpoint
    holds them, and for MXFP4 its codes and scales."""
    w = (rng.standard_normal((COLS, case.rows)) * 0.02).astype(ml_dtypes.bfloat16).astype(np.float64)
    if case.source == "bf16":
        return w, None
    codes, scales = mxfp4.mxfp4_quantize(w)
    if spread:
        scales = np.maximum(scales.astype(np.int32) - rng.integers(0, spread + 1, scales.shape), 1
                            ).astype(np.uint8)
    return mxfp4.mxfp4_dequantize(codes, scales, w.shape).astype(np.float64), (codes, scales)


def _holding_scale(top: np.ndarray, largest: float, scale: str) -> np.ndarray:
    """The smallest scale of type `scale` under which `top` is at most the code's `largest`."""
    s = top / largest
    if scale == "e8m0":
        return np.exp2(np.ceil(np.log2(np.where(s > 0, s, 1.0))))
    dtype = ml_dtypes.bfloat16 if scale == "bf16" else np.float32
    held = s.astype(dtype)
    bits = held.view(np.uint16 if scale == "bf16" else np.uint32)
    up = (bits + 1).view(dtype)                        # next value up (s is positive)
    held = np.where(held.astype(np.float64) * largest < top, up, held)
    return np.where(s > 0, held.astype(np.float64), 1.0)


def requantize(w: np.ndarray, case: Case, block: int, scale: str, mx: tuple | None) -> np.ndarray:
    """The values `w` takes under `case`'s code with one `scale` per `block` input rows."""
    if scale in ("e8m0", "bf16 searched"):              # mkc's own, as packing does it
        kind = "bf16" if scale == "bf16 searched" else "e8m0"
        if mx is None:
            return mxfp4.fp8_block_values(mxfp4.requantize_fp8_blocks(w, block, kind))
        r = mxfp4.requantize_blocks(*mx, block, kind)
        values = mxfp4.mxfp4_dequantize(r.codes, np.full(r.codes.shape[:-1] + (w.shape[-1] // 32,), 127,
                                                         np.uint8), w.shape).astype(np.float64)
        return (values.reshape(w.shape[0], -1, block) * r.scale_values()[..., None]).reshape(w.shape)
    dtype, largest = CODE[case.code]
    blocked = w.reshape(w.shape[0], -1, block)
    top = np.abs(blocked).max(axis=-1, keepdims=True)

    def under(s: np.ndarray) -> np.ndarray:
        codes = np.clip(blocked / s, -largest, largest).astype(np.float32).astype(dtype)
        return codes.astype(np.float64) * s

    return under(_holding_scale(top, largest, scale)).reshape(w.shape)


def bytes_per_weight(case: Case, block: int, scale: str) -> float:
    return (0.5 if case.code == "fp4" else 1.0) + SCALE_BYTES[scale] / block


def rows(spreads: tuple[int, ...], seed: int) -> list[dict]:
    out = []
    for case in CASES:
        for spread in spreads if case.source == "mxfp4" else (0,):
            w, mx = draw(case, spread, np.random.default_rng([seed, spread, case.rows]))
            for block, per in ((case.block, f"block {case.block}"), (case.rows, "column")):
                err = {}
                for scale in SCALES:
                    new = requantize(w, case, block, scale, mx)
                    err[scale] = float(np.sqrt(np.sum((new - w) ** 2) / np.sum(w * w)))
                out.append({"spec": case.spec, "matrix": case.matrix,
                            "format": f"{case.code} {per} rounded", "source": case.source,
                            "spread": spread, "error": err,
                            "bytes": {s: bytes_per_weight(case, block, s) for s in SCALES}})
    return out


def table(results: list[dict]) -> str:
    head = ("| spec | matrix | format | from | spread (octaves) | relative RMS error: E8M0 / bf16 / f32 "
            "/ bf16 searched | bytes a weight: E8M0 / bf16 / f32 |\n|---|---|---|---|---|---|---|")
    lines = [head]
    for r in results:
        err = " / ".join(f"{100 * r['error'][s]:.2f} %" for s in SCALES)
        size = " / ".join(f"{r['bytes'][s]:.4f}" for s in SCALES[:3])
        lines.append(f"| {r['spec']} | {r['matrix']} | {r['format']} | {r['source']} | "
                     f"{r['spread'] if r['source'] == 'mxfp4' else '-'} | {err} | {size} |")
    return "\n".join(lines)


def bundle_lines() -> list[str]:
    import format_probe
    out = []
    for fmt in ("fp8 block", format_probe.FP4):
        for variant in (fmt, f"{fmt} bf16 scale", f"{fmt} f32 scale"):
            scale = format_probe.SCALE_VARIANTS.get(variant, "e8m0")
            out.append(f"tpu7x {fmt}, {scale} scale: {format_probe.bundles('tpu7x', variant)}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spreads", type=int, nargs="+", default=[0, 2, 4])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--bundles", action="store_true", help="also compile each scale's pack-group "
                    "dot with libtpu (tpu7x) and print its scheduled bundles")
    args = ap.parse_args(argv)
    print(table(rows(tuple(args.spreads), args.seed)))
    if args.bundles:
        print("\nlibtpu's schedule of one pack group's mixed dot (8 rows, 512 input rows, 256 columns):")
        print("\n".join(bundle_lines()))
    print(f"\nreproduce: .venv/bin/python benchmarks/block_scales.py{' --bundles' if args.bundles else ''}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
