"""GPT-OSS weights cut per rank (mkc.families.gpt_oss.weights) from the MINI checkpoint table:
the graph's shapes, every published tensor read, per-rank products that make the full layer's
(q/k/v with biases per head part, o_proj's partial sums), routed experts whose packed MXFP4
(or FP8) bytes decode to the checkpoint's expert and compute upstream's expert with its biases
(also with a width that needs lane padding), and the KV caches gathered back."""
from __future__ import annotations

import json

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mkc.families.gpt_oss import graph as g
from mkc.families.gpt_oss import lowering
from mkc.families.gpt_oss import reference as ref
from mkc.families.gpt_oss import weights as gw
from mkc.layers.expert_formats.weights import unpack_mxfp4_from_kernel
from mkc.ir import WeightFormat
from mkc.model.config import CONFIG_DIR
from mkc.model.mxfp4 import mxfp4_dequantize
from mkc.model.sharding import ShardTable
from tests_support import lowered_routed_experts

MINI_RAW = json.loads((CONFIG_DIR / "gpt_oss_mini.json").read_text())
MINI = ref.load_config(MINI_RAW)
# A width of 96 (not whole 128-lane tiles): the expert halves are padded to 128
NARROW = ref.load_config(MINI_RAW | {"intermediate_size": 96})


def rules(ranks: int) -> dict[str, tuple[int, int]]:
    return {"heads": (ranks, 1), "vocab": (ranks, 1), "experts": (ranks, 1)}


@pytest.fixture(scope="module")
def hf() -> dict[str, np.ndarray]:
    return ref.init_params(MINI, seed=3)


@pytest.fixture(scope="module")
def narrow() -> dict[str, np.ndarray]:
    return ref.init_params(NARROW, seed=4)


def f32(a) -> np.ndarray:
    return np.asarray(a).astype(np.float64)


class Reads(dict):
    """A checkpoint that records the names read."""

    def __init__(self, hf):
        super().__init__(hf)
        self.read: set[str] = set()

    def __getitem__(self, name):
        self.read.add(name)
        return super().__getitem__(name)


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_tensor_has_the_graphs_shape_and_every_published_tensor_is_read(hf, ranks):
    """At 4 ranks MINI's 2 KV heads are replicated over its 4 head parts."""
    fg = g.build(MINI, rules(ranks), ranks)
    shards = ShardTable.of(rules(ranks), ranks)
    seen = Reads(hf)
    for layer, kind in enumerate(MINI.layer_kinds):
        for t in fg.kinds[kind].tensors.values():
            for rank in range(ranks):
                if t.role == "matrix":
                    got = gw.matrix(seen, MINI, fg.per_rank, layer, kind, t.name, rank, shards).shape
                elif t.role == "vector":
                    got = gw.layer_vector(seen, MINI, fg.per_rank, layer, kind, t.name, rank, shards).shape
                    assert got[0] == 1
                    got = got[1:]
                else:
                    continue
                assert got == t.shape, (layer, kind, t.name, rank)
        if kind == "moe":
            for rank in range(ranks):
                for local in range(fg.per_rank["local_experts"]):
                    arrays = gw.expert(seen, MINI, fg.per_rank, layer, local, rank, shards)
                    assert {n: a.shape for n, a in arrays.items()} == \
                        {n: t.shape for n, t in fg.experts.items()}
                    assert {n: a.dtype for n, a in arrays.items()} == {
                        n: np.dtype(np.uint8 if t.dtype == "u8" else ml_dtypes.bfloat16)
                        for n, t in fg.experts.items()}
    for rank in range(ranks):
        assert gw.matrix(seen, MINI, fg.per_rank, -1, "tail", "lm_head", rank, shards).shape == \
            fg.globals["lm_head"].shape
        assert gw.embedding(seen, MINI, rank, shards).shape == fg.globals["embed"].shape
        assert gw.head_vectors(seen, MINI, rank, shards).shape == (1, MINI.hidden_size)
    assert seen.read == set(ref.param_shapes(MINI))


