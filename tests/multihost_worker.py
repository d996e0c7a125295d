"""One process of a 2-process jax.distributed run on CPU (8 virtual devices each), standing in
for 2 hosts of the MINI K3 schedule on tpu7x 2x2x2: the generated host wrapper builds the
global mesh in rank order, packs and places only this process's ranks, and lowers the decode
step over the global mesh.

    python tests/multihost_worker.py PROCESS_ID PORT
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
from generated_module import k3_mini_spec, load_generated  # noqa: E402

from mkc.families.kimi_k3 import reference as reference  # noqa: E402


def main(process_id: int, port: int) -> int:
    jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=2,
                               process_id=process_id)
    gen = load_generated(k3_mini_spec(), "kimi_k3_mini")
    mesh = gen.make_mesh()
    owners = [d.process_index for d in mesh.devices.flat]
    assert owners == [0] * 8 + [1] * 8, owners

    config = json.loads((ROOT / "mkc/model/configs/kimi_k3_mini.json").read_text())
    hf = reference.init_params(reference.load_config(config), seed=0)
    weights = gen.place_weights(hf, mesh)
    local = sorted(s.index[0].start for s in weights["ring_hbm"].addressable_shards)
    assert local == list(range(8 * process_id, 8 * process_id + 8)), local
    first = local[0]
    packed = gen.pack_rank(hf, first)
    for name, array in weights.items():
        shard = next(s for s in array.addressable_shards if s.index[0].start == first)
        # bytewise: packed MXFP4 codes are arbitrary bit patterns in bf16 (NaNs included)
        got, want = np.ascontiguousarray(np.asarray(shard.data)[0]), np.ascontiguousarray(packed[name])
        assert got.dtype == want.dtype and got.tobytes() == want.tobytes(), name

    state = gen.place_state(2, mesh)
    assert all(len(a.addressable_shards) == 8 for a in state.values())
    tokens = jnp.asarray([5, 77], jnp.int32)
    positions = jnp.asarray([136, 267], jnp.int32)
    step = gen.make_decode_step(mesh, 2, pltpu.InterpretParams())
    step.lower(weights, state, tokens, positions)
    print(f"process {process_id}: ranks {local[0]}..{local[-1]} placed, decode step lowered",
          flush=True)
    jax.distributed.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]), int(sys.argv[2])))
