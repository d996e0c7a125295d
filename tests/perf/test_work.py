"""Work counted from the emitted kernel (`mkc.perf.work`): the counting rules on small traced
functions, and the model priced by what the lowering does: more work in one compute body makes
the modelled step longer, no MXFP4 decode makes K3's shorter."""
import warnings
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from mkc.compiler import check_spec
from mkc.ir import WeightFormat
from mkc.perf import work
from mkc.perf.run import run
from mkc.runtime import scopes
from tests_support import K3_SPEC, ROOT, SPEC, k3_format_text

K3_64_SPEC = ROOT / "schedules" / "kimi_k3_64.sched"

F32, BF16 = jnp.float32, jnp.bfloat16


def test_vector_work_is_whole_registers():
    assert work.vreg_values((8, 128), F32) == 1024
    assert work.vreg_values((1, 128), F32) == 1024          # one row fills no more than a register
    assert work.vreg_values((9, 128), F32) == 2048
    assert work.vreg_values((1, 129), F32) == 2048
    assert work.vreg_values((16, 128), BF16) == 1024        # bf16 packs 16 rows a register
    assert work.vreg_values((3, 8, 256), F32) == 3 * 2048
    assert work.vreg_values((), F32) == 0                   # scalars: the scalar unit


def _count(fn, *args):
    return work.count_kernel(jax.make_jaxpr(fn)(*args), 8, "test")


def test_counting_rules_by_op_and_region():
    x = jax.ShapeDtypeStruct((8, 128), F32)
    w = jax.ShapeDtypeStruct((128, 256), BF16)

    def fn(x, w, n):
        with scopes.op("k", "a"):
            y = jnp.exp(x) + 1.0                                        # 1 EUP, 1 VPU
            y = lax.fori_loop(0, 5, lambda i, acc: acc * 2.0, y)        # static: 5 VPU
            y = lax.cond(n > 0, lambda v: v * 3.0, lambda v: v * 3.0 + 1.0, y)   # the costlier: 2
            y = lax.fori_loop(0, n, lambda i, acc: acc - 1.0, y)        # run-time length: once
            with scopes.weights():
                z = jnp.dot(y.astype(BF16), w, preferred_element_type=F32)   # 1 cast, 128 x 256
        with scopes.op("k", "b"):
            z = z * 2.0                                                  # [8, 256]: 2 registers
        return z + 1.0                                                   # in no op

    kw = _count(fn, x, w, jax.ShapeDtypeStruct((), jnp.int32))
    a, b = kw.ops["k", "a"], kw.ops["k", "b"]
    assert a.at_op.transcendental == 1024
    assert a.at_op.vector == (1 + 5 + 2 + 1) * 1024
    assert a.dynamic_loop
    assert a.weights.vector == 1024 and a.weights.matrix == {("bf16", 8): 128 * 256}
    assert a.weight_values == 128 * 256
    assert a.per_weight_value().vector == pytest.approx(1024 / (128 * 256))
    assert b.at_op.vector == 2048 and not b.dynamic_loop
    assert kw.outside.vector == 2048


def test_a_dot_loads_its_larger_operand_and_streams_the_smaller():
    def fn(q, k):
        with scopes.op("k", "attn"), scopes.kv_tile():
            return jnp.einsum("hd,td->ht", q, k, preferred_element_type=F32)

    kw = _count(fn, jax.ShapeDtypeStruct((64, 128), BF16), jax.ShapeDtypeStruct((512, 128), BF16))
    assert kw.ops["k", "attn"].kv_tile.matrix == {("bf16", 64): 512 * 128}


def test_a_bf16_by_fp4_dot_loads_at_the_fp8_rate():
    """A bf16 x fp4 dot is its own MXU input type. JAX gives no fp4 rate and libtpu pushes the
    codes as f8e4m3 (benchmarks/format_probe.py --bundles), so its weights load at the fp8
    rate (an assumption until a chip is measured); its FLOPs at bf16's."""
    def fn(x, w):
        with scopes.op("moe", "experts"):
            return jnp.dot(x, w, preferred_element_type=F32)

    kw = _count(fn, jax.ShapeDtypeStruct((8, 512), BF16),
                jax.ShapeDtypeStruct((512, 256), jnp.float4_e2m1fn))
    assert kw.ops["moe", "experts"].at_op.matrix == {(work.MIXED_FP4, 8): 512 * 256}
    from mkc.perf.constants import rates
    r7 = rates("tpu7x")
    assert "fp4" not in r7.mxu_ops_per_s
    assert r7.feed_values_per_s(work.MIXED_FP4) == r7.feed_values_per_s("fp8")
    assert r7.mxu_rate(work.MIXED_FP4) == r7.mxu_rate("bf16")


