"""Chip rates for the step-time model: facts from JAX's chip table, plus the few constants JAX
does not know, kept as data per chip generation (`mkc/perf/data/<chip>.json`), each with the
source of its value: "jax", "measured" (a TPU measurement, with its derivation) or "assumed" (with
how much the modelled steps move across a plausible range, `sensitivity`). Nothing is fitted to
the step times the model is judged on."""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from jax.experimental.pallas import tpu as pltpu

from mkc import target

DATA = Path(__file__).parent / "data"


@dataclass(frozen=True)
class Rates:
    """Per TensorCore. Times in seconds, rates per second, bytes in bytes."""

    chip: str
    # from JAX (`pltpu.get_tpu_info_for_chip`)
    hbm_bytes_per_s: float
    mxu_ops_per_s: dict          # MXU dtype -> peak ops/s (2 per multiply-add)
    mxu_column: int
    num_mxus: int
    # from the data file
    hbm_efficiency: float        # fraction of the HBM peak DMAs achieve when streaming
    dma_issue_s: float           # per copy: from start until its bytes flow (overlaps others)
    dma_overhead_bytes: float    # per copy: bandwidth it costs beyond its bytes (small copies)
    dma_queues: float            # in-order HBM<->VMEM DMA queues per core sharing its bandwidth
    op_overhead_s: float         # per op: fixed cost of a compute body
    vpu_ops_per_s: float         # VPU element operations per second (32-bit, whole registers)
    eup_ops_per_s: float         # transcendental element operations per second
    f32_matmul_passes: float     # bf16 MXU passes a matmul with an f32 operand takes
    ici_link_bytes_per_s: float  # a chip-to-chip link, one direction, shared by the copies on it
    ici_chip_bytes_per_s: float  # all of a chip's outgoing cross-chip streams together
    ici_copy_s: float            # a remote copy to another chip: fixed cost (start to both waits)
    sibling_bytes_per_s: float   # a remote copy to the other core of the same chip
    sibling_copy_s: float        # its fixed cost
    remote_issue_s: float        # issuing one remote copy: the next starts this much later
    collective_entry_s: float    # of a lone copy's fixed cost, the part a collective pays once
    ici_hop_s: float             # each chip-to-chip hop past the first
    step_fixed_s: float          # per step outside the kernel: dispatch, XLA glue, barrier
    # a 256 x 256 tile of bf16-pushed weights into the MXUs, measured; 0: from JAX's peak
    mxu_tile_push_s: float = 0.0
    # the clock the compiled price turns libtpu's bundles into seconds at (`mkc.perf.bundles`:
    # a bundle issues a cycle); `rates` fills in JAX's when the data file gives none
    clock_hz: float = 0.0
    provenance: dict = dataclasses.field(default_factory=dict, compare=False)

    @property
    def cycle_s(self) -> float:
        return 1.0 / self.clock_hz

    @property
    def hbm_stream_bytes_per_s(self) -> float:
        return self.hbm_bytes_per_s * self.hbm_efficiency

    def mxu_rate(self, dtype: str) -> float:
        """Peak MXU ops per second for inputs of `dtype` (f32: bf16 over its passes; bf16
        rows through fp8 weights: the bf16 rate)."""
        if dtype == "f32":
            return self.mxu_ops_per_s["bf16"] / self.f32_matmul_passes
        if dtype in ("bf16xfp8", "bf16xfp4"):
            return self.mxu_ops_per_s["bf16"]
        if dtype not in self.mxu_ops_per_s:
            raise KeyError(f"{self.chip} has no {dtype} matrix unit (JAX gives "
                           f"{', '.join(sorted(self.mxu_ops_per_s))})")
        return self.mxu_ops_per_s[dtype]

    def feed_values_per_s(self, dtype: str) -> float:
        """Weight values the MXUs take in per second: at decode batch (<= 8 rows) a matmul is
        bound by pushing its weights into the systolic arrays, not by FLOPs, and libtpu's
        static schedule issues a push a bundle that the MXU takes in over many cycles (a 256 x
        256 bf16 tile: ~20 bundles, 20 ns measured on TPU7x). Where the generation's push time
        is measured (`mxu_tile_push_s`), bf16 pushes run at it and other pushed types at their
        JAX rate's ratio to bf16's; else a column x column tile loads in about `column` cycles
        while the peak does column x column multiply-adds a cycle: peak / (2 x column). The
        counted price loads at this rate; the compiled price never runs faster
        (`mkc.perf.sim.Model.feed_seconds`)."""
        if dtype == "bf16xfp8":
            # fp8 weights pushed as they are (libtpu's LLO of a bf16 x fp8 dot: tpu7x pushes
            # f8e4m3, half the pushes of bf16; v6e and v5e convert inside the push): loaded at
            # the chip's fp8 rate where JAX gives one, else at bf16's
            dtype = "fp8" if "fp8" in self.mxu_ops_per_s else "bf16"
        if dtype == "bf16xfp4":
            # fp4 weights: JAX gives no fp4 rate (tpu7x: bf16, fp8; int4 and int8 zero), and
            # libtpu's LLO of a bf16 x fp4 dot converts the codes to e4m3 and pushes them as
            # fp8 (benchmarks/format_probe.py --bundles): assumed loaded at the fp8 rate
            dtype = "fp4" if "fp4" in self.mxu_ops_per_s else (
                "fp8" if "fp8" in self.mxu_ops_per_s else "bf16")
        if self.mxu_tile_push_s:
            bf16 = self.mxu_column ** 2 / self.mxu_tile_push_s
            return bf16 * self.mxu_rate(dtype) / self.mxu_rate("bf16")
        return self.mxu_rate(dtype) / (2 * self.mxu_column)

    def replace(self, **kw) -> "Rates":
        return dataclasses.replace(self, **kw)


