"""Gated norm-preserving residuals (`mkc.layers.gated_residuals`, Muse Spark's) and the soft-capped
logits hook (`mkc.layers.decoder.lowering.softcapped_logits`): each kernel body, run in a Pallas
TPU kernel in interpret mode, is the reference's rounding emulation of it bit for bit, and within
f32 rounding (TOL) of an independent numpy of upstream's formulas (transformers 5.25
`MuseSparkTextCenteredRMSNorm`, `MuseSparkRMSNorm(with_scale=False)`,
`MuseSparkTextInputScaledRMSNorm`, `MuseSparkResidualGate`, `MuseSparkTextNormedEmbedding`, and
`MuseSparkForConditionalGeneration`'s logits); the f32 oracle is that numpy to TOL too. Some gate
channels sit past the floor of alpha (u > 7.6) so that the clamp acts.

A 1.01 scale of any term of a body (`MUTANTS`, each applied to the lowering's source) moves its
result from the numpy by over 10 TOL. Measured once against upstream's torch modules in f32
(not in this suite: no torch here), the f32 oracle's pieces agreed to the largest relative error
the task report gives.
"""
from __future__ import annotations

import dataclasses
import importlib
import types

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from layer_bodies import Buffer, StandIn, bf16, draw_params, gap, kernel_states, layer_params, mutated_module
from mkc.layers import reference as layer_reference
from mkc.layers.decoder import lowering as decoder_lowering
from mkc.layers.gated_residuals import GatedAdd, GatedPre
from mkc.layers.gated_residuals import lowering
from mkc.layers.gated_residuals import reference as gated_reference
from mkc.layers.gqa import GQA, GQADims
from mkc.layers.swiglu import SwiGLU
from mkc.reference.rounding import Rounding

TOL = 2e-6
B, H, VOCAB = 2, 256, 384
EMULATION = Rounding(ranks=1, reduces=())


@dataclasses.dataclass(frozen=True)
class Dims:
    """What the gated residuals and the logits hook read of Muse Spark's dims."""

    hidden_size: int = H
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    residual_gate_temperature: float = 0.3
    vocab_size: int = VOCAB
    vocab_used: int = VOCAB - 37
    final_logit_softcapping: float = 20.0
    output_multiplier: float = 0.17677669529663687


D = Dims()
RNG = np.random.default_rng(11)
X = RNG.normal(0, 3, (B, H)).astype(np.float32)            # the stream
Y = RNG.normal(0, 0.7, (B, H)).astype(np.float32)          # a kind's output
W = RNG.normal(0, 0.3, (1, H)).astype(np.float32)          # a zero-centred norm's weight
GATE = RNG.normal(0, 0.3, (1, H)).astype(np.float32)
GATE[0, :8] = 3.0                                          # alpha at its floor: sqrt(1e-3)
LOGITS = RNG.normal(0, 60, (B, VOCAB)).astype(np.float32)


# ---- upstream's formulas in numpy (f64, the bf16 rounding where upstream's bf16 model rounds)
def _rms(x: np.ndarray, eps: float) -> np.ndarray:
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)


def np_centred(x, w, eps=D.rms_norm_eps):
    return _rms(x, eps) * (1.0 + np.asarray(w, np.float64))


def np_input_scaled(y, w, eps=D.post_norm_eps):
    t = (np.float32(1.0) + w) * y                          # x.float() * (1 + w).float(), in f32
    return _rms(t.astype(ml_dtypes.bfloat16).astype(np.float32), eps)


def np_gate(residual, hidden, gate, temperature=D.residual_gate_temperature):
    u = np.asarray(gate, np.float64) / temperature
    beta = 1.0 / (1.0 + np.exp(-u))
    alpha = np.sqrt(np.maximum(1.0 / (1.0 + np.exp(u)) * (1.0 + beta), 1e-3))
    return alpha * residual + beta * hidden


def np_softcap(logits, d=D):
    cap = d.final_logit_softcapping
    capped = cap * np.tanh(np.asarray(logits, np.float64) * d.output_multiplier / cap)
    return np.where(np.arange(logits.shape[-1]) < d.vocab_used, capped, -np.inf)


NUMPY = {"attn": lambda: np_gate(X, _rms(Y, D.post_norm_eps), GATE),
         "mlp": lambda: np_gate(X, np_input_scaled(Y, W), GATE)}


# ---- the bodies on a stand-in layer
def _layer(x_ref, vectors):
    return types.SimpleNamespace(dims=D, refs=types.SimpleNamespace(x=x_ref),
                                 vector=lambda name: vectors[name])


