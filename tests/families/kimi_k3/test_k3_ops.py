"""The Kimi K3 op library inside Pallas kernels: every op runs in a grid-less ``pallas_call`` in TPU
interpret mode against the reference building blocks (``mkc.families.kimi_k3.reference``) or numpy, the
absorbed MLA and one KDA layer against the reference layers, and a compile-only check lowers a
kernel using all ops through Mosaic for tpu7x. Where a lowered body (``mkc.families.kimi_k3.lowering``)
does more than call one op, the test calls the body itself (on a stand-in layer,
``tests_support.body_layer``), on inputs where what it passes acts: the route's correction bias
deciding a pick, the residual mixtures over the sources the reference's block bookkeeping holds."""
from __future__ import annotations

import dataclasses
import math
import types
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from conftest import run_python
from mkc.ir import WeightFormat
from mkc.model.config import CONFIG_DIR
from mkc.model.mxfp4 import mxfp4_dequantize, mxfp4_quantize
from mkc.families.kimi_k3 import lowering
from mkc.families.kimi_k3.config import KimiDims
from mkc.layers import expert_formats
from mkc.layers import ops as layer_ops
from mkc.layers.block_residuals import lowering as block_lowering
from mkc.layers.mla import ops as mla_ops
from mkc.layers.mla import weights as mla_weights
from mkc.layers.kda import ops as kda_ops
from mkc.layers.kda import reference as kda_reference
from mkc.layers.mla import reference as mla_reference
from mkc.layers.kda.weights import expand_a_log
from mkc.layers.reference import l2_normalize, linear, rms_norm
from mkc.layers.moe import reference as moe_reference
from mkc.families.kimi_k3.graph import ATTENTION
from mkc.layers.expert_formats import ops as format_ops
from mkc.layers.expert_formats import weights as format_weights
from mkc.reference.rounding import chunked_linear
from mkc.runtime import experts
from mkc.families.kimi_k3 import reference as ref
from mkc.layers import block_residuals
from mkc.layers.block_residuals import BlockAdd, BlockMix
from mkc.layers.block_residuals import reference as block_reference
from tests_support import body_layer, lowered_routed_experts

MINI_JSON = CONFIG_DIR / "kimi_k3_mini.json"
VMEM = pl.BlockSpec(memory_space=pltpu.VMEM)
SMEM = pl.BlockSpec(memory_space=pltpu.SMEM)
F32 = jnp.float32


def in_kernel(body: Callable[..., None], args: list, out_shape, in_specs=None, out_specs=None):
    """Run ``body(*in_refs, *out_refs)`` as a grid-less pallas_call in TPU interpret mode."""
    call = pl.pallas_call(
        body, out_shape=out_shape,
        in_specs=in_specs or [VMEM] * len(args),
        out_specs=out_specs or jax.tree.map(lambda _: VMEM, out_shape),
        interpret=pltpu.InterpretParams())
    return call(*args)


def values_in_kernel(fn: Callable[..., object], args: list, out_shape):
    """Load every (VMEM) input, apply ``fn`` and store its output(s)."""
    def body(*refs):
        ins, outs = refs[:len(args)], refs[len(args):]
        for out, value in zip(outs, jax.tree.leaves(fn(*[r[...] for r in ins]))):
            out[...] = value.astype(out.dtype)
    return in_kernel(body, args, out_shape)


