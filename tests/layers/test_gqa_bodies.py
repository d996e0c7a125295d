"""`GQA`'s lowered bodies (`mkc.layers.gqa.lowering`) against its f32 reference layer, every
variant the families compose: Llama's (llama3 rope), Qwen3-MoE's (plain q/k norms), Qwen3.5's
(zero-centred norms, output gate, a quarter of each head rotated), GPT-OSS's (biases, sinks,
YaRN's scaled table; full, and sliding over a ring of more slots than its window), Muse Spark's
(weightless q/k norms, `qk_scale_factor`, the RMS-normed output gated by `gate_proj`; sliding
and rotated, full and NoPE), and NoPE alone. Two rows at positions where rope turns every
pair, over a cache of random bf16 keys and values whose scores spread the softmax, norm
weights not one, sinks and biases large enough to take their share: the residual stream after
the layer and the new cache entries agree to f32 rounding (TOL), and a 1.01 scale of any term
of a body moves them by more (the table below, each mutant applied to the source and this
module run: every one failed it).

Mutants (lowering.py unless named), 1.01 times ...        caught by
  input_norm's weight (ops.pre_norm)                       every case
  qkv's bias / qkv_gate's product                          gpt_oss / qwen3_5
  the query rotation's sin term / cos term (ops.apply_rope) every case
  the key rotation (k_new's apply_rope)                    every case
  q_norm weight / k_norm weight (qk_norm_rope)             qwen3_moe, qwen3_5
  the rotary table's angle (rope.rope_table)               every case
  YaRN's attention factor on the table                     gpt_oss
  the softmax scale (attention's hd ** -0.5)               every case
  the value written to the cache (kv_write)                every case
  a sink's logit (_start)                                  gpt_oss
  the window (sliding_window + 1)                          gpt_oss_sliding
  the output gate's logit (out_gate)                       qwen3_5
  o_proj's bias / the residual's added product             gpt_oss / every case
  ops.rms_norm's / rms_norm_zero_centred's weight           plain / zero-centred cases
  the tile's running rescale / its probability sum          every case
Muse Spark's options are judged so by the test itself (`MUTANTS`: its weightless q/k norm, its
softmax scale, the output's norm and gate logit, gate_proj's columns 1.01 times, NoPE's heads
1.01 times or rotated: every one moves the layer by over 10 TOL); its new bodies, run in a
Pallas TPU kernel in interpret mode, are the reference's rounding emulation of them bit for bit,
and that emulation without bf16 is the f32 reference to f32 order (a 1.01 softmax scale or
output gate in it moves the layer by over 10 TOL, measured once).
The table's shared code the reference also runs (rope's llama3 and YaRN frequencies, YaRN's
factors) is judged against upstream's formulas by tests/families (llama's reference, GPT-OSS's
ops, DeepSeek-V3's config), the split parts' products by test_attention_tile.
"""
from __future__ import annotations

import dataclasses
import types
from functools import cache
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from layer_bodies import (StandIn, bf16, draw_params, gap, kernel_states, layer_params, mutated_module,
                          reference, run_bodies)
from mkc.families.gpt_oss import reference as gpt_oss
from mkc.families.llama import reference as llama
from mkc.families.qwen3_5 import reference as qwen3_5
from mkc.families.qwen3_moe import reference as qwen3_moe
from mkc.layers import rope
from mkc.layers.gqa import GQA, GQADims, lowering
from mkc.layers.gqa import reference as gqa_reference
from mkc.model.config import CONFIG_DIR
from mkc.reference.rounding import Reduce, Rounding

TOL = 2e-4
B, CONTEXT, TILE = 2, 24, 8
POSITIONS = np.array([21, 13])


def _dims(module, name: str, **changes):
    small = dict(hidden_size=128, num_attention_heads=4, num_key_value_heads=2)
    return dataclasses.replace(module.load_config(CONFIG_DIR / f"{name}.json"), **(small | changes))


