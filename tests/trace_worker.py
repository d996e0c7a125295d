"""Trace generated modules' decode steps on virtual CPU devices (no compile, no run): what a
spec's geometry must survive before any backend sees it (static slices inside the cache, ...).

    python tests/trace_worker.py MODULE.py BATCH [MODULE.py BATCH ...]

Prints `TRACED path` or `FAILED path: error` a module; exits 1 if any failed."""
import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from mkc.files import import_generated  # noqa: E402


def trace(path: str, batch: int) -> None:
    gen = import_generated(path, name="generated_module")
    mesh = Mesh(np.array(jax.devices()[:gen.RANKS]), (gen.AXIS,))
    weights, state = gen.abstract_inputs(batch)
    rows = jax.ShapeDtypeStruct((batch,), np.int32)
    gen.make_decode_step(mesh, batch).trace(weights, state, rows, rows)


def main(argv: list[str]) -> int:
    failed = False
    for path, batch in zip(argv[::2], argv[1::2]):
        try:
            trace(path, int(batch))
            print(f"TRACED {path}", flush=True)
        except Exception as e:  # noqa: BLE001 - the verdict is the point
            failed = True
            print(f"FAILED {path}: {type(e).__name__}: {str(e)[:300]}", flush=True)
    return int(failed)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