def sds(shape: tuple[int, ...], dtype=F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.fixture(scope="module")
def mini() -> KimiDims:
    return ref.load_config(MINI_JSON)


def _random_params(cfg: KimiDims, prefix: str, seed: int) -> dict[str, jax.Array]:
    """f32 params under ``prefix`` (names relative): N(0, 1/fan_in) matrices, norms near 1, the
    KDA gate scalars as ``ref.init_params`` draws them."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in ref.param_shapes(cfg).items():
        if not name.startswith(prefix):
            continue
        short = name[len(prefix):]
        if short.endswith("norm.weight") or short.endswith("layernorm.weight"):
            w = 1.0 + rng.normal(0.0, 0.1, shape)
        elif short == "A_log":
            w = np.log(rng.uniform(1.0, 16.0, shape))
        elif short == "dt_bias":
            w = rng.uniform(-1.0, 0.0, shape)
        else:
            w = rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), shape)
        out[short] = jnp.asarray(w, F32)
    return out


# ---------------------------------------------------------------------------------------------


def test_situ_matches_reference() -> None:
    rng = np.random.default_rng(0)
    gate = jnp.asarray(rng.normal(0, 8, (8, 256)), F32)
    up = jnp.asarray(rng.normal(0, 40, (8, 256)), F32)
    got, packed = values_in_kernel(
        lambda g, u: (layer_ops.situ(g, u), layer_ops.situ_packed(jnp.concatenate([g, u], axis=-1), 256)),
        [gate, up], (sds((8, 256)), sds((8, 256))))
    want = layer_ops.situ(gate, up, 4.0, 25.0)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(packed, want, rtol=1e-6, atol=1e-6)


def test_the_lowered_situ_bodies_take_the_configs_betas_where_they_saturate() -> None:
    """shared_gate_up and routed_experts (its matmuls dense on f32 values) apply SiTU with the
    config's betas (here not the op's defaults) to products large enough that both tanh
    saturate: a beta off by 1 % is caught."""
    dims = dataclasses.replace(KimiDims.load(MINI_JSON), activation_situ_beta=3.0,
                               activation_situ_linear_beta=20.0)
    rng = np.random.default_rng(13)
    b, latent, width, experts_n = 3, dims.routed_expert_hidden_size, 128, 2
    gate, up = rng.normal(0, 8, (b, width)), rng.normal(0, 40, (b, width))
    gate_up = jnp.asarray(np.concatenate([gate, up], 1), F32)

    def want_situ(gate, up, beta=dims.activation_situ_beta, linear_beta=dims.activation_situ_linear_beta):
        return np.asarray(layer_ops.situ(jnp.asarray(gate, F32), jnp.asarray(up, F32), beta, linear_beta))

    want = want_situ(gate, up)
    for mutant in (want_situ(gate, up, beta=1.01 * dims.activation_situ_beta),
                   want_situ(gate, up, linear_beta=1.01 * dims.activation_situ_linear_beta)):
        assert np.max(np.abs(mutant - want)) > 1e-3 * np.max(np.abs(want))
    c = body_layer(dims, per_rank={"shared": width}, matmul=lambda name, h: h)   # h is the product
    shared = lowering.BODIES["moe", "shared_gate_up"]
    np.testing.assert_allclose(shared(c, gate_up), want, rtol=1e-5, atol=1e-5)

    x = rng.normal(0, 1, (b, latent))
    w_gu = [np.concatenate([rng.normal(0, 0.5, (latent, width)), rng.normal(0, 2.5, (latent, width))], 1)
            for _ in range(experts_n)]
    w_d = [rng.normal(0, 0.05, (width, latent)) for _ in range(experts_n)]
    weights = rng.uniform(0.2, 0.8, (b, experts_n))
    act = [want_situ(x @ w[:, :width], x @ w[:, width:]) for w in w_gu]
    want = sum(weights[:, k:k + 1] * (act[k] @ w_d[k]) for k in range(experts_n))
    packed = [{"gate_up": jnp.asarray(w_gu[k], F32), "down": jnp.asarray(w_d[k], F32)}
              for k in range(experts_n)]
    per_rank = {"expert_width": width, "gate_up_group": latent, "down_group": width}
    got = lowered_routed_experts(lowering, dims, per_rank, packed, jnp.asarray(x, F32),
                                 jnp.asarray(weights, F32))
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_kda_head_step_matches_reference_recurrence() -> None:
    """Three tokens through two heads, the state carried in the kernel."""
    rng = np.random.default_rng(1)
    steps, heads, d = 3, 2, 128
    state0 = jnp.asarray(rng.normal(0, 0.3, (heads * d, d)), F32)
    q = l2_normalize(jnp.asarray(rng.normal(size=(steps, heads * d)), F32).reshape(steps, heads, d))
    k = l2_normalize(jnp.asarray(rng.normal(size=(steps, heads * d)), F32).reshape(steps, heads, d))
    v = jnp.asarray(rng.normal(size=(steps, heads * d)), F32)
    decay = jnp.asarray(rng.uniform(-5.0, 0.0, (steps, heads * d)), F32)
    beta = jnp.asarray(rng.uniform(0.0, 1.0, (steps, heads)), F32)
    q, k = (x.reshape(steps, heads * d) * s for x, s in ((q, d ** -0.5), (k, 1.0)))

    def body(s_ref, q_ref, k_ref, v_ref, a_ref, b_ref, o_ref, so_ref):
        for h in range(heads):
            lanes, rows = slice(h * d, (h + 1) * d), slice(h * d, (h + 1) * d)
            state = s_ref[rows, :]
            for t in range(steps):
                o, state = kda_ops.delta_rule_head(state, q_ref[t:t + 1, lanes], k_ref[t:t + 1, lanes],
                                             v_ref[t:t + 1, lanes], a_ref[t:t + 1, lanes],
                                             b_ref[t:t + 1, h:h + 1])
                o_ref[t:t + 1, lanes] = o
            so_ref[rows, :] = state

    o, state = in_kernel(body, [state0, q, k, v, decay, beta],
                         (sds((steps, heads * d)), sds((heads * d, d))))
    want_state = state0.reshape(heads, d, d)
    for t in range(steps):
        split = [x[t].reshape(heads, d) for x in (q, k, v, decay)]
        want_o, want_state = kda_reference.delta_rule_step(want_state, *split[:3], split[3], beta[t])
        np.testing.assert_allclose(o[t].reshape(heads, d), want_o, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(state.reshape(heads, d, d), want_state, rtol=2e-5, atol=2e-5)


def test_kda_decay_matches_formula() -> None:
    rng = np.random.default_rng(2)
    heads, d, b = 2, 128, 4
    gate = rng.normal(0, 1, (b, heads * d)).astype(np.float32)
    a_log = np.log(rng.uniform(1.0, 16.0, heads)).astype(np.float32)
    dt_bias = rng.uniform(-1.0, 0.0, (1, heads * d)).astype(np.float32)
    got = values_in_kernel(lambda g, a, t: kda_ops.log_decay(g, a, t, -5.0),
                           [gate, expand_a_log(a_log, d), dt_bias], sds((b, heads * d)))
    rate = np.repeat(np.exp(a_log.astype(np.float64)), d)
    want = -5.0 / (1.0 + np.exp(-rate * (gate + dt_bias)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got) <= 0)


def test_kda_layer_matches_reference_block(mini: KimiDims) -> None:
    """decay, l2 norms, per-head steps and the gated output norm compose to the KDA kind's
    reference block."""
    cfg = dataclasses.replace(mini, num_attention_heads=2, kda_num_heads=2)
    p = _random_params(cfg, "model.layers.0.self_attn.", seed=3)
    b, nh, d, h = 2, cfg.kda_num_heads, cfg.kda_head_dim, cfg.hidden_size
    rng = np.random.default_rng(4)
    x = jnp.asarray(rng.normal(size=(b, h)), F32)
    conv_state = jnp.asarray(rng.normal(size=(b, 3 * nh * d, cfg.conv_kernel_size - 1)), jnp.bfloat16)
    rec = jnp.asarray(rng.normal(0, 0.3, (b, nh, d, d)), F32)
    want_out, _, want_rec = kda_reference.block(ATTENTION["kda"], p, cfg, x, conv_state, rec)

    # Projections and the short conv happen outside the ops (as in the reference block).
    mixed = jnp.concatenate([linear(x, p[f"{n}_proj.weight"]) for n in "qkv"], axis=-1)
    window = jnp.concatenate([conv_state, mixed.astype(jnp.bfloat16)[:, :, None]], axis=-1)
    taps = jnp.concatenate([p[f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"], axis=0)
    conv = jax.nn.silu(jnp.sum(window.astype(F32) * taps, axis=-1))
    gate = linear(linear(x, p["f_a_proj.weight"]), p["f_b_proj.weight"])
    beta_logit = linear(x, p["b_proj.weight"])
    g = linear(x, p["g_proj.weight"])
    a_log = expand_a_log(np.asarray(p["A_log"]), d)
    pd = cfg.kda_num_heads * cfg.kda_head_dim

    def body(conv_ref, gate_ref, a_ref, dt_ref, bl_ref, g_ref, w_ref, s_ref, o_ref, so_ref):
        decay = kda_ops.log_decay(gate_ref[...], a_ref[...], dt_ref[...], cfg.gate_lower_bound)
        beta = jax.nn.sigmoid(bl_ref[...])
        for r in range(b):
            for hd in range(nh):
                lanes = slice(hd * d, (hd + 1) * d)
                row = slice((r * nh + hd) * d, (r * nh + hd + 1) * d)
                q = layer_ops.l2_normalize(conv_ref[r:r + 1, lanes]) * d ** -0.5
                k = layer_ops.l2_normalize(conv_ref[r:r + 1, pd + hd * d:pd + (hd + 1) * d])
                v = conv_ref[r:r + 1, 2 * pd + hd * d:2 * pd + (hd + 1) * d]
                o, so_ref[row, :] = kda_ops.delta_rule_head(s_ref[row, :], q, k, v, decay[r:r + 1, lanes],
                                                      beta[r:r + 1, hd:hd + 1])
                o_ref[r:r + 1, lanes] = kda_ops.gated_output(o, g_ref[r:r + 1, lanes], w_ref[...],
                                                             cfg.rms_norm_eps)

    args = [conv, gate, a_log, p["dt_bias"][None], beta_logit, g, p["o_norm.weight"][None],
            rec.reshape(b * nh * d, d)]
    o, state = in_kernel(body, args, (sds((b, pd)), sds((b * nh * d, d))))
    np.testing.assert_allclose(linear(o, p["o_proj.weight"]), want_out, rtol=2e-4, atol=2e-5)
    np.testing.assert_allclose(state.reshape(b, nh, d, d), want_rec, rtol=2e-4, atol=2e-5)


def test_absorbed_mla_matches_reference_expanded(mini: KimiDims) -> None:
    """q absorption, latent tiles (visited last tile first, so fully masked tiles meet an empty
    state) and the value up-projection reproduce the reference's expanded attention
    (``mkc.layers.mla.reference.block``)."""
    cfg = dataclasses.replace(mini, num_attention_heads=4, kda_num_heads=4)
    p = _random_params(cfg, "model.layers.3.self_attn.", seed=5)
    b, t_len, tile = 2, 48, 16
    nh, nope, rank = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.kv_lora_rank
    rng = np.random.default_rng(6)
    x = jnp.asarray(rng.normal(size=(b, cfg.hidden_size)), F32)
    cache = jnp.asarray(rng.normal(size=(b, t_len, cfg.kv_lora_rank + cfg.qk_rope_head_dim)), jnp.bfloat16)
    positions = jnp.array([5, 40], jnp.int32)
    want, cache = mla_reference.block(ATTENTION["mla"], p, cfg, x, cache, positions)

    q_latent = rms_norm(linear(x, p["q_a_proj.weight"]), p["q_a_layernorm.weight"], cfg.rms_norm_eps)
    w_q_nope, w_q_extra = mla_weights.split_q_b_proj(np.asarray(p["q_b_proj.weight"]), nh, nope)
    w_uk, w_uv = mla_weights.split_kv_b_proj(np.asarray(p["kv_b_proj.weight"]), nh, nope)
    q_nope = jnp.dot(q_latent, w_q_nope, precision=lax.Precision.HIGHEST)
    q_extra = jnp.dot(q_latent, w_q_extra, precision=lax.Precision.HIGHEST)
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5

    def body(pos_ref, qn_ref, qe_ref, wuk_ref, wuv_ref, cache_ref, o_ref):
        for r in range(b):
            q_lat, q_ext = mla_ops.mla_absorb_query(qn_ref[r:r + 1, :], qe_ref[r:r + 1, :], wuk_ref[...], nh)
            m = jnp.full((nh, 1), -jnp.inf, F32)
            denom, acc = jnp.zeros((nh, 1), F32), jnp.zeros((nh, rank), F32)
            for t in reversed(range(t_len // tile)):
                rows = cache_ref[r, t * tile:(t + 1) * tile, :]
                visible = t * tile + lax.broadcasted_iota(jnp.int32, (1, tile), 1) <= pos_ref[r]
                m, denom, acc = mla_ops.mla_tile(q_lat, q_ext, rows[:, :rank], rows[:, rank:], visible,
                                             m, denom, acc, scale)
            o_ref[r:r + 1, :] = mla_ops.mla_value_up(acc, denom, wuv_ref[...], nh)

    attn = in_kernel(body, [positions, q_nope, q_extra, jnp.asarray(w_uk), jnp.asarray(w_uv), cache],
                     sds((b, nh * cfg.v_head_dim)), in_specs=[SMEM] + [VMEM] * 5)
    got = linear(attn * jax.nn.sigmoid(linear(x, p["g_proj.weight"])), p["o_proj.weight"])
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5)


def test_split_helpers_select_heads() -> None:
    rng = np.random.default_rng(7)
    w = rng.normal(size=(3 * (4 + 2), 8))
    uk, uv = mla_weights.split_kv_b_proj(w, 3, 4, heads=[2, 0])
    per_head = w.reshape(3, 6, 8)
    np.testing.assert_array_equal(uk, np.concatenate([per_head[2, :4], per_head[0, :4]]))
    np.testing.assert_array_equal(uv, np.concatenate([per_head[2, 4:], per_head[0, 4:]]).T)
    qn, qe = mla_weights.split_q_b_proj(w, 3, 4)
    x = rng.normal(size=8)
    full = (w @ x).reshape(3, 6)
    np.testing.assert_allclose(x @ qn, full[:, :4].reshape(-1))
    np.testing.assert_allclose(x @ qe, full[:, 4:].reshape(-1))


def _route_case(dims: KimiDims, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Router logits [5, 128] (the router's product is padded to whole tiles; lanes past the
    MINI's experts hold large values the route must not see) and a correction bias [1, 128],
    rows: 0 random; 1 every score tied, the bias alone picks; 2 ten equal leaders of zero
    bias, the lowest lanes win; 3 a pair the bias reorders by a 0.5 % margin (an unbiased
    route, or one with the bias 1 % short, picks the other); 4 a pair the bias misses
    reordering by a 0.5 % margin (a bias 1 % too large reorders it)."""
    rng = np.random.default_rng(seed)
    n, lanes = dims.experts, 128
    logits = rng.normal(0, 2, (5, lanes)).astype(np.float32)
    bias = rng.normal(0, 0.02, (1, lanes)).astype(np.float32)
    logits[:, n:], bias[:, n:] = 30.0, 10.0
    logits[1, :n] = 0.25
    logits[2, :n] = np.minimum(logits[2, :n], 1.0)
    logits[2, 10:20], bias[0, 10:20] = 3.0, 0.0
    for row, first, margin in ((3, 20, 0.995), (4, 25, 1.005)):
        # experts first .. first + 2 lead; first + 3 (score 0.6, no bias) against first + 4
        # (score 0.5, a bias of 0.1 / margin): the last pick is theirs to split
        logits[row, :n] = -4.0
        logits[row, first:first + 3], bias[0, first:first + 3] = 4.0, 0.0
        logits[row, first + 3], bias[0, first + 3] = np.log(0.6 / 0.4), 0.0
        logits[row, first + 4], bias[0, first + 4] = 0.0, 0.1 / margin
    return logits, bias


