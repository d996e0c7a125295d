"""Muse Spark's MoE (upstream's `MuseSparkMoE`) as options of the library's `MoE`:
`routing=SCALED_SIGMOID` (the f32 router held as a bf16 pair `[hi | lo]`, its logits times
`output_multiplier`, the picked scores over their sum plus 1e-15) and
`latent=MUSE_SPARK_LATENT` (`pre_expert_proj`, the centred `pre_expert_norm` on the projected
input before the experts, each expert's output normed by the input-scaled `post_expert_norm`
before its routing weight, `post_expert_proj`), bf16 fused experts, no shared expert.

* the lowered bodies on the stand-in (`layer_bodies`) are the f32 reference layer to TOL, the
  rows' picks the reference's;
* the new bodies in a Pallas TPU kernel in interpret mode (router, latent_norm before the
  experts, expert_norm) are the reference's rounding emulation of them bit for bit;
* the emulation without bf16, on two ranks that each hold half of every expert's width
  (`shard experts over tp / 2`, `shard expert_mlp over 2`: one expert group), is the f32
  reference to f32 order (its picks' outputs all-reduced before their norm);
* the f32 reference is an independent float64 numpy of upstream's formula;
* a 1.01 scale of a term of each new op fails one of these (`MUTANTS`: applied to the source,
  each judged by the test it names). A uniform scale of an expert's output before its
  post-expert norm, or of the norm's `1 + w` as a whole, is no mutant: the RMS norm removes it.

Upstream itself (transformers 5.25 `MuseSparkMoE` in float32, eager experts, these dims,
weights and normed input, batch 4) against the f32 reference's block, measured once in
/work/venv-hf: max |difference| / max |output| 6.5e-7 (1.3e-6 absolute), the same picks.
"""
from __future__ import annotations

import dataclasses
import sys
import types
from functools import cache
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from layer_bodies import (PREFIX, StandIn, bf16, draw_params, gap, layer_params, mutated_module, reference,
                          run_bodies)
from mkc.layers.moe import MoE, expert_split
from mkc.layers.moe import lowering
from mkc.layers.moe import reference as moe_ref
from mkc.layers.moe import weights as moe_weights
from mkc.layers.moe.options import SCALED_SIGMOID, Latent
from mkc.layers.reference import NORM
from mkc.model.sharding import ShardTable
from mkc.reference.rounding import Reduce, Rounding

TOL = 2e-5
B = 4
MUSE_SPARK_LATENT = Latent(width="moe_hidden_size", down="pre_expert_proj.weight",
                           up="post_expert_proj.weight", norm="pre_expert_norm.weight", norm_at="input",
                           norm_weight="zero_centred", expert_norm="experts.post_expert_norm.weight")
MUSE_SPARK = MoE(norm="zero_centred", routing=SCALED_SIGMOID, latent=MUSE_SPARK_LATENT)


@dataclasses.dataclass(frozen=True)
class MuseSparkMoEDims:
    """Muse Spark's MoE dims (`MuseSparkTextConfig`), its widths and experts fewer."""

    hidden_size: int = 256
    moe_hidden_size: int = 128
    moe_intermediate_size: int = 64
    experts: int = 8
    top_k: int = 3
    rms_norm_eps: float = 1e-5
    post_norm_eps: float = 1e-8
    output_multiplier: float = 0.1767766952966369
    routed_scaling_factor: float = 1.0
    norm_topk_prob: bool = True


def _draws(seed: int = 5):
    d = MuseSparkMoEDims()
    hf = draw_params(MUSE_SPARK, d, seed=seed)
    x = np.random.default_rng(9).normal(0, 1, (B, d.hidden_size)).astype(np.float32)
    return d, hf, x


def _sub(hf) -> dict[str, jax.Array]:
    return {n[len(MUSE_SPARK.prefix):]: w for n, w in layer_params(hf).items()
            if n.startswith(MUSE_SPARK.prefix)}


def _slot_experts(d, hf) -> list[dict[str, jax.Array]]:
    """Every expert as its slot holds it ([in, out] values)."""
    p, inter = _sub(hf), d.moe_intermediate_size
    return [{n: a.T for n, a in moe_ref._slot_expert(MUSE_SPARK, p, d, e, slice(0, inter), inter).items()}
            for e in range(d.experts)]