@dataclasses.dataclass(frozen=True)
class MuseSparkDims(GQADims):
    """Muse Spark's attention dims (MODELS.md, `MuseSparkTextConfig`), its heads fewer."""

    sliding_window: int
    qk_scale_factor: float


def _muse_spark(**changes) -> MuseSparkDims:
    dims = dict(family="muse_spark", name="muse_spark_mini", hidden_size=128, num_hidden_layers=1,
                vocab_size=256, rms_norm_eps=1e-5, layer_kinds=("swa",), num_attention_heads=4,
                num_key_value_heads=2, head_dim=64, rotary_dim=64, rope_theta=5e5, sliding_window=16,
                qk_scale_factor=5.4730064863875)
    return MuseSparkDims(**(dims | changes))


MUSE_SPARK = GQA(norm="zero_centred", qk_norm="weightless", output_gate="rms_gate_proj")
CASES = {
    "llama": (GQA(), lambda: _dims(llama, "llama_mini")),
    "qwen3_moe": (GQA(qk_norm="plain"), lambda: _dims(qwen3_moe, "qwen3_moe_mini")),
    "qwen3_5": (GQA(norm="zero_centred", qk_norm="zero_centred", output_gate="q_proj"),
                lambda: _dims(qwen3_5, "qwen3_8_mini", head_dim=64, rotary_dim=16)),
    # Qwen2's attention: q/k/v biases, none on o_proj
    "qkv_bias_only": (GQA(bias=True), lambda: _dims(llama, "llama_mini")),
    "gpt_oss": (GQA(bias=True, o_bias=True, sinks=True), lambda: _dims(gpt_oss, "gpt_oss_mini")),
    "gpt_oss_sliding": (GQA(bias=True, o_bias=True, sinks=True, sliding=True),
                        lambda: _dims(gpt_oss, "gpt_oss_mini", sliding_window=16)),
    # Muse Spark's: rotated on its sliding layers, NoPE on its full ones
    "muse_spark_sliding": (dataclasses.replace(MUSE_SPARK, sliding=True), _muse_spark),
    "muse_spark_nope": (dataclasses.replace(MUSE_SPARK, rope=False), _muse_spark),
    # NoPE without a q/k norm: the heads as projected
    "nope": (GQA(rope=False), lambda: _dims(llama, "llama_mini")),
}


@cache
def _reference(case: str):
    """The case's dims, weights, input, caches before and the f32 reference layer's results."""
    sub, dims = CASES[case]
    d = dims()
    hf = draw_params(sub, d, seed=len(case))
    if sub.sinks:       # sinks near the scores' scale take a share of each head's softmax
        hf["model.layers.0.self_attn.sinks"] = np.array([2.0, -1.0, 3.0, 0.5], np.float32)
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    # a sliding kind's ring past its window (a verify step's), so the window and not the ring
    # bounds what a row sees
    slots = d.sliding_window + TILE if sub.sliding else CONTEXT
    shape = (B, d.num_key_value_heads, slots, d.head_dim)
    cache_in = {"layers.0.key_cache": jnp.asarray(bf16(rng.normal(0, 1, shape)), jnp.bfloat16),
                "layers.0.value_cache": jnp.asarray(bf16(rng.normal(0, 1, shape)), jnp.bfloat16)}
    want, cache_out = reference(sub, d, hf, x, POSITIONS, cache_in)
    return d, hf, x, slots, cache_in, want, cache_out


def _gaps(case: str) -> tuple[float, float]:
    """The lowered bodies run on the case: (the residual stream's gap to the reference's, the
    new cache entries' largest difference in bf16 ulps of the reference's)."""
    sub = CASES[case][0]
    d, hf, x, slots, cache_in, want, cache_out = _reference(case)
    c = StandIn(sub, d, hf, x, POSITIONS, tile=TILE, ring=slots if sub.sliding else 0)
    c.caches = StandIn(sub, d, hf, x, POSITIONS, kernel_states(sub, d, c.part, cache_in, B), tile=TILE).caches
    run_bodies(c)
    want_caches = kernel_states(sub, d, c.part, cache_out, B)
    ulps = max(float(np.max(np.abs(np.asarray(k.value, np.float32) - want_caches[name])
                            / (np.abs(want_caches[name]) * 2 ** -7 + 1e-6)))
               for name, k in zip(("key", "value"), c.caches))
    return gap(np.asarray(c.refs.x.value) - x, want - x), ulps