def test_the_lowered_route_matches_reference_where_the_bias_decides() -> None:
    """The lowered route (the MINI's experts, top k and a routing scale of 2.5) over the
    router's padded product and the correction bias vector: the reference's picks, best first
    and ties to the lowest lane, and weights, also where the bias decides a pick by less than
    1 % of itself (so a bias off by 1 % either way, or none, picks otherwise); the picks go to
    select_experts, and as SMEM scalars read a weight column back as an expert DMA would."""
    dims = dataclasses.replace(KimiDims.load(MINI_JSON), routed_scaling_factor=2.5)
    n, k = dims.experts, dims.top_k
    logits, bias = _route_case(dims, seed=8)
    b = logits.shape[0]

    def ref_ids(scale: float) -> np.ndarray:
        """The reference's picks with the bias times ``scale``."""
        biased = scale * jnp.asarray(bias[:, :n])
        return np.asarray(moe_reference.route(jnp.asarray(logits[:, :n]), k, True, "sigmoid", biased,
                                              dims.routed_scaling_factor)[0])

    want_ids, want_w = moe_reference.route(jnp.asarray(logits[:, :n]), k, True, "sigmoid",
                                           jnp.asarray(bias[:, :n]), dims.routed_scaling_factor)
    want_ids = np.asarray(want_ids)
    def rows_picking_otherwise(scale: float) -> list[int]:
        return [r for r in range(b) if not np.array_equal(ref_ids(scale)[r], want_ids[r])]

    # the regime: the bias decides row 3's picks (without it rows 0 and 1 pick otherwise too),
    # and a 1 % error in it either way changes row 3's or row 4's
    assert rows_picking_otherwise(0.0) == [0, 1, 3]
    assert rows_picking_otherwise(0.99) == [3] and rows_picking_otherwise(1.01) == [4]

    def body(lg_ref, bias_ref, w_ref, ids_ref, selected_ref, ids_smem, picked_ref):
        def select_experts(ids):
            selected_ref[...] = ids
        c = body_layer(dims, {"correction_bias": bias_ref[...]}, select_experts=select_experts)
        ids, weights = lowering.BODIES["moe", "route"](c, lg_ref[...])
        w_ref[...], ids_ref[...] = weights, ids
        for r in range(b):
            for j in range(k):
                ids_smem[r * k + j] = experts.expert_id(ids, r, j)
        # Read one id back as a scalar, as an expert DMA would, and fetch its weight column.
        picked_ref[...] = experts.expert_weight(weights, ids_smem[k + 2])

    weights, ids, selected, ids_flat, picked = in_kernel(
        body, [jnp.asarray(logits), jnp.asarray(bias)],
        (sds((b, n)), sds((b, k), jnp.int32), sds((b, k), jnp.int32), sds((b * k,), jnp.int32),
         sds((b, 1))),
        out_specs=(VMEM, VMEM, VMEM, SMEM, VMEM))
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_array_equal(selected, want_ids)
    np.testing.assert_array_equal(np.asarray(ids_flat).reshape(b, k), want_ids)
    np.testing.assert_array_equal(want_ids[2], np.arange(10, 10 + k))
    np.testing.assert_allclose(np.take_along_axis(np.asarray(weights), want_ids, 1), want_w, rtol=1e-6)
    assert np.count_nonzero(weights) == b * k
    np.testing.assert_allclose(picked[:, 0], np.asarray(weights)[:, int(want_ids[1, 2])])