def _layer_gap() -> tuple[float, bool]:
    """The stand-in's layer against the f32 reference: (gap, whether every row's picks are the
    reference's)."""
    d, hf, x = _draws()
    want, _ = reference(MUSE_SPARK, d, hf, x, np.zeros(B, np.int32))
    c = StandIn(MUSE_SPARK, d, hf, x, np.zeros(B, np.int32))
    values = run_bodies(c, _slot_experts(d, hf))
    ids, _ = moe_ref.route(values["router_logits"], *moe_ref.route_args(MUSE_SPARK, _sub(hf), d))
    same = np.array_equal(np.sort(np.asarray(c.picked), -1), np.sort(np.asarray(ids), -1))
    return gap(np.asarray(c.refs.x.value) - x, want - x), same


@cache
def _layer() -> tuple[float, bool]:
    return _layer_gap()


def test_the_lowered_muse_spark_moe_is_the_reference_layer():
    residual, same_picks = _layer()
    assert same_picks
    assert residual < TOL


def test_its_graph_and_its_expert_split():
    """Its ops in order, the per-pick outputs a partial over the ranks sharing each expert's
    width; every rank a slice of every expert is `shard experts over tp / N` with `shard
    expert_mlp over N` (one expert group)."""
    d = MuseSparkMoEDims()
    ways = {"experts": 1, "expert_mlp": 8, "latent_down": 8, "latent_up": 8}
    part = MUSE_SPARK.part(dataclasses.replace(d, moe_intermediate_size=512), ways)
    assert [op.name for op in part.ops] == ["post_norm", "router", "route", "latent_down", "latent_norm",
                                            "routed_experts", "expert_norm", "latent_up", "mlp_residual"]
    experts = next(op for op in part.ops if op.name == "routed_experts")
    assert experts.writes == ("expert_outs",) and experts.partial == ("experts", "expert_mlp")
    assert experts.width == d.top_k * d.moe_hidden_size
    assert part.tensors["router"].shape == (d.hidden_size, 2 * d.experts)
    assert part.per_rank["expert_width"] == 64
    assert expert_split({"experts": (1, 8), "expert_mlp": (8, 1)}, 8, "muse_spark") == {
        "experts": 1, "expert_mlp": 8}


