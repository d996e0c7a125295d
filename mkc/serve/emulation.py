"""`mkc serve --backend emulation`: the decode step as the kernel's rounding emulation under `jit`
(the family reference in its rounding mode, `mkc.numerics.rounding_from_ir`), for a CPU host
where the kernel itself runs in Pallas' interpret mode at seconds a step.

The emulation rounds and sums where the kernel does; the interpret tests hold it bit-equal to
the kernel step by step (tests/families/*/test_*_interpret.py), and
tests/serve/test_serve_emulation.py holds this backend's tokens equal to the interpret kernel's.
It is a step provider of `mkc.serve.device.Device`, which runs every launch as it does for the
kernel: the state it holds is the reference's (its upstream layouts, unsharded on JAX's
default device), so the kernel's per-row state layout never has to be converted a step; a row
state written from the host (`--prefill reference`) is converted once, on the way in.

It has no verify step: the kernel's verify launch multiplies its R rows in one dot, which XLA's
CPU sums otherwise than a chain of decode steps' dots (examples/generated_module.py's
`emulated_step` emulates it with R copies of a row; not built here), so `--prefill verify` and
`--speculative` are refused with it and `--prefill auto` feeds prompts through the decode step.

For a family where it is measured exact (`HELD_FAMILIES`), each weight enters the program as
its `[in, out]` buffer (`mkc.reference.rounding.held_in_out`): no host callback per weight per
step, about three times faster on SmolLM2-135M. Elsewhere the dots take each weight through the
host as the interpret tests' emulation does.

Routed experts in a four-bit format (int4, NVFP4) are packed into their slots on the host from
the checkpoint's bytes, as the kernel's packing fills them (`mkc.layers.moe.weights.nvfp4_slot`),
so they cannot be arguments of a jitted step; with them as its constants, Muse Spark's NVFP4
MINI measured off the eager emulation from its second step (49 % of the logits, by up to 4e-3:
the fused reductions sum in another order and a bf16 rounding moves). So where the rounding
holds one (`host_packed`) the step runs eagerly: the emulation the interpret tests hold bit-equal
to the kernel, about 2 s a step on that MINI.
"""
from __future__ import annotations

import importlib
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers.expert_formats import FOUR_BIT
from mkc.reference import rounding as rmod

NAME = "emulation"


# The families whose emulation is measured bit-equal with held weights to the emulation with a
# host callback per weight (and so to the kernel: tests/serve/test_serve_emulation.py): Llama
# (its MINI, SmolLM2-135M). Qwen3.5's MINI is not (a logit of step 1 moves 6e-3, step 0 equal;
# the cause is not found: holding a weight transposed changes the layout every op reading it
# sees, and only `in_out`'s dots are known to read it as the callback's result). The others are
# unmeasured, so they take the callback.
HELD_FAMILIES = ("mkc.families.llama",)


def _held(gen: Any, rounding: Any, cfg: Any) -> bool:
    """Whether the emulation takes its weights held (`held_in_out`): a family of HELD_FAMILIES
    whose matrices are plain (no stored codes, weight formats or FP8 blocks)."""
    return (gen.HOST.hf_layout.__package__ in HELD_FAMILIES and not rounding.codes
            and not rounding.formats and not getattr(cfg, "weight_block_size", ()))


def host_packed(rounding: Any) -> bool:
    """Whether the reference packs some weights on the host (routed experts in a four-bit
    format, in any layer kind): then the step runs eagerly (module docstring)."""
    formats = [f for _, f in rounding.formats]
    formats += [f for _, own in rounding.kind_formats for _, f in own]
    return any(f.name in FOUR_BIT for f in formats)


