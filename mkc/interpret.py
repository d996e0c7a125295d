"""Host-side speed of TPU interpret mode, for the runners and tests that run generated kernels
on CPU.

Interpret mode turns every ref access, DMA and semaphore operation of a kernel into a JAX
`io_callback` (a K3 MINI step: about 43,000 over 16 devices, from 16 threads). Measured on a
K3 MINI step (`examples/run_k3_mini.py --steps 1 --batch 2`), two costs dominate, neither of
them the kernel's work:
- JAX's `io_callback` puts every argument on the CPU device as a `jax.Array` (one dispatch
  each), which the interpreter's callbacks turn straight back into numpy values and ints: two
  thirds of the step (107 s of kernel time, 38 s without);
- every callback first takes the interpreter's one shared lock to see whether another device
  failed (`check_failed`), so 16 threads queue on it: a quarter of what is left.
`lean_interpreter` removes both: callbacks get copies of the host arrays, and the failure flag
(set once, under the lock) is read without the lock until it is set. What the kernel computes
is unchanged: the emulation comparisons, which are exact, pass with it, and
`tests/test_interpret.py` runs a kernel both ways and compares the bytes.
"""
from __future__ import annotations

import inspect

import numpy as np


def _lean_io_callback_impl() -> bool:
    from jax._src import callback, config, mesh as mesh_lib, sharding_impls, tree_util
    from jax._src import xla_bridge as xb

    original = callback.io_callback_impl
    if getattr(original, "_mkc_lean", False):
        return True
    keywords = {n for n, p in inspect.signature(original).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY}
    # only the function this was written from (jax 0.12); another is left alone
    if keywords != {"callback", "result_avals", "sharding", "ordered"} or \
            "api.device_put(args, cpu_device)" not in inspect.getsource(original):
        return False

    def io_callback_impl(*args, callback, result_avals, sharding, ordered):
        del result_avals, sharding, ordered
        # copies, as device_put made: the host buffers are XLA's, valid only during the call,
        # and the interpreter may keep what it is given (a buffer's initial value)
        args = tuple(np.array(a) for a in args)
        cpu_device, *_ = xb.local_devices(backend="cpu")
        # the same context as JAX's own: the callback may run on a dispatching thread
        with (config.default_device(cpu_device),
              sharding_impls._internal_use_concrete_mesh(mesh_lib.empty_concrete_mesh),
              mesh_lib.use_abstract_mesh(mesh_lib.empty_abstract_mesh)):
            return tree_util.tree_map(np.asarray, callback(*args))

    io_callback_impl._mkc_lean = True
    callback.io_callback_impl = io_callback_impl
    return True


def _lean_check_failed() -> bool:
    from jax._src.pallas.mosaic.interpret.shared_memory import GenericSharedMemory

    original = GenericSharedMemory.check_failed
    if getattr(original, "_mkc_lean", False):
        return True
    source = inspect.getsource(original)
    if "with self.lock:" not in source or "if self._failure is not None:" not in source:
        return False

    def check_failed(self) -> None:
        # `_failure` goes from None to an exception once, under the lock: reading None without
        # it is as good as with it (a failure set just after is caught by the next callback
        # either way); once set, JAX's own function raises
        if self._failure is not None:
            original(self)

    check_failed._mkc_lean = True
    GenericSharedMemory.check_failed = check_failed
    return True


def lean_interpreter() -> list[str]:
    """Make TPU interpret mode's host side lean (see the module docstring) in this process;
    returns what was replaced. A JAX whose functions are not the ones this was written for is
    left as it is (interpret mode then runs at JAX's own speed)."""
    made = []
    if _lean_io_callback_impl():
        made.append("jax._src.callback.io_callback_impl")
    if _lean_check_failed():
        made.append("GenericSharedMemory.check_failed")
    return made