def _random_mxfp4(rng: np.random.Generator, n_out: int, n_in: int,
                  scale_range: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """Every byte value of codes somewhere, scales uniform in scale_range (inclusive)."""
    codes = rng.integers(0, 256, (n_out, n_in // 2)).astype(np.uint8)
    codes.reshape(-1)[:256] = np.arange(256)
    scales = rng.integers(scale_range[0], scale_range[1] + 1, (n_out, n_in // 32)).astype(np.uint8)
    return codes, scales


def _dequantize_groups(codes_k: jax.Array, scales_k: jax.Array, group: int, dtype) -> jax.Array:
    n_in, n_out = 2 * codes_k.shape[0], codes_k.shape[1]

    def fn(c, s):  # one mxfp4_dequantize_tile per pack group, stacked down the rows
        half, blocks, bias = group // 2, group // 32, format_ops.mxfp4_scale_bias(s)
        return jnp.concatenate([format_ops.mxfp4_dequantize_tile(c[g * half:(g + 1) * half],
                                                                 bias[g * blocks:(g + 1) * blocks], dtype)
                                for g in range(n_in // group)], axis=0)
    return values_in_kernel(fn, [codes_k, scales_k], sds((n_in, n_out), dtype))


@pytest.mark.parametrize("dtype, group", [(F32, 128), (jnp.bfloat16, 64), (jnp.bfloat16, 192)])
def test_mxfp4_tile_decodes_exactly(dtype, group) -> None:
    """Every code under scales 2..252 (every product normal, the largest 6 * 2**125) decodes
    bit-exactly, for pack groups whose quarters hold half a 32-row block, whole blocks, or
    straddle one."""
    rng = np.random.default_rng(9)
    n_out, n_in = 128, 384
    codes, scales = _random_mxfp4(rng, n_out, n_in, (2, 252))
    scales.reshape(-1)[:2] = (2, 252)
    codes_k, scales_k = format_weights.pack_mxfp4_for_kernel(codes, scales, group)
    got = np.asarray(_dequantize_groups(jnp.asarray(codes_k), jnp.asarray(scales_k), group, dtype))
    want = mxfp4_dequantize(codes, scales, (n_out, n_in)).T
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(dtype).astype(np.float32))


@pytest.mark.parametrize("scale, code, what", [(255, 0x11, "a scale of 255"),
                                               (253, 0x70, "past bf16's range"),
                                               (254, 0x41, "past bf16's range")])
def test_mxfp4_packing_refuses_what_the_decode_cannot_hold(scale, code, what) -> None:
    """A NaN scale, or a value past bf16's range (4 under 253, 2 under 254), is a ValueError
    naming the row, input, block and scale; 1.5 under the largest scale and 6 under 252
    pack."""
    codes = np.zeros((2, 32), np.uint8)
    scales = np.full((2, 2), 127, np.uint8)
    codes[1, 3], scales[1, 0] = code, scale
    with pytest.raises(ValueError, match=rf"row 1, input \d+ \(block 0, scale {scale}\): .*{what}"):
        format_weights.pack_mxfp4_for_kernel(codes, scales, 64)
    codes[1, 3], scales[1, 0] = 0x33, 254
    format_weights.pack_mxfp4_for_kernel(codes, scales, 64)
    codes[1, 3], scales[1, 0] = 0x77, 252
    format_weights.pack_mxfp4_for_kernel(codes, scales, 64)


def test_mxfp4_tile_small_scales_flush_subnormals() -> None:
    """Scale 0 decodes to zero and scale 1's subnormal +-2**-127 flushes; the rest is exact."""
    rng = np.random.default_rng(10)
    codes, scales = _random_mxfp4(rng, 128, 128, (0, 3))
    codes_k, scales_k = format_weights.pack_mxfp4_for_kernel(codes, scales, 64)
    got = np.asarray(_dequantize_groups(jnp.asarray(codes_k), jnp.asarray(scales_k), 64, F32))
    want = mxfp4_dequantize(codes, scales, (128, 128)).T
    zero = (np.repeat(scales.T, 32, axis=0) == 0) | (np.abs(want) < np.finfo(np.float32).tiny)
    assert zero.any() and not zero.all()
    np.testing.assert_array_equal(got, np.where(zero, 0.0, want))


def test_mxfp4_kernel_packing_round_trips() -> None:
    rng = np.random.default_rng(11)
    w = rng.normal(size=(64, 384))
    codes, scales = mxfp4_quantize(w)
    for group in (64, 128, 384):
        codes_k, scales_k = format_weights.pack_mxfp4_for_kernel(codes, scales, group)
        assert codes_k.shape == (192, 64) and scales_k.shape == (12, 64)
        back = format_weights.unpack_mxfp4_from_kernel(codes_k, scales_k, group)
        np.testing.assert_array_equal(back[0], codes)
        np.testing.assert_array_equal(back[1], scales)
    # Group 1 of 128 rows, word 2: input rows 128 + 32 q + 4 and + 5 at MXFP4_LAYOUT[q]'s bits.
    nibbles = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(64, 384)
    codes_k, _ = format_weights.pack_mxfp4_for_kernel(codes, scales, 128)
    word = codes_k[64 + 8:64 + 12].astype(np.uint32)
    word = word[0] | word[1] << 8 | word[2] << 16 | word[3] << 24
    recode = np.array([1, 0, 2, 3, 4, 5, 6, 7], np.uint32)
    for q, (sign, *mag) in enumerate(expert_formats.MXFP4_LAYOUT):
        for h in (0, 1):
            code = nibbles[:, 128 + 32 * q + 4 + h].astype(np.uint32)
            c = sum(((word >> (bit + 16 * h)) & 1) << (2 - i) for i, bit in enumerate(mag))
            np.testing.assert_array_equal(c, recode[code & 7])
            np.testing.assert_array_equal((word >> (sign + 16 * h)) & 1, (code >> 3) & ((code & 7) > 0))
    with pytest.raises(ValueError):
        format_weights.pack_mxfp4_for_kernel(codes, scales, 96)


def _mix_case(dims: KimiDims, seed: int):
    """Block attention residuals of ``dims``' layers through the reference's own block
    bookkeeping (its stream through `BlockMix` and `BlockAdd`, random sublayer outputs), recording each
    sublayer's sources ``[B, N, H]`` (and the final mixture's, as sublayer 2 * layers). The
    projections are drawn small enough that the mixture is no one-hot: a score off by 1 %
    moves it."""
    rng = np.random.default_rng(seed)
    b, h = 2, dims.hidden_size
    vectors = {name: jnp.asarray(1.0 + rng.normal(0, 0.1, (1, h)), F32)
               for name in ("attn_res_norm", "mlp_res_norm", "input_norm", "post_norm")}
    vectors |= {name: jnp.asarray(rng.normal(0, 0.08, (1, h)), F32)
                for name in ("attn_res_proj", "mlp_res_proj")}
    embedding = jnp.asarray(rng.normal(0, 1, (b, h)), F32)
    outputs = [jnp.asarray(rng.normal(0, 0.3 + 0.2 * (j % 3), (b, h)), F32)
               for j in range(2 * dims.num_hidden_layers)]
    sources = {}
    stream = block_reference.BLOCK_RESIDUALS.start(embedding)
    for j, out in enumerate(outputs):
        place = ("attn", "mlp")[j % 2]
        query = block_reference.QUERIES[place]
        lp = {f"{query}_norm.weight": jnp.ones(h, F32), f"{query}_proj.weight": jnp.zeros((1, h), F32),
              block_reference.NORM_WEIGHTS[place]: jnp.ones(h, F32)}
        stream = block_reference.forward(BlockMix(place), lp, dims, stream, {}, j // 2, None, None, "")
        sources[j] = stream.visible()
        stream = block_reference.forward(BlockAdd(place), {}, dims, stream.leave(out), {}, j // 2, None, None,
                                         "")
    sources[len(outputs)] = stream.visible()
    return vectors, sources


def _kernel_blocks(stacked: jax.Array, slots: int) -> jax.Array:
    """The kernel's residual block buffer ``[slots, B, H]`` holding ``stacked``'s N sources
    first; the slots past them hold stale memory (NaN), which the mixture must not touch."""
    n = stacked.shape[1]
    stale = jnp.full((slots - n, *stacked.shape[::2]), jnp.nan, F32)
    return jnp.concatenate([jnp.transpose(stacked, (1, 0, 2)), stale])


def test_the_lowered_residual_mixtures_are_the_references() -> None:
    """The residual mixture the kernel forms, ``block_lowering.residual_mix`` over the block buffer with
    its stale slots and a traced source count, is the reference's attention residual over the
    sources its block bookkeeping holds; and the lowered bodies that call it, input_mix and
    mlp_mix (every sublayer of the MINI's layers, the loop layer traced from SMEM as the
    kernel's is) and final_hidden, count those sources and norm the mixture as the reference
    does. Each mixture over two sources or more is one that a 1 % error in its scores
    changes."""
    dims = KimiDims.load(MINI_JSON)
    vectors, sources = _mix_case(dims, seed=12)
    slots, eps = block_residuals.slots(dims), dims.rms_norm_eps
    layers = 2 * dims.num_hidden_layers
    assert len(dims.layer_kinds) == layers and max(s.shape[1] for s in sources.values()) == slots - 1

    def weights(j: int) -> tuple[str, str, str]:
        """The vectors of sublayer j's mixture norm and projection and of its output norm (the
        final mixture, j = 2 * layers, takes some of them: its own are head_norm's rows)."""
        if j == layers:
            return "input_norm", "attn_res_proj", "post_norm"
        prefix, out = ("attn", "input_norm") if j % 2 == 0 else ("mlp", "post_norm")
        return prefix + "_res_norm", prefix + "_res_proj", out

    def want_mix(j: int, proj_scale: float = 1.0) -> np.ndarray:
        norm_w, proj_w, _ = (vectors[n] for n in weights(j))
        return np.asarray(block_reference.attention_residual(sources[j], norm_w[0], proj_scale * proj_w, eps))

    def want(j: int, proj_scale: float = 1.0) -> np.ndarray:
        return np.asarray(rms_norm(want_mix(j, proj_scale), vectors[weights(j)[2]][0], eps))

    # final_hidden's head_norm rows: its final norm, then the output mixture's norm and projection
    mix_norm, mix_proj, final_norm = weights(layers)
    head_norm = jnp.concatenate([vectors[final_norm], vectors[mix_norm], vectors[mix_proj]])

    names, b = tuple(vectors), sources[0].shape[0]

    def body(index_ref, count_ref, blocks_ref, vectors_ref, head_ref, o_ref, o_mix):
        rows = {name: vectors_ref[i:i + 1, :] for i, name in enumerate(names)}
        for j in range(layers + 1):             # sublayer j's block buffer and loop layer
            blocks = [blocks_ref[j, i] for i in range(slots)]
            norm_w, proj_w = (rows[n] for n in weights(j)[:2])
            o_mix[j * b:(j + 1) * b, :] = block_lowering.residual_mix(blocks, count_ref[j], norm_w, proj_w,
                                                                       eps)
            kernel = types.SimpleNamespace(refs=types.SimpleNamespace(blocks=blocks_ref.at[j]), dims=dims,
                                           layers=layers)
            if j == layers:
                mixed = lowering.final_hidden(kernel, head_ref)
            else:
                c = body_layer(dims, rows, kernel=kernel, index=index_ref[j])
                mix = lowering.BODIES["kda", "input_mix"] if j % 2 == 0 else lowering.BODIES["moe", "mlp_mix"]
                mixed = mix(c)
            o_ref[j * b:(j + 1) * b, :] = mixed

    args = [jnp.arange(layers + 1, dtype=jnp.int32),
            jnp.array([sources[j].shape[1] for j in range(layers + 1)], jnp.int32),
            jnp.stack([_kernel_blocks(sources[j], slots) for j in range(layers + 1)]),
            jnp.concatenate([vectors[n] for n in names]), head_norm]
    out = sds(((layers + 1) * b, dims.hidden_size))
    got, got_mix = in_kernel(body, args, (out, out), in_specs=[SMEM, SMEM] + [VMEM] * 3)
    for j in range(layers + 1):
        rows = slice(j * b, (j + 1) * b)
        np.testing.assert_allclose(got_mix[rows], want_mix(j), rtol=2e-5, atol=2e-6, err_msg=f"mix {j}")
        np.testing.assert_allclose(got[rows], want(j), rtol=2e-5, atol=2e-6, err_msg=f"sublayer {j}")
        if sources[j].shape[1] > 1:
            assert np.max(np.abs(want(j, 1.01) - want(j))) > 3e-4 * np.max(np.abs(want(j))), j


# ---------------------------------------------------------------------------------------------
# Compile-only: one kernel using every op, lowered through Mosaic and compiled by libtpu.

COMPILE_SCRIPT = r'''
import os
os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl, topologies
from jax.experimental.pallas import tpu as pltpu
from mkc.layers import ops as layer_ops
from mkc.layers.block_residuals import lowering as block_lowering
from mkc.layers.mla import ops as mla_ops
from mkc.layers.mla import weights as mla_weights
from mkc.layers.moe.lowering import sigmoid_route_weights
from mkc.layers.expert_formats import ops as format_ops
from mkc.layers.kda import ops as kda_ops
from mkc.layers.ops import l2_normalize
from mkc.reference.rounding import chunked_linear
from mkc.runtime import experts

F32, BF16, U8, I32 = jnp.float32, jnp.bfloat16, jnp.uint8, jnp.int32
B, H, D, NH, R, EX, T, TILE, E, K, G, N = 8, 512, 128, 12, 512, 64, 256, 64, 256, 8, 256, 256
V = pl.BlockSpec(memory_space=pltpu.VMEM)
S = pl.BlockSpec(memory_space=pltpu.SMEM)

def kernel(pos, x, gate, a_log, dt, state, qkv, qn, qe, wuk, wuv, cache, logits, bias, codes, scales,
           src, norm_w, proj_w, o_x, o_kda, o_state, o_mla, o_moe, o_ids, o_res):
    o_x[...] = layer_ops.situ_packed(x[...], H // 2)
    decay = kda_ops.log_decay(gate[...], a_log[...], dt[...], -5.0)
    q = l2_normalize(qkv[0:1, :D]) * D ** -0.5
    k = l2_normalize(qkv[1:2, :D])
    o, o_state[...] = kda_ops.delta_rule_head(state[...], q, k, qkv[2:3, :D], decay[0:1, :D],
                                        jax.nn.sigmoid(qkv[3:4, 0:1]))
    o_kda[...] = kda_ops.gated_output(o, qkv[3:4, :D], norm_w[:, :D], 1e-5)

    q_lat, q_ext = mla_ops.mla_absorb_query(qn[...], qe[...], wuk[...], NH)
    def tile(t, carry):
        start = pl.multiple_of(t * TILE, TILE)
        rows = cache[pl.ds(start, TILE), :]
        visible = start + lax.broadcasted_iota(I32, (1, TILE), 1) <= pos[0]
        return mla_ops.mla_tile(q_lat, q_ext, rows[:, :R], rows[:, R:], visible, *carry, NH ** -0.5)
    init = (jnp.full((NH, 1), -jnp.inf, F32), jnp.zeros((NH, 1), F32), jnp.zeros((NH, R), F32))
    m, denom, acc = lax.fori_loop(0, T // TILE, tile, init)
    o_mla[...] = mla_ops.mla_value_up(acc, denom, wuv[...], NH)

    weights, ids = sigmoid_route_weights(logits[...], bias[...], K, True, 2.0)
    for r in range(B):
        for j in range(K):
            o_ids[r * K + j] = experts.expert_id(ids, r, j)
    w = format_ops.mxfp4_dequantize_tile(codes[...], scales[...], BF16)
    y = jnp.dot(x[:, :G].astype(BF16), w, preferred_element_type=F32)
    o_moe[...] = y * experts.expert_weight(weights, o_ids[3])

    parts = [src[i * B:(i + 1) * B, :] for i in range(3)]
    o_res[...] = block_lowering.residual_mix(parts, pos[0] % 3 + 1, norm_w[...], proj_w[...], 1e-5)

args = [((1,), I32), ((B, H), F32), ((B, 2 * D), F32), ((1, 2 * D), F32), ((1, 2 * D), F32),
        ((D, D), F32), ((4, D), F32), ((1, NH * 128), F32), ((1, NH * EX), F32),
        ((NH * 128, R), BF16), ((R, NH * 128), BF16), ((T, R + EX), BF16), ((B, E), F32),
        ((1, E), F32), ((G // 2, N), U8), ((G // 32, N), U8), ((3 * B, H), F32), ((1, H), F32),
        ((1, H), F32)]
outs = (jax.ShapeDtypeStruct((B, H // 2), F32), jax.ShapeDtypeStruct((1, D), F32),
        jax.ShapeDtypeStruct((D, D), F32), jax.ShapeDtypeStruct((1, NH * 128), F32),
        jax.ShapeDtypeStruct((B, N), F32), jax.ShapeDtypeStruct((B * K,), I32),
        jax.ShapeDtypeStruct((B, H), F32))
call = pl.pallas_call(kernel, out_shape=outs, in_specs=[S] + [V] * (len(args) - 1),
                      out_specs=(V, V, V, V, V, S, V))
topo = topologies.get_topology_desc("tpu7x=2x2x1", platform="tpu")
sharding = jax.sharding.SingleDeviceSharding(topo.devices[0])
jax.jit(call).lower(*[jax.ShapeDtypeStruct(s, d, sharding=sharding) for s, d in args]).compile()
print("compiled for tpu7x")
'''


@pytest.mark.slow
def test_all_ops_compile_for_tpu7x(tmp_path: Path) -> None:
    script = tmp_path / "k3_ops_compile.py"
    script.write_text(COMPILE_SCRIPT)
    r = run_python([str(script)], timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    assert "compiled for tpu7x" in r.stdout


@pytest.mark.parametrize("group", [64, 128])
def test_fp8_codes_decode_to_the_same_bf16_weights_as_their_mxfp4(group) -> None:
    """`format expert.* fp8`: the packed FP8 codes (the e2m1 values as e4m3 bytes, same E8M0
    scales) decode in the kernel to exactly the bf16 weights the MXFP4 decode gives, for every
    code and for scales 2..252, and with whole (G, 128) tiles."""
    rng = np.random.default_rng(11)
    n_out, n_in = 128, 256
    codes, scales = _random_mxfp4(rng, n_out, n_in, (2, 252))
    codes_k, scales_k = format_weights.pack_mxfp4_for_kernel(codes, scales, group)
    fp8, fp8_scales = format_weights.fp8_codes_from_kernel_mxfp4(codes_k, scales_k, group)
    assert fp8.shape == (n_in, n_out) and fp8.dtype == np.uint8
    np.testing.assert_array_equal(fp8_scales, scales_k)

    def fn(c, s):
        blocks = group // 32
        return jnp.concatenate([format_ops.fp8_block_scaled_tile(c[g * group:(g + 1) * group],
                                                                 s[g * blocks:(g + 1) * blocks])
                                for g in range(n_in // group)], axis=0)
    got = values_in_kernel(fn, [jnp.asarray(fp8), jnp.asarray(scales_k)],
                           sds((n_in, n_out), jnp.bfloat16))
    want = _dequantize_groups(jnp.asarray(codes_k), jnp.asarray(scales_k), group, jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(want).view(np.uint16))


def test_fp8_blocks_of_whole_groups_give_the_same_f32_sums() -> None:
    """`format expert.* fp8 block N`: a block's 32-row scales folded into the codes (exactly:
    spreads up to 8 octaves), the codes fed to one mixed bf16 x fp8 dot per pack group and the
    block's scale applied to its partial product. In interpret mode that is, bit for bit, what
    the emulation's "mixed_fp8" dot of the decoded values gives (and not its bf16 dot: the
    choice matters); a wider spread is refused."""
    rng = np.random.default_rng(12)
    n_out, n_in, group, block, batch = 384, 1024, 512, 512, 8
    codes, scales = _random_mxfp4(rng, n_out, n_in, (110, 118))      # spreads up to 8 octaves
    codes_k, scales_k = format_weights.pack_mxfp4_for_kernel(codes, scales, group)
    fp8, top = format_weights.fp8_codes_from_kernel_mxfp4(codes_k, scales_k, group, block)
    assert top.shape == (n_in // block, n_out)
    assert expert_formats.feeds_codes(WeightFormat("fp8", block))
    assert not expert_formats.feeds_codes(WeightFormat("fp8", block, fp8_operand=False))     # v4
    x = jnp.asarray(rng.standard_normal((batch, n_in)), jnp.bfloat16)

    def blocked(as_codes):
        def fn(x, c, s):
            parts = [format_ops.fp8_group_matmul(
                x[:, g * group:(g + 1) * group], c[g * group:(g + 1) * group],
                format_ops.e8m0_scale(s[g * group // block:g * group // block + 1]), as_codes)
                     for g in range(n_in // group)]
            return sum(parts[1:], parts[0])
        return fn

    args = [x, jnp.asarray(fp8), jnp.asarray(top)]
    fed = values_in_kernel(blocked(True), args, sds((batch, n_out), F32))
    converted = values_in_kernel(blocked(False), args, sds((batch, n_out), F32))
    values = _dequantize_groups(jnp.asarray(codes_k), jnp.asarray(scales_k), group, F32)   # [in, out]
    w = jnp.transpose(values)                                                             # [out, in]
    np.testing.assert_array_equal(np.asarray(fed), np.asarray(chunked_linear(x, w, group, "mixed_fp8")))
    np.testing.assert_array_equal(np.asarray(converted), np.asarray(chunked_linear(x, w, group, "bf16")))
    assert not np.array_equal(np.asarray(fed), np.asarray(converted))
    wide = scales.copy()
    wide[0, 0] = 100                                   # one block spans 10 octaves or more
    wide_k = format_weights.pack_mxfp4_for_kernel(codes, wide, group)[1]
    with pytest.raises(ValueError, match=r"fall below FP8's range: .* span 1[0-8] octaves"):
        format_weights.fp8_codes_from_kernel_mxfp4(codes_k, wide_k, group, block)
