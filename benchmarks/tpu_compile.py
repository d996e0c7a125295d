"""Compile a generated module's full-size kernel with libtpu for its compile-only TPU topology,
from abstract inputs (no weights): .venv/bin/python benchmarks/tpu_compile.py MODULE.py BATCH"""
from __future__ import annotations

import importlib.util
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu's lockfile, no TPU here

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental import topologies  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402


def compile_module(path: str, batch: int) -> tuple[str, float, float]:
    """Returns (topology, lower seconds, compile seconds)."""
    spec = importlib.util.spec_from_file_location("generated_module", path)
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    topo = topologies.get_topology_desc(gen.TOPOLOGY, platform="tpu")
    mesh = Mesh(np.array(topo.devices), (gen.AXIS,))
    ranked = NamedSharding(mesh, P(gen.AXIS))
    weights, state = gen.abstract_inputs(batch)
    place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=ranked)  # noqa: E731
    weights = {k: place(v) for k, v in weights.items()}
    state = {k: place(v) for k, v in state.items()}
    rows = jax.ShapeDtypeStruct((batch,), np.int32, sharding=NamedSharding(mesh, P()))
    step = gen.make_decode_step(mesh, batch)
    t0 = time.perf_counter()
    lowered = step.lower(weights, state, rows, rows)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return gen.TOPOLOGY, t1 - t0, t2 - t1


if __name__ == "__main__":
    path, batch = sys.argv[1], int(sys.argv[2])
    topology, lower_s, compile_s = compile_module(path, batch)
    print(f"{path} batch {batch}: lowered in {lower_s:.2f} s, compiled for {topology} in "
          f"{compile_s:.2f} s")