def test_a_bf16_by_fp8_dot_loads_fp8_where_the_chip_multiplies_fp8():
    """A mixed dot (bf16 rows, FP8 codes as the weight) is its own MXU input type: its weights
    load at the chip's fp8 rate where JAX gives one (tpu7x: about twice bf16's, as its LLO pushes
    f8e4m3 at half the pushes), else at bf16's (v5e converts in the push); its FLOPs at bf16's."""
    def fn(x, w):
        with scopes.op("moe", "experts"):
            return jnp.dot(x, w, preferred_element_type=F32)

    kw = _count(fn, jax.ShapeDtypeStruct((8, 512), BF16),
                jax.ShapeDtypeStruct((512, 256), jnp.float8_e4m3fn))
    assert kw.ops["moe", "experts"].at_op.matrix == {(work.MIXED_FP8, 8): 512 * 256}
    from mkc.perf.constants import rates
    r7, r5 = rates("tpu7x"), rates("v5e")
    assert r7.feed_values_per_s(work.MIXED_FP8) == r7.feed_values_per_s("fp8")
    assert r7.feed_values_per_s("fp8") > 1.9 * r7.feed_values_per_s("bf16")
    assert r7.mxu_rate(work.MIXED_FP8) == r7.mxu_rate("bf16")
    assert r5.feed_values_per_s(work.MIXED_FP8) == r5.feed_values_per_s("bf16")


@pytest.fixture
def fresh_counts():
    work.clear_cache()
    yield
    work.clear_cache()


def _entry(rep: dict, kind: str, op: str) -> dict:
    return next(e for e in rep["op_costs"] if (e["layer_kind"], e["op"]) == (kind, op))


def test_more_work_in_one_lowering_function_lengthens_the_modelled_step(monkeypatch, fresh_counts):
    # Enough rounds to outlast the HBM waits the op runs under (the step is HBM-bound, and
    # the gdn layer's compute overlaps its copies: 20 or 200 rounds were hidden whole); a
    # loop of static length counts its body that many times
    ROUNDS = 5000
    from mkc.families.qwen3_5 import lowering
    s = check_spec(SPEC).ir
    base = run(s, 8, compiled=False)
    original = lowering.BODIES["gdn", "gated_norm"]

    def heavier(c, *args):
        out = original(c, *args)
        return lax.fori_loop(0, ROUNDS, lambda i, v: v * 1.0001 + 0.5, out)

    monkeypatch.setitem(lowering.BODIES, ("gdn", "gated_norm"), heavier)
    work.clear_cache()
    more = run(s, 8, compiled=False)
    before, after = _entry(base, "gdn", "gated_norm"), _entry(more, "gdn", "gated_norm")
    shape_ops = 2 * ROUNDS * after["calls"]  # two ops a round, every gdn layer
    assert after["vector_ops_per_row"] > before["vector_ops_per_row"]
    added = (after["vector_ops_per_row"] - before["vector_ops_per_row"]) * 8 * after["calls"]
    assert added % shape_ops == 0            # whole registers of the op's output, per op added
    assert more["step_seconds"] > base["step_seconds"]
    assert before["source"] == "mkc.layers.gated_delta_net.lowering.gated_norm"
    assert after["source"].endswith("heavier")


@pytest.mark.slow
def test_without_the_mxfp4_decode_k3_models_faster(monkeypatch, fresh_counts):
    from mkc.layers.expert_formats import ops
    s = check_spec(K3_64_SPEC).ir                 # its experts in the checkpoint's MXFP4
    assert s.weight_formats == dict.fromkeys(("expert.down", "expert.gate_up"),
                                             WeightFormat("mxfp4", 32))
    base = run(s, 1, compiled=False)

    def no_decode(codes, scales, dtype=F32):
        # the shape the decode returns ([rows, cols] of values), with no work on the values
        return jnp.broadcast_to(scales[:1, :].astype(dtype), (2 * codes.shape[0], codes.shape[1]))

    monkeypatch.setattr(ops, "mxfp4_dequantize_tile", no_decode)
    work.clear_cache()
    cheaper = run(s, 1, compiled=False)
    before = _entry(base, "moe", "routed_experts")
    after = _entry(cheaper, "moe", "routed_experts")
    assert after["vector_ops_per_row"] < before["vector_ops_per_row"] / 4
    assert after["matrix_values"] == pytest.approx(before["matrix_values"])
    assert cheaper["step_seconds"] < base["step_seconds"] - (before["seconds"] - after["seconds"]) / 2


