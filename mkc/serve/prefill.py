"""Prefill through the family's reference under `jit` (`mkc serve --prefill reference`).

A prompt's tokens but the last run through the family reference's decode step, one token a
call from a zeroed cache, in its rounding-emulating mode (`mkc.numerics.rounding_from_ir`:
rounding and summing where the kernel does) on the weights as the kernel holds them
(`requantized_weights`); the cache is then written in the kernel's layout
(`Host.kernel_state`, the inverse of `reference_states`) into the request's row, and the next
decode step feeds the last prompt token. On a CPU host the emulation is bit-equal to the
kernel, so the row's state is the one the kernel's own prefill would have left.

It runs only where the kernel runs in interpret mode: the reference holds the whole model
unsharded on one device and computes in f32, which a full-size model does not fit, and its
emulation hands every weight to the host a token (`mkc.reference.rounding.in_out`: the
layout XLA's CPU dot needs to sum as the kernel does), which on an accelerator would move the
model over PCIe per prompt token.
"""
from __future__ import annotations

import importlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.serve.emulation import host_packed


class ReferencePrefill:
    """prompt tokens -> the kernel's decode state of one sequence after them (numpy, leading
    rank axis), computed by the family reference's jitted decode step.

    `gen`: the generated module; `hf`: its HF-named weights (a checkpoint's or random);
    `rounding`: `numerics.rounding_from_ir` of the schedule it was compiled from. Raises
    ValueError where it cannot run (module docstring; a family whose weights module cannot
    write the kernel's states)."""

    def __init__(self, gen: Any, hf: Any, rounding: Any):
        if jax.default_backend() != "cpu":
            raise ValueError(
                f"--prefill reference runs the family's reference on one {jax.default_backend()} "
                "device, unsharded in f32, with every weight through the host a token (its "
                "rounding emulation): it runs where the kernel runs in interpret mode (a CPU "
                "host), not beside a kernel on its accelerator")
        host = gen.HOST
        self.gen, self.rounding, self.context = gen, rounding, gen.CONTEXT
        self.reference = importlib.import_module(f"{host.hf_layout.__package__}.reference")
        self.cfg = self.reference.load_config(dict(gen.HF_CONFIG))
        zero = gen.reference_states(gen.init_state(1))
        host.kernel_state(zero, 1)           # a family that cannot write them refuses here
        dtypes = {n: a.dtype for n, a in self.reference.init_cache(self.cfg, 1, 1).items()}
        # the kernel's slot counts (a sliding window's KV ring), in the reference's dtypes
        self._zero = {n: jnp.zeros(np.shape(a), dtypes[n]) for n, a in zero.items()}
        held, _ = gen.requantized_weights(hf)
        self.params = {n: jax.device_put(np.asarray(w)) for n, w in held.items()}
        # eagerly where some weights are packed on the host (`mkc.serve.emulation.host_packed`)
        self._step = (self.reference.decode_step if host_packed(rounding)
                      else jax.jit(self.reference.decode_step, static_argnums=(1, 5)))
        self.seconds = 0.0
        self.tokens = 0

    def cache(self, tokens: list[int]) -> dict[str, jax.Array]:
        """The reference's cache after `tokens` at positions 0... (its own layouts)."""
        if len(tokens) > self.context:
            raise ValueError(f"{len(tokens)} tokens pass the context of {self.context}")
        cache = self._zero
        for position, token in enumerate(tokens):
            _, cache = self._step(self.params, self.cfg, cache, jnp.array([token], jnp.int32),
                                  jnp.array([position], jnp.int32), self.rounding)
        return cache

    def __call__(self, tokens: list[int]) -> dict[str, np.ndarray]:
        t0 = time.perf_counter()
        state = self.gen.HOST.kernel_state(jax.device_get(self.cache(tokens)), 1)
        self.seconds += time.perf_counter() - t0
        self.tokens += len(tokens)
        return state