def data_path(chip: str) -> Path:
    return DATA / f"{chip}.json"


@lru_cache(maxsize=None)
def load_data(chip: str) -> dict:
    """A generation's data file. A file that names `carried_from` gives only what is known of
    its own generation (ICI and the like); every other constant is the
    named generation's, and its source says it was carried over, not measured here."""
    p = data_path(chip)
    if not p.is_file():
        raise KeyError(chip)
    data = json.loads(p.read_text())
    data["own"] = sorted(data["constants"])
    if base := data.get("carried_from"):
        # a measurement of the chip itself (`"carry": false`) stays with it
        carried = {k: {"value": v["value"], "source": f"carried from {base} (not measured on "
                                                      f"{chip}): {v['source']}"}
                   for k, v in load_data(base)["constants"].items() if v.get("carry", True)}
        data["constants"] = carried | data["constants"]
    return data


def rates(chip: str, overrides: dict | None = None) -> Rates:
    """The model's rates for `chip`: JAX's facts plus the data file's constants."""
    version_name = target.generation(chip).version
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, version_name), 1)
    data = load_data(chip)
    consts = {k: float(v["value"]) for k, v in data["constants"].items()} | (overrides or {})
    mxu = {"bf16": float(info.bf16_ops_per_second)}
    for dtype, attr in (("fp8", "fp8_ops_per_second"), ("int8", "int8_ops_per_second"),
                        ("int4", "int4_ops_per_second")):
        if getattr(info, attr, 0):
            mxu[dtype] = float(getattr(info, attr))
    # JAX's chip table implies a clock: peak bf16 ops/s over 2 ops per multiply-add of each of
    # its MXUs' column x column cells a cycle
    consts.setdefault("clock_hz", float(info.bf16_ops_per_second)
                      / (2 * int(info.num_mxus) * int(info.mxu_column_size) ** 2))
    prov = {"clock_hz": "jax: bf16_ops_per_second / (2 x num_mxus x mxu_column^2)"} | {
        k: v["source"] for k, v in data["constants"].items()}
    # A rank's HBM bandwidth is the HBM floor's (mkc.target.chip): JAX's per-TensorCore
    # figure times the TensorCores a device drives. On a megacore (v5p) the kernel computes on
    # one TensorCore, and whether its DMAs reach the other's share too is not verified.
    per_rank = target.chip(chip)
    prov |= {"hbm_bytes_per_s": "jax: mem_bw_bytes_per_second"
                                + (f" x {per_rank.tensorcores_per_rank} TensorCores per rank "
                                   "(megacore; unverified that one core's DMAs reach it)"
                                   if per_rank.tensorcores_per_rank > 1 else ""),
             "mxu_ops_per_s": "jax: bf16/fp8/int8 ops_per_second",
             "mxu_column": "jax: mxu_column_size", "num_mxus": "jax: num_mxus"}
    return Rates(chip=chip, hbm_bytes_per_s=per_rank.hbm_bytes_per_s,
                 mxu_ops_per_s=mxu, mxu_column=int(info.mxu_column_size),
                 num_mxus=int(info.num_mxus), provenance=prov,
                 **{f.name: consts[f.name] for f in dataclasses.fields(Rates)
                    if f.name in consts})


def validation(chip: str) -> dict:
    """The model against the published figures of `chip` (benchmarks/validate_perf.py): each
    step's and micro-case's error and how far the steps move across each assumed constant's
    range; empty for a generation without published figures of its own."""
    return load_data(chip).get("validation", {})


def carried_from(chip: str) -> str | None:
    """The generation whose constants `chip` borrows, if any."""
    return load_data(chip).get("carried_from")
