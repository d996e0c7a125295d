"""Compile a generated module's full-size kernel with libtpu for its compile-only TPU topology,
from abstract inputs (no weights): .venv/bin/python benchmarks/tpu_compile.py MODULE.py BATCH
[--verify R] (with --verify: the module's verify step of R rows for BATCH sequences).

The module's rank count must equal the topology's device count. With --vmem, the compile
runs in a subprocess and prints libtpu's VMEM verdict (fits with the bytes used, or out of
VMEM with used and limit): see mkc/confirm.py."""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu's lockfile, no TPU here
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from mkc.confirm import RankMismatch, compile_module as _compile, run_compile  # noqa: E402


def compile_module(path: str, batch: int, verify_rows: int | None = None) -> tuple[str, float, float]:
    """Returns (topology, lower seconds, compile seconds); raises if the module's rank count
    is not the topology's device count, or what the compiler raises."""
    info = _compile(path, batch, verify_rows)
    return info["topology"], info["lower_s"], info["compile_s"]


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if a != "--vmem"]
    verify_rows = None
    if "--verify" in args:
        i = args.index("--verify")
        verify_rows = int(args[i + 1])
        del args[i:i + 2]
    if len(args) != 2 or not args[1].isdigit():
        sys.exit(__doc__)
    path, batch = args[0], int(args[1])
    if "--vmem" in sys.argv:
        r = run_compile(path, batch)
        used = r.get("used_bytes")
        print(f"{path} batch {batch}: libtpu {r['libtpu']}"
              + (f", {used / 2**20:.2f} MiB of {r['limit_bytes'] / 2**20:.2f} MiB VMEM"
                 if used and r.get("limit_bytes") else "")
              + (f": {r['message'].splitlines()[0]}" if r.get("message") else ""))
        sys.exit(0 if r["libtpu"] == "fits" else 1)
    try:
        topology, lower_s, compile_s = compile_module(path, batch, verify_rows)
    except RankMismatch as e:        # not the compiler's verdict: the module and topology disagree
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    what = f"batch {batch}" if verify_rows is None else f"verify {verify_rows} rows x {batch} sequences"
    print(f"{path} {what}: lowered in {lower_s:.2f} s, compiled for {topology} in "
          f"{compile_s:.2f} s")