@pytest.mark.parametrize("ranks", [2, 4])
def test_each_head_part_projects_its_heads_and_o_proj_parts_sum_to_the_whole(hf, ranks):
    """x @ qkv + qkv_bias on a rank is the checkpoint's q of its query heads, then k and v of
    the KV head(s) they read (h // 2); the ranks' o_proj partial products sum to o_proj; the
    sinks are the rank's heads'."""
    fg = g.build(MINI, rules(ranks), ranks)
    shards = ShardTable.of(rules(ranks), ranks)
    d, hd, layer = MINI, MINI.head_dim, 2                    # sublayer 2: model layer 1 (gqa)
    p = "model.layers.1.self_attn."
    x = np.random.default_rng(0).normal(0, 1, (3, d.hidden_size))
    proj = {n: (x @ f32(hf[p + f"{n}.weight"]).T + f32(hf[p + f"{n}.bias"])).reshape(3, -1, hd)
            for n in ("q_proj", "k_proj", "v_proj")}
    nq = fg.per_rank["nq"]
    core = np.random.default_rng(1).normal(0, 1, (3, d.num_attention_heads * hd))
    total = 0
    for rank in range(ranks):
        heads = list(range(rank * nq, (rank + 1) * nq))
        kv = sorted({h // (d.num_attention_heads // d.num_key_value_heads) for h in heads})
        got = (x @ gw.matrix(hf, d, fg.per_rank, layer, "gqa", "qkv", rank, shards)
               + gw.layer_vector(hf, d, fg.per_rank, layer, "gqa", "qkv_bias", rank, shards))
        want = np.concatenate([proj["q_proj"][:, heads].reshape(3, -1)]
                              + [proj[n][:, kv].reshape(3, -1) for n in ("k_proj", "v_proj")], axis=1)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        sinks = gw.layer_vector(hf, d, fg.per_rank, layer, "gqa", "sinks", rank, shards)[0]
        np.testing.assert_array_equal(sinks, f32(hf[p + "sinks"])[heads])
        cols = slice(rank * nq * hd, (rank + 1) * nq * hd)
        total = total + core[:, cols] @ gw.matrix(hf, d, fg.per_rank, layer, "gqa", "o_proj", rank, shards)
    np.testing.assert_allclose(total, core @ f32(hf[p + "o_proj.weight"]).T, rtol=1e-5, atol=1e-5)
    o_bias = gw.layer_vector(hf, d, fg.per_rank, layer, "gqa", "o_bias", 0, shards)
    np.testing.assert_array_equal(o_bias[0], f32(hf[p + "o_proj.bias"]))
    router = gw.matrix(hf, d, fg.per_rank, 3, "moe", "router", ranks - 1, shards)
    np.testing.assert_array_equal(router, f32(hf["model.layers.1.mlp.router.weight"]).T)


def decoded(arrays: dict[str, np.ndarray], name: str, group: int, fmt: str = "mxfp4") -> np.ndarray:
    """A packed expert matrix back to f32 `[in, out]` values: MXFP4 codes through the
    checkpoint layout and `mxfp4_dequantize`, FP8 codes as e4m3 times 2^(scale - 127) per 32
    rows."""
    codes, scales = arrays[f"{name}_codes"], arrays[f"{name}_scales"]
    if fmt == "fp8":
        values = codes.view(ml_dtypes.float8_e4m3fn).astype(np.float64)
        block = values.shape[0] // scales.shape[0]
        return values * np.exp2(np.repeat(scales.astype(np.float64) - 127, block, axis=0))
    ck_codes, ck_scales = unpack_mxfp4_from_kernel(codes, scales, group)
    return mxfp4_dequantize(ck_codes, ck_scales, (codes.shape[1], 2 * codes.shape[0])).T


def upstream_expert(hf, d, layer: int, e: int, x: np.ndarray) -> np.ndarray:
    """GptOssExperts for expert e of model layer `layer` from the checkpoint's own tensors."""
    p = f"model.layers.{layer}.mlp.experts."
    mats = {}
    for m, (out, k) in {"gate_up_proj": (2 * d.intermediate_size, d.hidden_size),
                        "down_proj": (d.hidden_size, d.intermediate_size)}.items():
        blocks = np.asarray(hf[p + f"{m}_blocks"][e])
        mats[m] = mxfp4_dequantize(blocks.reshape(out, -1), np.asarray(hf[p + f"{m}_scales"][e]), (out, k))
    gate_up = x @ mats["gate_up_proj"].T + f32(hf[p + "gate_up_proj_bias"][e])
    gate, up = np.minimum(gate_up[:, ::2], d.swiglu_limit), np.clip(gate_up[:, 1::2], -7.0, 7.0)
    act = (up + 1) * gate / (1 + np.exp(-d.swiglu_alpha * gate))
    return act @ mats["down_proj"].T + f32(hf[p + "down_proj_bias"][e])


@pytest.mark.parametrize("dims,params", [(MINI, "hf"), (NARROW, "narrow")])
def test_a_packed_expert_computes_upstreams_expert(dims, params, request):
    """Rank 1's local expert 2 at 2 ranks is expert 1 * 4 + 2 = 6 of the layer: its packed
    bytes decode to the checkpoint's matrices (de-interleaved, padded with zeros) and, through
    the lowered routed_experts body with its bf16 biases, give upstream's expert output."""
    hf = request.getfixturevalue(params)
    fg = g.build(dims, rules(2), 2)
    shards = ShardTable.of(rules(2), 2)
    arrays = gw.expert(hf, dims, fg.per_rank, 3, 2, 1, shards)
    groups = g.pack_groups(dims)
    half = fg.per_rank["expert_half"]
    assert half == (128 if dims is NARROW else 256)
    x = np.random.default_rng(2).normal(0, 1, (4, dims.hidden_size))
    want = upstream_expert(hf, dims, 1, 6, x)
    packed = dict(gate_up=decoded(arrays, "gate_up", groups["gate_up"]),
                  gate_up_bias=f32(arrays["gate_up_bias"]),
                  down=decoded(arrays, "down", groups["down"]), down_bias=f32(arrays["down_bias"]))
    i = dims.intermediate_size
    assert not packed["gate_up"][:, i:half].any() and not packed["down"][i:].any()
    got = lowered_routed_experts(lowering, dims, fg.per_rank,
                                 [{n: jnp.asarray(a, jnp.float32) for n, a in packed.items()}],
                                 jnp.asarray(x, jnp.float32), jnp.ones((len(x), 1), jnp.float32))
    np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)
    # another expert's bytes (expert 5, rank 1's local 1) compute something else
    other = upstream_expert(hf, dims, 1, 5, x)
    assert np.max(np.abs(other - want)) > 0.1 * np.max(np.abs(want))


def test_fp8_experts_hold_the_same_values(hf):
    """`format expert.* fp8`: e4m3 codes at the checkpoint's 32-row scales, or one scale for
    the whole matrix, decode to exactly the MXFP4 expert's values."""
    fg = g.build(MINI, rules(2), 2)
    shards = ShardTable.of(rules(2), 2)
    groups = g.pack_groups(MINI)
    mx = gw.expert(hf, MINI, fg.per_rank, 1, 0, 0, shards)
    fp8 = gw.expert(hf, MINI, fg.per_rank, 1, 0, 0, shards,
                    {"expert.gate_up": WeightFormat("fp8"), "expert.down": WeightFormat("fp8", 1 << 20)})
    assert fp8["gate_up_codes"].shape == (MINI.hidden_size, 512) and fp8["down_scales"].shape == (1, 256)
    for name in ("gate_up", "down"):
        np.testing.assert_array_equal(decoded(fp8, name, groups[name], "fp8"),
                                      decoded(mx, name, groups[name]))
        np.testing.assert_array_equal(fp8[f"{name}_bias"], mx[f"{name}_bias"])


@pytest.mark.parametrize("ranks", [2, 4])
def test_kv_caches_gather_back_to_the_reference_layout_and_are_written_back(ranks):
    """Per-rank caches `[layers of the kind, B, slots, nkv * D]`, rank r holding its part's KV
    heads (at 4 parts, the replica of head r // 2), gather into `[B, Hkv, slots, D]` per
    model layer; a sliding cache of a kernel's larger KV ring (`kv ring N slots`) keeps its N
    slots, and one of a context within the window is padded with unwritten slots to it."""
    fg = g.build(MINI, rules(ranks), ranks)
    shards = ShardTable.of(rules(ranks), ranks)
    rng = np.random.default_rng(5)
    hkv, hd, B = MINI.num_key_value_heads, MINI.head_dim, 2
    caches = {k: rng.normal(0, 1, (2, B, hkv, g.cache_slots(MINI, k, 16), hd)).astype(np.float32)
              for k in ("swa", "gqa")}                   # [layers of the kind, B, Hkv, T, D]
    state = {}
    for kind, full in caches.items():
        per_rank = []
        for rank in range(ranks):
            heads = [rank] if ranks == hkv else [rank * hkv // ranks]
            per_rank.append(np.concatenate([full[:, :, h] for h in heads], axis=-1))
        state[f"{kind}__key"] = np.stack(per_rank)
        state[f"{kind}__value"] = np.stack(per_rank) + 1
    kind_layers = {"swa": [0, 4], "gqa": [2, 6], "moe": [1, 3, 5, 7]}
    out = gw.reference_states(state, MINI, fg.per_rank, shards, kind_layers)
    for kind, full in caches.items():
        for i, layer in enumerate(kind_layers[kind]):
            np.testing.assert_array_equal(out[f"layers.{layer // 2}.key_cache"], full[i])
            np.testing.assert_array_equal(out[f"layers.{layer // 2}.value_cache"], full[i] + 1)
    assert out["layers.0.key_cache"].shape == (B, hkv, MINI.sliding_window, hd)
    assert out["layers.1.key_cache"].shape == (B, hkv, 16, hd)
    ring = {n: np.concatenate([state[n]] * 2, axis=3) for n in ("swa__key", "swa__value")}
    out = gw.reference_states(state | ring, MINI, fg.per_rank, shards, kind_layers)
    np.testing.assert_array_equal(out["layers.0.key_cache"],
                                  np.concatenate([caches["swa"][0]] * 2, axis=2))
    short = {n: state[n][:, :, :, :16] for n in ("swa__key", "swa__value")}
    out = gw.reference_states(state | short, MINI, fg.per_rank, shards, kind_layers)
    padded = out["layers.2.value_cache"]
    assert padded.shape == (B, hkv, MINI.sliding_window, hd)
    np.testing.assert_array_equal(padded[:, :, :16], caches["swa"][1][:, :, :16] + 1)
    assert not padded[:, :, 16:].any()
    # kernel_states writes each back as it was, every rank's (replicas too), the padded
    # window cut to the kernel's slots
    for kernel in (state, state | ring, state | short):
        shapes = {n: (a.shape[1:], a.dtype) for n, a in kernel.items()}
        back = gw.kernel_states(gw.reference_states(kernel, MINI, fg.per_rank, shards, kind_layers),
                                MINI, fg.per_rank, shards, kind_layers, shapes)
        assert back.keys() == kernel.keys()
        for n, a in kernel.items():
            np.testing.assert_array_equal(back[n], a, err_msg=n)
