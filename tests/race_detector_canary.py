"""A deliberately racy 2-device kernel: a remote copy lands in a buffer the receiver reads
without waiting. The race tests of the generated kernels are only meaningful if the
interpret-mode detector flags this one; prints RACES=<bool>. With the argument `lean`, under
`mkc.interpret.lean_interpreter` (as the runners run)."""
import os
import sys

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

if sys.argv[1:] == ["lean"]:
    from mkc.interpret import lean_interpreter
    assert len(lean_interpreter()) == 2


def kernel(x_ref, o_ref, recv, send_sem, recv_sem):
    me = lax.axis_index("x")
    peer = 1 - me
    barrier = pltpu.get_barrier_semaphore()
    pl.semaphore_signal(barrier, 1, device_id=(peer,))
    pl.semaphore_wait(barrier, 1)
    copy = pltpu.make_async_remote_copy(x_ref, recv, send_sem, recv_sem, device_id=(peer,))
    copy.start()
    o_ref[...] = recv[...]          # the bug: read before wait_recv
    copy.wait_send()
    copy.wait_recv()


call = pl.pallas_call(
    kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32),
    in_specs=[pl.BlockSpec(memory_space=pltpu.VMEM)],
    out_specs=pl.BlockSpec(memory_space=pltpu.VMEM),
    scratch_shapes=[pltpu.VMEM((8, 128), jnp.float32), pltpu.SemaphoreType.DMA(()),
                    pltpu.SemaphoreType.DMA(())],
    compiler_params=pltpu.CompilerParams(collective_id=0),
    interpret=pltpu.InterpretParams(detect_races=True, vector_clock_size=64, on_race="warn"))
mesh = Mesh(np.array(jax.devices()[:2]), ("x",))
f = jax.jit(jax.shard_map(call, mesh=mesh, in_specs=P("x"), out_specs=P("x"), check_vma=False))
f(jnp.ones((16, 128), jnp.float32)).block_until_ready()
print(f"RACES={bool(ipc.races.races_found)}")
