"""The `mkc` command line: compile, check and ir."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")   # mkc itself never needs an accelerator

from mkc.diagnostics import MkcError  # noqa: E402


def _budget_table(c) -> str:
    from mkc.checks import vmem_budget
    s, events = c.ir, c.events
    budget = s.vmem_limit - s.vmem_reserve
    lines = []
    for batch in sorted({s.batch_min, s.batch_max}):
        peak, where, live = vmem_budget(s, events, batch)
        by_cls: dict[str, int] = {}
        for b in live:
            by_cls[b.cls] = by_cls.get(b.cls, 0) + b.vmem_bytes
        lines += [f"VMEM budget of {s.name} ({s.model}) at batch {batch}, peak at {where}:",
                  f"  {'class':<12} {'MiB':>9}  buffers"]
        for cls in sorted(by_cls, key=lambda k: (-by_cls[k], k)):
            names = ", ".join(b.name for b in live if b.cls == cls)
            lines.append(f"  {cls:<12} {by_cls[cls] / 2**20:9.2f}  {names}")
        lines.append(f"  {'total':<12} {peak / 2**20:9.2f}  of {budget / 2**20:.2f} MiB "
                     f"(limit {s.vmem_limit / 2**20:.0f} - reserve {s.vmem_reserve / 2**20:.2f})")
    st = s.stream
    shapes = ", ".join(f"{r}x{c}" for r, c in st.tile_shapes)
    lines.append(f"Weight stream: {st.total_tiles} tiles ({shapes}) {st.dtype} through "
                 f"{st.slots} slots of {st.tile_rows}x{st.tile_cols}, {st.ahead} ahead; "
                 f"{st.streamed_bytes / 1e9:.3f} GB per rank per step "
                 f"({100 * (st.streamed_bytes / st.useful_bytes - 1):.1f}% tile padding)")
    hbm = sum(s.hbm_bytes_per_rank.values()) * s.cores_per_chip
    lines.append(f"HBM per chip at batch {s.batch_max}: {hbm / 1e9:.2f} of "
                 f"{s.hbm_per_core * s.cores_per_chip / 1e9:.1f} GB ("
                 + ", ".join(f"{k} {v * s.cores_per_chip / 1e9:.2f}"
                             for k, v in s.hbm_bytes_per_rank.items()) + ")")
    from mkc import cost, target
    bandwidth = target.chip(s.chip).hbm_bytes_per_s
    for batch in sorted({s.batch_min, s.batch_max}):
        traffic = cost.hbm_traffic(s, batch, s.context)
        floor = cost.step_floor_seconds(s, bandwidth, batch, s.context)
        lines.append(f"HBM floor at batch {batch}, {s.context} cached tokens: "
                     f"{floor * 1e3:.2f} ms per step at {bandwidth / 1e12:.1f} TB/s per core ("
                     + ", ".join(f"{k} {v / 1e9:.3f} GB" for k, v in traffic.items()) + ")")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mkc", description="Schedule compiler for TPU decode megakernels")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("compile", "check a spec and write its Pallas module"),
                        ("check", "check a spec and print its VMEM budget"),
                        ("ir", "print the resolved schedule IR as JSON")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("spec", help="path to a .sched file")
        p.add_argument("--model", help="override the spec's model: a shipped config name, a "
                                       "config.json or a checkpoint directory")
        if name == "compile":
            p.add_argument("-o", "--out", default="generated", help="output directory")
    args = ap.parse_args(argv)

    from mkc import compiler
    source = None
    try:
        source = Path(args.spec).read_text() if Path(args.spec).is_file() else None
        if args.cmd == "compile":
            c = compiler.compile_spec(args.spec, args.model)
            out = Path(args.out) / f"{compiler.module_name(c)}.py"
            compiler.write_atomically(out, c.module_source)
            print(f"wrote {out}")
        elif args.cmd == "check":
            c = compiler.check_spec(args.spec, args.model)
            print(f"{args.spec}: ok")
            print(_budget_table(c))
        else:
            c = compiler.check_spec(args.spec, args.model)
            print(c.ir.to_json())
    except MkcError as e:
        print(e.render(source), file=sys.stderr)
        return 1
    except BrokenPipeError:            # e.g. `mkc ir SPEC | head`
        sys.stderr.close()
    except OSError as e:               # e.g. an output directory that cannot be written
        print(f"mkc: error: {e.strerror}: {e.filename}\n  hint: check the path and its "
              "permissions", file=sys.stderr)
        return 1
    return 0