def _add_body(module, place: str):
    """The add body of `place` on (x, y, gate, w) -> the stream after it."""
    s = GatedAdd(place, ("attn_out",))

    def run(x_ref, y, gate, w):
        body = getattr(module, "attn_residual" if place == "attn" else "mlp_residual")
        body(s, _layer(x_ref, {"attn_gate": gate, "mlp_gate": gate, "post_ffn_norm": w}), y)
    return run


def _pre_body(module, place: str):
    s = GatedPre(place)

    def run(x_ref, w):
        body = getattr(module, "input_norm" if place == "attn" else "pre_ffn_norm")
        return body(s, _layer(x_ref, {"input_norm": w, "pre_ffn_norm": w}))
    return run


def _kernel(fn, args: list, out_shape: tuple[int, ...]) -> jax.Array:
    """`fn(out_ref, *values)` in a Pallas TPU kernel in interpret mode, `out_ref` holding the
    first input when it starts; its result (if any) is the output."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)

    def body(*refs):
        out = refs[-1]
        out[...] = refs[0][...]
        result = fn(out, *[r[...] for r in refs[:-1]])
        if result is not None:
            out[...] = result
    return pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(out_shape, jnp.float32),
                          in_specs=[vmem] * len(args), out_specs=vmem,
                          interpret=pltpu.InterpretParams())(*args)


def _add_in_kernel(place: str) -> np.ndarray:
    run = _add_body(lowering, place)
    return np.asarray(_kernel(lambda out, x, y, gate, w: run(out, y, gate, w), [X, Y, GATE, W], X.shape))


@pytest.mark.parametrize("place", ["attn", "mlp"])
def test_the_add_body_in_a_kernel_is_its_emulation_and_upstream_s_formula(place):
    got = _add_in_kernel(place)
    w = W if place == "mlp" else None
    want = gated_reference.update(jnp.asarray(X), jnp.asarray(Y), jnp.asarray(GATE[0]),
                                  None if w is None else jnp.asarray(w[0]), D, EMULATION)
    np.testing.assert_array_equal(got, np.asarray(want))
    assert gap(got, NUMPY[place]()) < TOL
    oracle = gated_reference.update(jnp.asarray(X), jnp.asarray(Y), jnp.asarray(GATE[0]),
                                    None if w is None else jnp.asarray(w[0]), D, None)
    if place == "attn":       # no bf16 rounding in it: the oracle is the emulation's math
        assert gap(oracle, NUMPY[place]()) < TOL
    else:                     # the oracle does not round the scaled value (upstream in f32)
        unrounded = np_gate(X, _rms((1.0 + W.astype(np.float64)) * Y, D.post_norm_eps), GATE)
        assert gap(oracle, unrounded) < TOL


@pytest.mark.parametrize("place", ["attn", "mlp"])
def test_the_pre_norm_in_a_kernel_is_the_reference_s_and_upstream_s(place):
    got = np.asarray(_kernel(lambda out, x, w: _pre_body(lowering, place)(out, w), [X, W], X.shape))
    stream = gated_reference.GatedStream(jnp.asarray(X))
    norm = gated_reference.PRE_NORM_WEIGHTS[place]
    want = gated_reference.forward(GatedPre(place), {norm: jnp.asarray(W[0])}, D, stream, {}, 0,
                                   jnp.zeros(B, jnp.int32), EMULATION, "kind").h
    np.testing.assert_array_equal(got, np.asarray(want))
    assert gap(got, np_centred(X, W)) < TOL


def test_the_prologue_in_a_kernel_is_the_reference_s_start():
    def run(out, x):
        lowering.prologue(types.SimpleNamespace(dims=D, refs=types.SimpleNamespace(x=out)))
    got = np.asarray(_kernel(run, [X], X.shape))
    np.testing.assert_array_equal(got, np.asarray(gated_reference.GATED_RESIDUALS.start(jnp.asarray(X), D).x))
    assert gap(got, _rms(X, D.rms_norm_eps)) < TOL


def _softcapped(module, logits: np.ndarray, interpret: bool) -> np.ndarray:
    """`final_logits` of one rank's vocabulary part (one way), under a one-device mesh; in a
    Pallas kernel in interpret mode or as it is."""
    k = types.SimpleNamespace(dims=D, axis="tp", per_rank={"vocab": VOCAB})

    def fn(lg):
        if interpret:
            return _kernel(lambda out, x: module.softcapped_logits(k, x, (1, 1)), [lg], lg.shape)
        return module.softcapped_logits(k, lg, (1, 1))
    mesh = jax.make_mesh((1,), ("tp",))
    return np.asarray(jax.shard_map(fn, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False)(logits))


def test_the_soft_capped_logits_in_a_kernel_are_the_reference_s_and_upstream_s():
    got = _softcapped(decoder_lowering, LOGITS, interpret=True)
    want = layer_reference.softcap_logits(jnp.asarray(LOGITS), cap=D.final_logit_softcapping,
                                          multiplier=D.output_multiplier, used=D.vocab_used)
    np.testing.assert_array_equal(got, np.asarray(want))
    assert np.all(np.isneginf(got[:, D.vocab_used:])) and np.all(np.isfinite(got[:, :D.vocab_used]))
    used = slice(0, D.vocab_used)
    assert gap(got[:, used], np_softcap(LOGITS)[:, used]) < TOL
    assert np.all(np.abs(got[:, used]) <= D.final_logit_softcapping)


def test_the_reference_draws_gates_where_alpha_and_beta_both_act():
    rng = np.random.default_rng(0)
    gate = gated_reference.init_weight(GatedAdd("mlp"), "model.layers.0.post_feedforward_residual_gate.gate",
                                       (4096,), rng, 1.0)
    u = gate / D.residual_gate_temperature
    beta = 1 / (1 + np.exp(-u))
    alpha = np.sqrt(np.maximum((1 - beta) * (1 + beta), 1e-3))
    assert 0.2 < beta.mean() < 0.8 and beta.std() > 0.1
    assert 0.6 < alpha.mean() < 0.95 and alpha.std() > 0.05
    shapes = gated_reference.param_shapes(GatedAdd("mlp"), D, "p.")
    assert shapes == {"p.post_feedforward_layernorm.weight": ((H,), "bfloat16"),
                      "p.post_feedforward_residual_gate.gate": ((H,), "float32")}


# ---- mutants: (body, source, mutant); each must move the body's result by over 10 TOL
LOWERING, DECODER = "mkc.layers.gated_residuals.lowering", "mkc.layers.decoder.lowering"
MUTANTS = {
    "temperature": ("attn", LOWERING, "    u = gate / temperature\n",
                    "    u = gate / (1.01 * temperature)\n"),
    "beta": ("attn", LOWERING, "beta = jax.nn.sigmoid(u)", "beta = 1.01 * jax.nn.sigmoid(u)"),
    "alpha's sigmoid": ("attn", LOWERING, "jax.nn.sigmoid(-u) * (1.0 + beta)",
                        "1.01 * jax.nn.sigmoid(-u) * (1.0 + beta)"),
    "alpha's floor": ("attn", LOWERING, "RESIDUAL_GATE_EPS))", "1.01 * RESIDUAL_GATE_EPS))"),
    "the residual's weight": ("mlp", LOWERING, "return alpha * x + beta * normed",
                              "return alpha * x * 1.01 + beta * normed"),
    "the weightless post norm": ("attn", LOWERING, "normed = ops.rms_norm_weightless(",
                                 "normed = 1.01 * ops.rms_norm_weightless("),
    "the input scale's weight": ("mlp", LOWERING, "t = (y * (1.0 + w))", "t = (y * (1.0 + 1.01 * w))"),
    "the input-scaled norm": ("mlp", LOWERING, "return ops.rms_norm_weightless(t, eps)",
                              "return 1.01 * ops.rms_norm_weightless(t, eps)"),
    "the pre-norm's weight": ("pre", LOWERING, "c.vector(PRE_NORMS[s.place])",
                              "1.01 * c.vector(PRE_NORMS[s.place])"),
    "the embedding norm": ("prologue", LOWERING, "k.refs.x[...] = ops.rms_norm_weightless(",
                           "k.refs.x[...] = 1.01 * ops.rms_norm_weightless("),
    "the logits' multiplier": ("logits", DECODER, "(logits * d.output_multiplier)",
                               "(logits * d.output_multiplier * 1.01)"),
    "the cap": ("logits", DECODER, "/ cap) * cap", "/ cap) * cap * 1.01"),
    "the used vocabulary": ("logits", DECODER, "ids < getattr(", "ids <= getattr("),
}


def _result(module: types.ModuleType, case: str) -> tuple[np.ndarray, np.ndarray]:
    """(the body's result with `module` as the lowering, the numpy's)."""
    if case in ("attn", "mlp"):
        x = Buffer(X)
        _add_body(module, case)(x, jnp.asarray(Y), jnp.asarray(GATE), jnp.asarray(W))
        return np.asarray(x.value), NUMPY[case]()
    if case == "pre":
        return np.asarray(_pre_body(module, "attn")(Buffer(X), jnp.asarray(W))), np_centred(X, W)
    if case == "prologue":
        x = Buffer(X)
        module.prologue(types.SimpleNamespace(dims=D, refs=types.SimpleNamespace(x=x)))
        return np.asarray(x.value), _rms(X, D.rms_norm_eps)
    got = _softcapped(module, LOGITS, interpret=False)
    want = np_softcap(LOGITS)
    return np.where(np.isinf(want), np.where(np.isinf(got), 0, 1e3), got), np.where(np.isinf(want), 0, want)


@pytest.mark.parametrize("case", ["attn", "mlp", "pre", "prologue", "logits"])
def test_the_unmutated_bodies_are_upstream_s_formulas(case):
    real = importlib.import_module(DECODER if case == "logits" else LOWERING)
    got, want = _result(real, case)
    assert gap(got, want) < TOL


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_one_percent_mutant_of_a_body_fails(mutant):
    case, module, old, new = MUTANTS[mutant]
    got, want = _result(mutated_module(module, old, new), case)
    assert gap(got, want) > 10 * TOL, mutant


# ---- a composed layer: the bodies of every sublayer in order against the reference's forwards
@dataclasses.dataclass(frozen=True)
class ComposedDims(GQADims):
    """Muse Spark's attention and residual dims, its heads fewer, with a dense MLP."""

    sliding_window: int
    qk_scale_factor: float
    intermediate_size: int
    post_norm_eps: float
    residual_gate_temperature: float


