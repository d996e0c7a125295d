"""Per-rank K3 weights cut from a checkpoint have the graph's shapes and add back up: summing
the ranks' partial products (or joining their column shards) gives the full layer's product."""
import numpy as np
import pytest

from mkc.ir import WeightFormat
from mkc.model.config import CONFIG_DIR
from mkc.model.graph import build_graph
from mkc.families.kimi_k3.config import KimiDims
from mkc.families.kimi_k3.graph import MOE, build
from mkc.families.kimi_k3 import weights as kw
from mkc.model.mxfp4 import mxfp4_dequantize
from mkc.model.sharding import ShardTable
from mkc.layers.expert_formats.weights import unpack_mxfp4_from_kernel
from mkc.families.kimi_k3 import reference as reference

MINI = KimiDims.load(CONFIG_DIR / "kimi_k3_mini.json")
RULES = {"heads": (16, 1), "mlp": (16, 1), "vocab": (16, 1), "latent_down": (16, 1),
         "experts": (4, 4), "expert_mlp": (4, 1), "latent_up": (8, 1), "router": (2, 1)}
PER_RANK = build(MINI, RULES, 16).per_rank
TP = PER_RANK["expert_tp"]
SHARDS = ShardTable.of(RULES, 16)


def _matrix(hf, layer: int, kind: str, name: str, rank: int) -> np.ndarray:
    """Model layer `layer`'s matrix `name` of `kind`, as the host packs it (loop layer 2 layer
    or 2 layer + 1: either is model layer `layer`)."""
    return kw.matrix(hf, MINI, {}, 2 * layer, kind, name, rank, SHARDS)


@pytest.fixture(scope="module")
def hf():
    cfg = reference.load_config(CONFIG_DIR / "kimi_k3_mini.json")
    return reference.init_params(cfg, seed=3)


def test_every_family_has_the_graph_shape(hf):
    graph = build_graph(MINI, build(MINI, RULES, 16), 16)
    for layer, (attn, mlp) in enumerate(list(zip(MINI.layer_kinds[::2], MINI.layer_kinds[1::2]))):
        for kind in (attn, mlp):
            for t in graph.kinds[kind].tensors.values():
                for rank in (0, 5, 15):
                    if t.role == "matrix":
                        got = _matrix(hf, layer, kind, t.name, rank).shape
                    elif t.role == "vector":
                        got = kw.layer_vector(hf, MINI, {}, 2 * layer, kind, t.name, rank, SHARDS).shape
                        got = got if len(t.shape) == 2 else (got[-1],)
                    else:
                        continue
                    assert got == t.shape, (kind, t.name, rank)
    arrays = kw.expert_arrays(hf, MINI, 1, 0, 3, TP)
    assert {n: a.shape for n, a in arrays.items()} == {n: t.shape for n, t in graph.experts.items()}


def test_row_split_partials_sum_to_the_full_product(hf):
    x = np.random.default_rng(0).standard_normal((2, PER_RANK["heads"] * MINI.kda_head_dim * 16))
    x = x.astype(np.float32)
    full = x @ np.asarray(hf["model.layers.0.self_attn.o_proj.weight"], np.float32).T
    per = PER_RANK["heads"] * MINI.kda_head_dim
    total = sum(x[:, r * per:(r + 1) * per] @ _matrix(hf, 0, "kda", "o_proj", r)
                for r in range(16))
    np.testing.assert_allclose(total, full, rtol=1e-4, atol=1e-4)


def test_padded_column_splits_gather_to_the_real_width_then_zeros(hf):
    x = np.random.default_rng(1).standard_normal((2, MINI.hidden_size)).astype(np.float32)
    full = x @ np.asarray(hf["model.layers.1.block_sparse_moe.routed_expert_down_proj.weight"],
                          np.float32).T
    gathered = np.concatenate([x @ _matrix(hf, 1, "moe", "latent_down", r)
                               for r in range(16)], axis=1)
    np.testing.assert_allclose(gathered[:, :MINI.routed_expert_hidden_size], full, rtol=1e-4, atol=1e-4)
    assert not gathered[:, MINI.routed_expert_hidden_size:].any()


def test_expert_slices_decode_to_the_checkpoint_expert(hf):
    e = "model.layers.2.block_sparse_moe.experts.5."
    w = PER_RANK["expert_width"]
    groups = MOE.pack_groups(MINI, TP)
    for rank in range(4):                          # the 4 width slices of expert group 0
        a = kw.expert_arrays(hf, MINI, 2, 5, rank, TP)
        codes, scales = unpack_mxfp4_from_kernel(a["down_codes"], a["down_scales"], groups["down"])
        down = mxfp4_dequantize(codes, scales, (MINI.routed_expert_hidden_size, w))
        want = mxfp4_dequantize(hf[e + "w2.weight_packed"], hf[e + "w2.weight_scale"],
                                (MINI.routed_expert_hidden_size, MINI.moe_intermediate_size)
                                )[:, rank * w:(rank + 1) * w]
        np.testing.assert_array_equal(down, want)


def test_fp8_experts_hold_the_checkpoint_values_a_byte_each(hf):
    """`format expert.* fp8`: codes [in, out] of float8_e4m3fn bytes whose values times the
    unchanged E8M0 scales are exactly the checkpoint's MXFP4 values; shapes as the graph's."""
    import ml_dtypes

    formats = dict.fromkeys(("expert.gate_up", "expert.down"), WeightFormat("fp8"))
    graph = build_graph(MINI, build(MINI, RULES, 16, formats), 16)
    e = "model.layers.2.block_sparse_moe.experts.5."
    w = PER_RANK["expert_width"]
    mx = kw.expert_arrays(hf, MINI, 2, 5, 1, TP)
    a = kw.expert_arrays(hf, MINI, 2, 5, 1, TP, formats)
    assert {n: x.shape for n, x in a.items()} == {n: t.shape for n, t in graph.experts.items()}
    np.testing.assert_array_equal(a["down_scales"], mx["down_scales"])
    values = a["down_codes"].view(ml_dtypes.float8_e4m3fn).astype(np.float32)     # [w, latent]
    scales = np.exp2(a["down_scales"].astype(np.float32) - 127)
    down = (values.reshape(w // 32, 32, -1) * scales[:, None, :]).reshape(w, -1)
    want = mxfp4_dequantize(hf[e + "w2.weight_packed"], hf[e + "w2.weight_scale"],
                            (MINI.routed_expert_hidden_size, MINI.moe_intermediate_size))[:, w:2 * w]
    np.testing.assert_array_equal(down, want.T)