@pytest.mark.parametrize("case", list(CASES))
def test_the_lowered_attention_is_the_reference_layer(case):
    residual, cache_ulps = _gaps(case)
    assert residual < TOL
    assert cache_ulps <= 1.0      # the new keys and values within a bf16 rounding


def _mutant(module: str, old: str, new: str):
    """Module `module` of the kind with `old` (once in its source) replaced by `new`, the one
    `GQA.module` returns while the context lasts."""
    # the host's rope_table, for a mutant that rotates
    mutated = mutated_module(module, old, new, rope_table=rope.rope_table)
    real_module = GQA.module
    return mock.patch.object(GQA, "module", lambda s, role: mutated if f"{s.package}.{role}" == module
                             else real_module(s, role))


LOWERING, WEIGHTS = "mkc.layers.gqa.lowering", "mkc.layers.gqa.weights"
# (case, module, source, mutant): each new option's op 1.01 times, or NoPE's heads rotated
MUTANTS = {
    "weightless q/k norm": ("muse_spark_nope", LOWERING, "lambda x, w: ops.rms_norm_weightless(x, eps)",
                            "lambda x, w: 1.01 * ops.rms_norm_weightless(x, eps)"),
    "NoPE rotates": ("muse_spark_nope", LOWERING, "return _heads(s, c, proj, _qk_norm(s, c))",
                     "c.refs.rope = rope_table(c.dims, c.refs.positions)\n"
                     "    return qk_norm_rope(s, c, proj)"),
    "NoPE heads": ("nope", LOWERING, "return _heads(s, c, proj)\n",
                   "return _heads(s, c, proj, lambda x, w: 1.01 * x)\n"),
    "qk_scale_factor": ("muse_spark_sliding", LOWERING, "scale = softmax_scale(c.dims)",
                        "scale = softmax_scale(c.dims) * 1.01"),
    "output norm": ("muse_spark_sliding", LOWERING, "heads = [ops.rms_norm_weightless(",
                    "heads = [1.01 * ops.rms_norm_weightless("),
    "output gate logit": ("muse_spark_sliding", LOWERING, "gate = jax.nn.sigmoid(proj[",
                          "gate = jax.nn.sigmoid(1.01 * proj["),
    "gate_proj's columns": ("muse_spark_nope", WEIGHTS, 'q.append(tensor(hf, p + "gate_proj.weight", mine))',
                            'q.append(1.01 * tensor(hf, p + "gate_proj.weight", mine))'),
}


@pytest.mark.parametrize("mutant", list(MUTANTS))
def test_a_mutant_of_a_muse_spark_option_fails(mutant):
    case, module, old, new = MUTANTS[mutant]
    with _mutant(module, old, new):
        residual, cache_ulps = _gaps(case)
    assert residual > TOL or cache_ulps > 1.0, (residual, cache_ulps)