class EmulationSteps:
    """The decode step at `batch` rows as the kernel's rounding emulation, jitted (or eager:
    `host_packed`), on the reference's state layout. `gen`: the generated module; `hf`: its HF-named weights;
    `rounding`: `numerics.rounding_from_ir` of the schedule it was compiled from. Raises
    ValueError off a CPU host."""

    name = NAME
    verify_rows = 0                  # no verify step (module docstring)

    def __init__(self, gen: Any, hf: Any, rounding: Any, batch: int):
        if jax.default_backend() != "cpu":
            raise ValueError(
                f"--backend emulation runs the family's reference on one {jax.default_backend()} "
                "device, unsharded, emulating a TPU kernel's rounding on a CPU's arithmetic: it "
                "serves a CPU host; serve the kernel itself on an accelerator (--backend kernel)")
        self.gen, self.rounding, self.batch = gen, rounding, batch
        self.reference = importlib.import_module(f"{gen.HOST.hf_layout.__package__}.reference")
        self.cfg = self.reference.load_config(dict(gen.HF_CONFIG))
        one = gen.reference_states(gen.init_state(1))       # the kernel's slot counts
        dtypes = {n: a.dtype for n, a in self.reference.init_cache(self.cfg, 1, 1).items()}
        self.dtypes = {n: dtypes[n] for n in one}
        self.seq_axes = _sequence_axes(self.reference, self.cfg, tuple(one))
        self.shapes = {}
        for n, axis in self.seq_axes:
            shape = list(np.shape(one[n]))
            shape[axis] = batch
            self.shapes[n] = tuple(shape)
        self.clear_axes = _row_states(gen, dict(self.seq_axes))
        matrices, _ = gen.requantized_weights(hf)
        self.held = _held(gen, rounding, self.cfg)
        if self.held:
            self.weights = {n: jax.device_put(np.ascontiguousarray(np.asarray(w).T) if np.ndim(w) == 2
                                              else np.asarray(w)) for n, w in matrices.items()}
        else:
            self.weights = {n: jax.device_put(np.asarray(w)) for n, w in matrices.items()}
        self.eager = host_packed(rounding)
        self._step = self._decode if self.eager else jax.jit(self._decode, donate_argnums=(1,))

    def _decode(self, weights: dict, state: dict, tokens: jax.Array, positions: jax.Array
                ) -> tuple[jax.Array, dict]:
        if not self.held:
            return self.reference.decode_step(weights, self.cfg, state, tokens, positions, self.rounding)
        params = {n: (w.T if w.ndim == 2 else w) for n, w in weights.items()}
        with rmod.held_in_out():
            return self.reference.decode_step(params, self.cfg, state, tokens, positions, self.rounding)

    def zero_state(self) -> dict[str, jax.Array]:
        return {n: jnp.zeros(self.shapes[n], self.dtypes[n]) for n in self.shapes}

    def decode(self, state: dict, tokens: np.ndarray, positions: np.ndarray) -> tuple[jax.Array, dict]:
        """One decode step of every row: (logits [B, vocab] f32, the new state)."""
        return self._step(self.weights, state, jnp.asarray(tokens, jnp.int32),
                          jnp.asarray(positions, jnp.int32))

    def own_state(self, state: dict) -> dict[str, jax.Array]:
        """One sequence's state in the kernel's layout (leading rank axis) in this layout."""
        ref = self.gen.reference_states(state)
        return {n: jnp.asarray(np.asarray(ref[n]), self.dtypes[n]) for n in self.shapes}


def _sequence_axes(reference: Any, cfg: Any, names: tuple[str, ...]) -> tuple[tuple[str, int], ...]:
    """Each reference state's sequence axis: where its shapes at 1 and 2 sequences differ."""
    one = jax.eval_shape(lambda: reference.init_cache(cfg, 1, 1))
    two = jax.eval_shape(lambda: reference.init_cache(cfg, 2, 1))
    return tuple((n, next(i for i, (x, y) in enumerate(zip(one[n].shape, two[n].shape)) if x != y))
                 for n in names)


def _row_states(gen: Any, axes: dict[str, int]) -> tuple[tuple[str, int], ...]:
    """The reference states a new request's row must have zeroed (recurrent, conv; not KV
    caches), with their sequence axis: those the kernel's per-row states map to, found by
    converting a kernel state that is nonzero in exactly those."""
    from mkc.serve.device import row_states_of
    kernel = dict(gen.ROW_STATES) if hasattr(gen, "ROW_STATES") else dict(row_states_of(gen))
    probe = {n: (np.ones_like(a) if n in kernel else a) for n, a in gen.init_state(1).items()}
    ref = gen.reference_states(probe)
    return tuple((n, axes[n]) for n in axes if np.any(np.asarray(ref[n]) != 0))