COMPOSED = ComposedDims(
    family="toy", name="toy", hidden_size=128, num_hidden_layers=1, vocab_size=256, rms_norm_eps=1e-5,
    layer_kinds=("kind",), num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=64,
    rope_theta=5e5, sliding_window=16, qk_scale_factor=5.4730064863875, intermediate_size=256,
    post_norm_eps=1e-8, residual_gate_temperature=0.3)
LAYER = (GatedPre("attn"), GQA(norm="zero_centred", qk_norm="weightless", output_gate="rms_gate_proj",
                               residual=False),
         GatedAdd("attn", ("attn_out",)), GatedPre("mlp"), SwiGLU(residual=False),
         GatedAdd("mlp", ("mlp_out",)))
CONTEXT, TILE, POSITIONS = 24, 8, np.array([21, 13])


def test_a_composed_layer_s_bodies_are_its_reference():
    """GatedPre, GQA(residual=False), GatedAdd, then GatedPre, SwiGLU(residual=False), GatedAdd,
    their bodies run in program order on one stream (dots in f32): the stream after the layer
    is the reference's (`GatedStream` through each sublayer's `forward`, the gated updates
    rounding the input-scaled value to bf16 as the kernel does) to f32 rounding."""
    d = COMPOSED
    hf: dict[str, np.ndarray] = {}
    for i, sub in enumerate(LAYER):
        hf |= draw_params(sub, d, seed=i)
    rng = np.random.default_rng(9)
    x = rng.normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    shape = (B, d.num_key_value_heads, CONTEXT, d.head_dim)
    cache_in = {f"layers.0.{n}_cache": jnp.asarray(bf16(rng.normal(0, 1, shape)), jnp.bfloat16)
                for n in ("key", "value")}

    def forward(x, cache):
        cache, stream = dict(cache), gated_reference.GatedStream(x)
        for sub in LAYER:
            rounding = EMULATION if isinstance(sub, GatedAdd) else None   # the kernel's bf16 t
            stream = sub.module("reference").forward(sub, layer_params(hf), d, stream, cache, 0,
                                                     jnp.asarray(POSITIONS, jnp.int32), rounding, "kind")
        return stream.x
    want = np.asarray(jax.jit(forward)(jnp.asarray(x), cache_in))
    stream, values = Buffer(x), {}
    for sub in LAYER:
        c = StandIn(sub, d, hf, x, POSITIONS, tile=TILE)
        if isinstance(sub, GQA):
            c.caches = StandIn(sub, d, hf, x, POSITIONS, kernel_states(sub, d, c.part, cache_in, B),
                               tile=TILE).caches
        c.refs.x = stream
        not_values, bodies = set(c.part.tensors) | {"x"}, sub.bodies()
        for op in c.part.ops:
            out = bodies[op.name](c, *[values[n] for n in op.reads if n not in not_values])
            writes = [n for n in op.writes if n not in not_values]
            values |= dict(zip(writes, out)) if len(writes) > 1 else dict.fromkeys(writes, out)
    assert gap(np.asarray(stream.value) - x, want - x) < 2e-4


def test_a_masked_logit_is_no_error_of_the_numerics():
    """-inf on both sides (a padded id) compares as equal; a logit masked on one side only does not."""
    from mkc import numerics
    ref = np.array([[1.5, -2.0, -np.inf]], np.float32)
    ours = np.array([[1.0, -2.0, -np.inf]], np.float32)
    assert numerics.logits_error(ours, ref) == pytest.approx(0.5 / 2.0)
    assert numerics.logits_frob(ref, ref) == 0.0
    one_sided = np.array([[1.5, -2.0, 0.0]], np.float32)
    assert numerics.logits_error(one_sided, ref) == np.inf and numerics.logits_frob(one_sided, ref) == np.inf
