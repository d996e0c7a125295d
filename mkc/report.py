"""What `mkc check` reports about a checked schedule: the budget as data, and as a table."""
from __future__ import annotations

from typing import Any

from mkc import cost, ir, target
from mkc.checks import vmem_budget
from mkc.checks.capacity import (Kernel, compiler_overhead_bytes, compiler_scratch, kernels,
                                 usable_vmem_bytes, vmem_budget_bytes)


def budget(s: ir.ScheduleIR, events: list) -> dict[str, Any]:
    """VMEM peaks (by class and buffer) in every kernel the VMEM verdict judges
    (`capacity.kernels`) and the decode step at the smallest batch, the weight stream, HBM per
    chip and the HBM-bandwidth floor of a step. Bytes are integers; nothing here is rounded."""
    vmem = []
    smallest = Kernel(s.batch_min, s.batch_min)
    for k in sorted({smallest, *kernels(s)}, key=lambda k: (k.verify, k.rows, k.sequences)):
        peak, where, live = vmem_budget(s, events, k)
        # `batch` is a decode step's; a verify step is named by its rows and sequences
        vmem.append({"kernel": str(k), "verify": k.verify, "rows": k.rows,
                     "sequences": k.sequences, "batch": None if k.verify else k.rows,
                     "peak_bytes": peak, "where": where,
                     "budget_bytes": vmem_budget_bytes(s),
                     "compiler_scratch_bytes": compiler_overhead_bytes(s, k),
                     "buffers": [{"name": b.name, "class": b.cls, "shape": list(b.shape),
                                  "dtype": b.dtype, "bytes": b.vmem_bytes} for b in live]})
    st = s.stream
    bandwidth = target.chip(s.chip).hbm_bytes_per_s
    floors = [{"batch": batch, "tokens_in_cache": s.context,
               "traffic_bytes": cost.hbm_traffic(s, batch, s.context),
               "seconds": cost.step_floor_seconds(s, bandwidth, batch, s.context)}
              for batch in sorted({s.batch_min, s.batch_max})]
    return {
        "vmem_limit_bytes": s.vmem_limit, "vmem_reserve_bytes": s.vmem_reserve,
        "vmem_usable_bytes": usable_vmem_bytes(s), "vmem_budget_bytes": vmem_budget_bytes(s),
        "vmem_compiler_scratch_source": compiler_scratch(s).source,
        "vmem": vmem,
        "stream": {"tiles": st.total_tiles, "tile_shapes": [list(t) for t in st.tile_shapes],
                   "dtype": st.dtype, "slots": st.slots, "slot_shape": [st.tile_rows, st.tile_cols],
                   "ahead": st.ahead, "streamed_bytes": st.streamed_bytes,
                   "useful_bytes": st.useful_bytes,
                   # dense classes streamed as 8-bit codes (`format CLASS int8 channel rounded`)
                   "codes": {f.format_class: f.codes for fs in (*st.families.values(), st.tail)
                             for f in fs if f.codes != "bf16"}},
        "hbm_per_chip": {"batch": s.batch_max, "capacity_bytes": s.hbm_per_core * s.cores_per_chip,
                         "bytes": {k: v * s.cores_per_chip for k, v in s.hbm_bytes_per_rank.items()}},
        "hbm_floor": {"bytes_per_s_per_core": bandwidth, "per_batch": floors},
    }


def budget_table(s: ir.ScheduleIR, report: dict[str, Any]) -> str:
    lines = []
    for v in report["vmem"]:
        by_cls: dict[str, int] = {}
        for b in v["buffers"]:
            by_cls[b["class"]] = by_cls.get(b["class"], 0) + b["bytes"]
        width = f"in the {v['kernel']}" if v["verify"] else f"at batch {v['batch']}"
        lines += [f"VMEM budget of {s.name} ({s.model}) {width}, peak at "
                  f"{v['where']}:", f"  {'class':<12} {'MiB':>9}  buffers"]
        for cls in sorted(by_cls, key=lambda k: (-by_cls[k], k)):
            names = ", ".join(b["name"] for b in v["buffers"] if b["class"] == cls)
            lines.append(f"  {cls:<12} {by_cls[cls] / 2**20:9.2f}  {names}")
        lines.append(f"  {'total':<12} {v['peak_bytes'] / 2**20:9.2f}  of "
                     f"{v['budget_bytes'] / 2**20:.2f} MiB (usable "
                     f"{(v['budget_bytes'] + s.vmem_reserve) / 2**20:.2f} - reserve "
                     f"{s.vmem_reserve / 2**20:.2f})")
    lines.append(f"Compiler scratch (spill slots, internal scratch): "
                 f"{report['vmem_compiler_scratch_source']}")
    st = report["stream"]
    shapes = ", ".join(f"{r}x{c}" for r, c in st["tile_shapes"])
    by_codes: dict[str, list[str]] = {}
    for cls, c in sorted(st["codes"].items()):
        by_codes.setdefault(c, []).append(cls)
    codes = "".join(f"; {', '.join(classes)} as {c} codes (two input rows a slot row)"
                    for c, classes in by_codes.items())
    lines.append(f"Weight stream: {st['tiles']} tiles ({shapes}) {st['dtype']} through "
                 f"{st['slots']} slots of {st['slot_shape'][0]}x{st['slot_shape'][1]}, "
                 f"{st['ahead']} ahead{codes}; {st['streamed_bytes'] / 1e9:.3f} GB per rank per step "
                 f"({100 * (st['streamed_bytes'] / st['useful_bytes'] - 1):.1f}% tile padding)")
    hbm = report["hbm_per_chip"]
    lines.append(f"HBM per chip at batch {hbm['batch']}: {sum(hbm['bytes'].values()) / 1e9:.2f} of "
                 f"{hbm['capacity_bytes'] / 1e9:.1f} GB ("
                 + ", ".join(f"{k} {v / 1e9:.2f}" for k, v in hbm["bytes"].items()) + ")")
    floor = report["hbm_floor"]
    for f in floor["per_batch"]:
        lines.append(f"HBM floor at batch {f['batch']}, {f['tokens_in_cache']} cached tokens: "
                     f"{f['seconds'] * 1e3:.2f} ms per step at "
                     f"{floor['bytes_per_s_per_core'] / 1e12:.1f} TB/s per core ("
                     + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in f["traffic_bytes"].items())
                     + ")")
    return "\n".join(lines)

