"""`--prefill reference` (mkc.serve.prefill): the family reference's rounding emulation jitted
whole is bit-equal to its eager run (which the interpret tests hold bit-equal to the kernel),
from a zeroed cache over a prompt and from a full one across a KV tile boundary; its state
comes out in the kernel's layout. The server test (test_serve_server.py, extended tier) serves
greedy completions with it equal to the reference's."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkc.numerics import pin_cpu_isa

pin_cpu_isa()       # the same vector routines as the kernel's (mkc.numerics)


def test_refused_beside_a_kernel_on_an_accelerator(monkeypatch):
    from mkc.serve.prefill import ReferencePrefill
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    with pytest.raises(ValueError, match="runs where the kernel runs in interpret mode"):
        ReferencePrefill(None, None, None)


@pytest.mark.slow
def test_jitted_reference_equals_its_eager_emulation():
    from serve_process import MODEL, SPEC

    from mkc import compiler, numerics
    from mkc.serve.model import import_generated
    from mkc.serve.prefill import ReferencePrefill
    c = compiler.compile_spec(SPEC, MODEL)
    gen = import_generated(c.module_source, compiler.module_name(c))
    prefill = ReferencePrefill(gen, gen.random_weights(0), numerics.rounding_from_ir(c.ir))
    ref, cfg, params, rounding = prefill.reference, prefill.cfg, prefill.params, prefill.rounding

    def eager(cache, tokens, first):
        for i, t in enumerate(tokens):
            logits, cache = ref.decode_step(params, cfg, cache, jnp.array([t], jnp.int32),
                                            jnp.array([first + i], jnp.int32), rounding)
        return logits, cache

    def jitted(cache, tokens, first):
        for i, t in enumerate(tokens):
            logits, cache = prefill._step(params, cfg, cache, jnp.array([t], jnp.int32),
                                          jnp.array([first + i], jnp.int32), rounding)
        return logits, cache

    def assert_equal(a, b):
        assert a.keys() == b.keys()
        for n in a:
            np.testing.assert_array_equal(np.asarray(a[n], np.float32), np.asarray(b[n], np.float32), n)

    prompt = [5, 17, 99]
    assert_equal(prefill.cache(prompt), eager(prefill._zero, prompt, 0)[1])
    # from a cache full of values, rows 126..129: the attention's tiles of 128 tokens, 1 then 2
    rng = np.random.default_rng(0)
    full = {n: jnp.asarray(rng.normal(0, 0.5, a.shape), a.dtype) for n, a in prefill._zero.items()}
    (le, ce), (lj, cj) = eager(full, [7, 8, 9, 10], 126), jitted(full, [7, 8, 9, 10], 126)
    np.testing.assert_array_equal(np.asarray(le), np.asarray(lj))
    assert_equal(ce, cj)
    state = prefill(prompt)
    assert {n: a.shape for n, a in state.items()} == {
        n: (gen.RANKS, *shape) for n, (shape, _) in gen.state_shapes(1).items()}