@pytest.mark.slow
def test_each_expert_format_is_priced_by_its_own_lowering(tmp_path):
    """Counted from the kernel, a routed expert's weight value costs MXFP4's decode (the
    shipped spec's; at most 3 VPU operations with its dot's share), FP8 with 32-row scales a
    conversion and a multiply, FP8 or rounded FP4 with a scale per pack group no conversion
    (the codes go to the MXU as they are: only the group's scale on its partial product); the
    step follows, although FP8 streams twice MXFP4's code bytes, and FP4 (MXFP4's bytes, loaded
    at the fp8 rate) is the shortest."""
    shipped = check_spec(K3_SPEC).ir
    assert shipped.weight_formats == {
        "expert.down": WeightFormat("mxfp4", 32, where="kimi_k3.sched:44"),
        "expert.gate_up": WeightFormat("mxfp4", 32, where="kimi_k3.sched:43")}
    irs = {"mxfp4": shipped}
    for label in ("fp4 block", "fp8 block", "fp8"):
        spec = tmp_path / f"{label.replace(' ', '_')}.sched"
        spec.write_text(k3_format_text(label))
        irs[label] = check_spec(spec, "kimi_k3").ir
    per_value = {label: work.kernel_work(s, 1).op("moe", "routed_experts").per_weight_value().vector
                 for label, s in irs.items()}
    assert per_value["fp4 block"] < 1 and per_value["fp8 block"] < 1
    # Issue 18: where no generation feeds FP4 codes, the in-kernel MXFP4 decode costs at most 3.
    assert per_value["fp8 block"] < 1 < per_value["fp8"] < per_value["mxfp4"] <= 3
    steps = {label: run(s, 1, compiled=False) for label, s in irs.items()}
    assert steps["fp8"]["hbm_bytes"] > steps["mxfp4"]["hbm_bytes"]
    assert steps["fp4 block"]["hbm_bytes"] < steps["fp8 block"]["hbm_bytes"]
    assert (steps["fp4 block"]["step_seconds"] < steps["fp8 block"]["step_seconds"]
            < steps["fp8"]["step_seconds"] < steps["mxfp4"]["step_seconds"])


SHIPPED = sorted(Path(ROOT / "schedules").glob("*.sched"))


@pytest.mark.slow
@pytest.mark.parametrize("spec", SHIPPED, ids=[p.stem for p in SHIPPED])
def test_every_op_of_a_shipped_spec_is_priced_from_the_emitted_kernel(spec):
    """Every op the trace runs has counted work with its source; an op whose weights work is
    priced per value read reads weights, one priced per KV tile reads KV tiles."""
    s = check_spec(spec).ir
    rep = run(s, s.batch_max, compiled=False)
    kw = work.kernel_work(s, s.batch_max)
    traced = {(e["layer_kind"], e["op"]) for e in rep["op_costs"]}
    expected = {(k, op) for k in set(s.layer_kinds) for op in s.kinds[k].ops}
    assert expected | {("tail", "embed"), ("tail", "final_norm"), ("tail", "lm_head")} == traced
    for e in rep["op_costs"]:
        ow = kw.op(e["layer_kind"], e["op"])
        assert not e["source"].startswith("assumed")
        if ow.weight_values:
            assert e["weight_values_read"] > 0, e
        if ow.kv_tile.size:
            assert e["kv_tiles"] > 0, e
    assert set(kw.ops) <= traced                 # nothing counted under a name the trace lacks
    assert np.isfinite(rep["step_seconds"])


def test_the_emitted_kernel_calls_no_deprecated_jax_api(fresh_counts):
    """Traced with JAX's deprecation warnings as errors, as `mkc perf` and the VMEM check trace
    it: the 27B's kernel, its collectives' barrier and remote copies among its calls
    (tests/runtime/test_collectives.py lowers and interprets the collectives so too)."""
    s = check_spec(SPEC).ir
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        work.kernel_work(s, 8)


def test_qwen_attention_loads_each_kv_tile_once_per_kv_head_not_per_query_head():
    """The 27B's 3 query heads a rank holds read one KV head: each row's K and V tile go into
    the MXU once for the 3, as bf16 (the 3 heads' f32 queries and probabilities stream past
    them as 9 bf16 rows: high, middle and low parts), and no f32 copy of the tile is made."""
    s = check_spec(SPEC).ir
    nq, nkv, hd = s.per_rank["nq"], s.per_rank["nkv"], s.dims["head_dim"]
    tokens = s.kinds["gqa"].kv.tokens
    assert nq == 3 and nkv == 1
    B = 8
    tile = work.kernel_work(s, B).op("gqa", "attention").kv_tile
    assert tile.matrix == {("bf16", 3 * nq // nkv): float(B * nkv * 2 * tokens * hd)}
    # converting the K and V tiles to f32 would alone be B x 2 x (tokens x hd) f32 values
    assert 0 < tile.vector < B * 2 * work.vreg_values((tokens, hd), F32) / 2