def _in_kernel(fn, args: list[np.ndarray], outs: int) -> list[np.ndarray]:
    """`fn` of the inputs' refs inside a Pallas TPU kernel run in interpret mode -> its `outs`
    results (f32, each the first input's rows)."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)

    def body(*refs):
        for ref, value in zip(refs[len(args):], fn(*refs[:len(args)])):
            ref[...] = value
    shapes = [jax.ShapeDtypeStruct((args[0].shape[0], w), jnp.float32) for w in outs]
    got = pl.pallas_call(body, out_shape=shapes, in_specs=[vmem] * len(args), out_specs=[vmem] * len(outs),
                         interpret=pltpu.InterpretParams())(*args)
    return [np.asarray(g) for g in got]


@pytest.mark.parametrize("rotate", [True, False])
def test_the_weightless_qk_norm_in_a_kernel_is_its_emulation(rotate):
    """The q/k norm bodies (`qk_norm_rope`, NoPE's `qk_norm`) of a weightless norm, in interpret
    mode, are the reference's rounding emulation of them (`_head_norm_rope`) bit for bit."""
    s, d = dataclasses.replace(MUSE_SPARK, rope=rotate), _muse_spark()
    nq, nkv, hd = d.num_attention_heads, d.num_key_value_heads, d.head_dim
    proj = np.random.default_rng(3).normal(0, 2, (B, 2 * nq * hd + 2 * nkv * hd)).astype(np.float32)
    table = np.asarray(rope.rope_table(d, jnp.asarray(POSITIONS, jnp.int32)))
    body = lowering.qk_norm_rope if rotate else lowering.qk_norm

    def fn(proj_ref, rope_ref):
        c = types.SimpleNamespace(dims=d, per_rank={"nq": nq, "nkv": nkv},
                                  refs=types.SimpleNamespace(rope=rope_ref))
        return [jnp.concatenate(heads, axis=-1) for heads in body(s, c, proj_ref[...])]
    got_q, got_k = _in_kernel(fn, [proj, table], [nq * hd, nkv * hd])
    cos, sin = (table[0], table[1]) if rotate else (None, None)
    for got, heads, start in ((got_q, nq, 0), (got_k, nkv, 2 * nq * hd)):
        t = jnp.asarray(proj[:, start:start + heads * hd].reshape(B, heads, hd))
        want = gqa_reference._head_norm_rope(t, None, cos, sin, d.rotary_dim, d.rms_norm_eps, "weightless")
        np.testing.assert_array_equal(got, np.asarray(want).reshape(B, -1))


def test_the_normed_output_gate_in_a_kernel_is_its_emulation():
    """Muse Spark's output gate body (`out_gate`, rms_gate_proj), in interpret mode, is the
    reference's rounding emulation of it (`_rms_gate`) bit for bit."""
    d = _muse_spark()
    nq, hd = d.num_attention_heads, d.head_dim
    rng = np.random.default_rng(4)
    core = rng.normal(0, 0.5, (B, nq * hd)).astype(np.float32)
    proj = rng.normal(0, 2, (B, 2 * nq * hd + 2 * d.num_key_value_heads * hd)).astype(np.float32)

    def fn(core_ref, proj_ref):
        c = types.SimpleNamespace(dims=d, per_rank={"nq": nq})
        return [lowering.out_gate(MUSE_SPARK, c, core_ref[...], proj_ref[...])]
    got, = _in_kernel(fn, [core, proj], [nq * hd])
    gate = proj[:, nq * hd:2 * nq * hd].reshape(B, nq, hd)
    want = gqa_reference._rms_gate(jnp.asarray(core.reshape(B, nq, hd)), jnp.asarray(gate), d.rms_norm_eps)
    np.testing.assert_array_equal(got, np.asarray(want).reshape(B, -1))


@pytest.mark.parametrize("case", ["muse_spark_sliding", "muse_spark_nope", "nope"])
def test_the_rounding_emulation_without_bf16_is_the_reference(case):
    """The reference's kernel emulation (`Rounding`) of the new options, with f32 matmul inputs
    and wire on two ranks of two query heads each: the f32 reference to f32 summation order
    (the scale on the scores, not on q; online softmax by tile and rank group; the norms and
    the gate head by head)."""
    sub = CASES[case][0]
    d, hf, x, _, cache_in, want, _ = _reference(case)
    rounding = Rounding(ranks=2, reduces=(("kind", "o_proj", Reduce(((2, 1),), "f32")),),
                        storage=(("kind", "kv", "f32"),), shard=(("nq", 2),), matmul_input="f32",
                        kv_tiles=(("kind", TILE),))
    got = sub.module("reference").forward(sub, layer_params(hf), d, jnp.asarray(x), dict(cache_in), 0,
                                          jnp.asarray(POSITIONS, jnp.int32), rounding, "kind")
    assert gap(np.asarray(got) - x, want - x) < TOL / 10