def _in_kernel(fn, args: list[np.ndarray], outs: int) -> np.ndarray:
    """`fn` of the inputs' refs inside a Pallas TPU kernel run in interpret mode -> its f32
    result, `outs` wide."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)

    def body(*refs):
        refs[-1][...] = fn(*refs[:-1])
    out = jax.ShapeDtypeStruct((args[0].shape[0], outs), jnp.float32)
    return np.asarray(pl.pallas_call(body, out_shape=out, in_specs=[vmem] * len(args), out_specs=vmem,
                                     interpret=pltpu.InterpretParams())(*args))


BF16 = Rounding(ranks=1, reduces=())


def _check_router(body=None, emulated=None):
    """The router body (the pair's halves summed, times output_multiplier) on the emulation's
    product of the pair is the emulation's logits (`reference.router_logits`)."""
    d, hf, x = _draws()
    p = _sub(hf)
    xin = BF16.mm_in(jnp.asarray(x))
    product = np.asarray(BF16.linear(xin, moe_ref.router_pair(p["gate.weight"])))

    def fn(h_ref, product_ref):
        c = types.SimpleNamespace(dims=d, matmul=lambda name, h: product_ref[...])
        return (body or lowering.router)(MUSE_SPARK, c, h_ref[...])
    got = _in_kernel(fn, [np.asarray(xin), product], d.experts)
    want = np.asarray((emulated or moe_ref.router_logits)(MUSE_SPARK, p, d, xin, BF16, "kind"))
    np.testing.assert_array_equal(got, want)


def _check_latent_norm(body=None):
    """latent_norm before the experts (centred, in f32, of the gathered latent's first
    `moe_hidden_size` columns: the gather lands them bf16, over more lane-padded columns) is
    the emulation's `NORM["zero_centred"]` of its values."""
    d, hf, _ = _draws()
    w = np.asarray(_sub(hf)["pre_expert_norm.weight"])[None, :]
    gathered = np.random.default_rng(2).normal(0, 3, (B, 2 * d.moe_hidden_size)).astype(jnp.bfloat16)
    lat = np.asarray(gathered[:, :d.moe_hidden_size], np.float32)

    def fn(lat_ref, w_ref):
        c = types.SimpleNamespace(dims=d, vector=lambda name: w_ref[...])
        return (body or lowering.latent_norm)(MUSE_SPARK, c, lat_ref[...])
    got = _in_kernel(fn, [gathered, w], d.moe_hidden_size)
    np.testing.assert_array_equal(got, np.asarray(NORM["zero_centred"](jnp.asarray(lat), w, d.rms_norm_eps)))


def _check_expert_norm(body=None, emulated=None):
    """expert_norm (each pick's output input-scaled RMS-normed, times its weight, summed) is
    the emulation's `kernel_expert_norm`."""
    d, hf, _ = _draws()
    rng = np.random.default_rng(3)
    w = np.asarray(_sub(hf)["experts.post_expert_norm.weight"])[None, :]
    outs = rng.normal(0, 2, (B, d.top_k * d.moe_hidden_size)).astype(np.float32)
    ids = np.stack([rng.permutation(d.experts)[:d.top_k] for _ in range(B)]).astype(np.int32)
    dense = np.zeros((B, d.experts), np.float32)
    np.put_along_axis(dense, ids, rng.uniform(0.1, 0.5, ids.shape).astype(np.float32), -1)

    def fn(outs_ref, ids_ref, dense_ref, w_ref):
        c = types.SimpleNamespace(dims=d, B=B, vector=lambda name: w_ref[...])
        return (body or lowering.expert_norm)(MUSE_SPARK, c, outs_ref[...], ids_ref[...], dense_ref[...])
    got = _in_kernel(fn, [outs, ids, dense, w], d.moe_hidden_size)
    want = (emulated or moe_ref.kernel_expert_norm)(jnp.asarray(outs), jnp.asarray(ids), jnp.asarray(dense),
                                                    jnp.asarray(w), d.post_norm_eps)
    np.testing.assert_array_equal(got, np.asarray(want))


def test_the_router_in_a_kernel_is_its_emulation():
    _check_router()


def test_the_latent_norm_before_the_experts_in_a_kernel_is_its_emulation():
    _check_latent_norm()


def test_the_expert_norm_in_a_kernel_is_its_emulation():
    _check_expert_norm()


def test_the_router_pair_holds_the_f32_weight():
    """The weights module's pair is the reference's, its halves bf16 values, hi + lo the f32
    weight to 2^-17 of each value (lo is rounded to 8 bits of the 2^-8-relative remainder)."""
    _, hf, _ = _draws()
    w = hf["model.layers.0.mlp.gate.weight"]
    pair = moe_weights.router_pair(w)
    np.testing.assert_array_equal(pair, np.asarray(moe_ref.router_pair(jnp.asarray(w))))
    np.testing.assert_array_equal(pair, np.asarray(jnp.asarray(pair, jnp.bfloat16).astype(jnp.float32)))
    E = w.shape[0]
    assert np.all(np.abs(pair[:E] + pair[E:] - w) <= 2.0 ** -17 * np.abs(w))


def test_its_weights_split_every_expert_by_width():
    """Two ranks, one expert group (`shard experts over tp / 2`, `shard expert_mlp over 2`):
    rank r holds width part r of every expert, its gate and up columns `[gate | up]` and down's
    rows, as the emulation's slot (`_slot_expert`) holds them; the latent projections' columns
    split over their classes (lane-padded shares), the norms' vectors and the router's pair whole."""
    d, hf, _ = _draws()
    rules = {"experts": (1, 2), "expert_mlp": (2, 1), "latent_down": (2, 1), "latent_up": (2, 1)}
    shards = ShardTable.of(rules, 2)
    p, half = _sub(hf), d.moe_intermediate_size // 2
    for rank in range(2):
        for e in range(d.experts):
            got = moe_weights.expert(MUSE_SPARK, hf, d, PREFIX, e, rank, shards)
            want = moe_ref._slot_expert(MUSE_SPARK, p, d, e, slice(rank * half, (rank + 1) * half), half)
            for name in ("gate_up", "down"):       # the pool's bf16 of the checkpoint's values
                want_name = bf16(np.asarray(want[name]).T)
                np.testing.assert_array_equal(np.asarray(got[name], np.float32), want_name)
    # each share lane padded (`MoE.latent_cols`): rank 0's 128 columns are the whole latent
    downs = [moe_weights.matrix(MUSE_SPARK, hf, d, PREFIX, "latent_down", r, shards) for r in range(2)]
    np.testing.assert_array_equal(np.concatenate(downs, axis=1)[:, :d.moe_hidden_size],
                                  hf[PREFIX + "mlp.pre_expert_proj.weight"].T)
    for name, stored in (("latent_norm", "pre_expert_norm"), ("expert_norm", "experts.post_expert_norm")):
        np.testing.assert_array_equal(moe_weights.vector(MUSE_SPARK, hf, d, PREFIX, name, 0, shards),
                                      hf[f"{PREFIX}mlp.{stored}.weight"][None, :])
    np.testing.assert_array_equal(moe_weights.matrix(MUSE_SPARK, hf, d, PREFIX, "router", 1, shards),
                                  moe_weights.router_pair(hf[PREFIX + "mlp.gate.weight"]).T)


def _emulation_gap() -> float:
    d, hf, x = _draws()
    want, _ = reference(MUSE_SPARK, d, hf, x, np.zeros(B, np.int32))
    rounding = Rounding(ranks=2, reduces=(("kind", "routed_experts", Reduce(((2, 1),), "f32")),),
                        gathers=(("kind", "latent_down", "f32"), ("kind", "latent_up", "f32")),
                        shard=(("expert_tp", 2), ("expert_width", d.moe_intermediate_size // 2),
                               ("local_experts", d.experts)), matmul_input="f32")
    got = MUSE_SPARK.module("reference").forward(MUSE_SPARK, layer_params(hf), d, jnp.asarray(x), {}, 0,
                                                 jnp.zeros(B, jnp.int32), rounding, "kind")
    return gap(np.asarray(got) - x, want - x)


def test_the_rounding_emulation_without_bf16_is_the_reference():
    assert _emulation_gap() < TOL / 10


def upstream_numpy(hf, d, h: np.ndarray) -> np.ndarray:
    """Upstream's `MuseSparkMoE.forward` (MODELS.md, modeling_muse_spark.py) in float64 numpy
    on the normed input `h [B, H]`."""
    p = {n[len("model.layers.0.mlp."):]: np.asarray(w, np.float64) for n, w in hf.items()
         if n.startswith("model.layers.0.mlp.")}
    h = np.asarray(h, np.float64)
    logits = h @ p["gate.weight"].T * d.output_multiplier
    scores = 1.0 / (1.0 + np.exp(-logits))
    ids = np.argsort(-(scores + p["gate.e_score_correction_bias"]), axis=-1, kind="stable")[:, :d.top_k]
    weights = np.take_along_axis(scores, ids, -1)
    weights = weights / (weights.sum(-1, keepdims=True) + 1e-15) * d.routed_scaling_factor
    z = h @ p["pre_expert_proj.weight"].T
    z = z / np.sqrt(np.mean(z * z, -1, keepdims=True) + d.rms_norm_eps) * (1.0 + p["pre_expert_norm.weight"])
    out = np.zeros_like(z)
    inter = d.moe_intermediate_size
    for b in range(h.shape[0]):
        for k, e in enumerate(ids[b]):
            gu = p["experts.gate_up_proj"][e] @ z[b]
            gate, up = gu[:inter], gu[inter:]
            y = p["experts.down_proj"][e] @ (gate / (1.0 + np.exp(-gate)) * up)
            t = y * (1.0 + p["experts.post_expert_norm.weight"])
            out[b] += weights[b, k] * t / np.sqrt(np.mean(t * t) + d.post_norm_eps)
    return out @ p["post_expert_proj.weight"].T


def _upstream_gap() -> float:
    d, hf, x = _draws()
    h = np.asarray(NORM["zero_centred"](jnp.asarray(x), layer_params(hf)["post_attention_layernorm.weight"],
                                        d.rms_norm_eps))
    got = MUSE_SPARK.module("reference").block(MUSE_SPARK, _sub(hf), d, jnp.asarray(h))
    return gap(got, upstream_numpy(hf, d, h))


def test_the_reference_is_upstreams_formula():
    assert _upstream_gap() < 1e-5


LOWERING, REFERENCE = "mkc.layers.moe.lowering", "mkc.layers.moe.reference"
# (module, source, mutant, judge): each new op's term 1.01 times
MUTANTS = {
    "output_multiplier (router)": (LOWERING, "logits = logits * scale", "logits = logits * scale * 1.01",
                                   "layer"),
    "the pair's lo half (router)": (LOWERING, "logits = pair[:, :E] + pair[:, E:2 * E]",
                                    "logits = pair[:, :E] + 1.01 * pair[:, E:2 * E]", "router"),
    "the routing sum (sigmoid_route_weights)": (LOWERING, "kept / (total + eps if eps else total)",
                                                "kept / (total * 1.01 + eps if eps else total)", "layer"),
    "pre_expert_norm's weight (latent_norm)": (
        LOWERING, 'return ops.NORM[s.latent.norm_weight](latent, c.vector("latent_norm")',
        'return ops.NORM[s.latent.norm_weight](latent, 1.01 * c.vector("latent_norm")', "layer"),
    "an expert's gate|up product (per pick)": (
        LOWERING, 'act = ops.activation(s.activation, expert_matmul(c, k, h, "gate_up"',
        'act = ops.activation(s.activation, 1.01 * expert_matmul(c, k, h, "gate_up"', "layer"),
    "post_expert_norm's weight (expert_norm)": (LOWERING, 'scale = 1.0 + c.vector("expert_norm")',
                                                'scale = 1.0 + 1.01 * c.vector("expert_norm")', "layer"),
    "the normed pick (expert_norm)": (LOWERING, "normed = ops.rms_norm_weightless(",
                                      "normed = 1.01 * ops.rms_norm_weightless(", "layer"),
    "a pick's weight (expert_norm)": (LOWERING, "acc = acc + weight * normed",
                                      "acc = acc + 1.01 * weight * normed", "layer"),
    "reference: output_multiplier": (REFERENCE, "return logits if scale is None else logits * scale",
                                     "return logits if scale is None else logits * scale * 1.01", "upstream"),
    "reference: pre_expert_norm before the experts": (
        REFERENCE, "xin = NORM[lat.norm_weight](xin, p[lat.norm], d.rms_norm_eps)",
        "xin = NORM[lat.norm_weight](xin, 1.01 * p[lat.norm], d.rms_norm_eps)", "upstream"),
    "reference: post_expert_norm's weight": (
        REFERENCE, "out = input_scaled_norm(out, p[s.latent.expert_norm], d.post_norm_eps)",
        "out = input_scaled_norm(out, 1.01 * p[s.latent.expert_norm], d.post_norm_eps)", "upstream"),
    "reference: the renormalising sum": (
        REFERENCE, "chosen = chosen / (jnp.sum(chosen, axis=-1, keepdims=True) + eps)",
        "chosen = chosen / (1.01 * jnp.sum(chosen, axis=-1, keepdims=True) + eps)", "upstream"),
    "emulation: the pair's lo half": (REFERENCE, "logits = pair[:, :E] + pair[:, E:]",
                                      "logits = pair[:, :E] + 1.01 * pair[:, E:]", "router"),
    "emulation: a rank's picks' outputs (expert_parallel_picks)": (
        REFERENCE, "partials.append(jnp.concatenate(acc, axis=-1))",
        "partials.append(jnp.concatenate(acc, axis=-1) * (1.01 if not partials else 1.0))", "emulation"),
    "emulation: post_expert_norm's weight": (REFERENCE, "    scale = 1.0 + w\n",
                                             "    scale = 1.0 + 1.01 * w\n", "expert_norm"),
    "emulation: a pick's weight": (REFERENCE, "acc = acc + weight * (y * ",
                                   "acc = acc + 1.01 * weight * (y * ", "expert_norm"),
}


def _judged(judge: str, mutant: types.ModuleType) -> bool:
    """Whether test `judge` fails with the mutant in place."""
    if judge == "layer":
        residual, same = _layer_gap()
        return residual > TOL or not same
    if judge == "upstream":
        return _upstream_gap() > 1e-5
    if judge == "emulation":
        return _emulation_gap() > TOL / 10
    checks = {"router": (_check_router, "router", "router_logits"),
              "expert_norm": (_check_expert_norm, "expert_norm", "kernel_expert_norm")}
    check, body, emulated = checks[judge]
    try:
        if mutant.__name__ == LOWERING:
            check(body=getattr(mutant, body))
        else:
            check(emulated=getattr(mutant, emulated))
    except AssertionError:
        return True
    return False


@pytest.mark.parametrize("name", list(MUTANTS))
def test_a_mutant_of_a_new_op_fails(name):
    module, old, new, judge = MUTANTS[name]
    mutant = mutated_module(module, old, new)
    real_module, real = MoE.module, sys.modules[module]
    # only the one entry swapped: `mock.patch.dict(sys.modules)` would drop the modules jax
    # imports lazily meanwhile, which cannot be imported twice
    sys.modules[module] = mutant
    try:
        with mock.patch.object(MoE, "module", lambda s, role: mutant if f"{s.package}.{role}" == module
                               else real_module(s, role)):
            assert _judged(judge, mutant), name
    finally:
        sys.modules[module] = real
