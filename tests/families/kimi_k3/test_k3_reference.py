"""The Kimi K3 reference: config parsing, MXFP4 expert storage, and independent
numpy re-derivations of routing, the attention-residual schedule, one KDA layer, cached MLA and
the latent MoE."""
from __future__ import annotations

import functools
import json
import math
import types
from collections.abc import Callable

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mkc.model.config import CONFIG_DIR
from mkc.model.mxfp4 import mxfp4_dequantize
from mkc.families.kimi_k3 import reference as ref
from mkc.layers import ops as layer_ops
from mkc.layers.block_residuals import reference as block_reference
from mkc.families.kimi_k3.config import KimiDims
from mkc.families.kimi_k3.graph import ATTENTION, MOE
from mkc.layers.block_residuals import BlockAdd, BlockMix
from mkc.layers.moe import reference as moe_reference
from mkc.layers.kda import reference as kda_reference
from mkc.layers.mla import reference as mla_reference

CONFIGS = CONFIG_DIR
FULL_JSON = CONFIGS / "kimi_k3.json"
MINI_JSON = CONFIGS / "kimi_k3_mini.json"


def layers_of(d: KimiDims, kind: str) -> tuple[int, ...]:
    """The model layers whose attention (kda, mla) or MLP (dense, moe) is `kind`."""
    place = 1 if kind in ("dense", "moe") else 0
    return tuple(i for i, k in enumerate(d.layer_kinds[place::2]) if k == kind)


@pytest.fixture(scope="module")
def mini() -> KimiDims:
    return ref.load_config(MINI_JSON)


@pytest.fixture(scope="module")
def mini_params(mini: KimiDims) -> dict[str, np.ndarray]:
    return ref.init_params(mini, seed=0)


def _sub64(params: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    """Float parameters under ``prefix`` as float64, uint8 codes untouched, renamed relative."""
    return {n[len(prefix):]: (w if w.dtype == np.uint8 else w.astype(np.float64))
            for n, w in params.items() if n.startswith(prefix)}


def _to_jax(p: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    return {n: jnp.asarray(w) if w.dtype == np.uint8 else jnp.asarray(w, jnp.float32) for n, w in p.items()}


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return np.asarray(x, np.float64).astype(ml_dtypes.bfloat16).astype(np.float64)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1 / (1 + np.exp(-x))


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def _situ(g: np.ndarray, u: np.ndarray) -> np.ndarray:
    return 4 * np.tanh(g / 4) * _sigmoid(g) * 25 * np.tanh(u / 25)


# ---------------------------------------------------------------------------------------------
# Configs


def test_full_config() -> None:
    cfg = ref.load_config(FULL_JSON)
    assert cfg.num_hidden_layers == 93 and len(cfg.attention_types) == 93
    assert layers_of(cfg, "mla") == tuple(i for i in range(93) if i % 4 == 3 or i == 92)
    assert len(layers_of(cfg, "mla")) == 24 and len(layers_of(cfg, "kda")) == 69
    assert layers_of(cfg, "moe") == tuple(range(1, 93)) and not cfg.is_moe(0)
    assert (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size) == (7168, 163840, 33792)
    assert cfg.rms_norm_eps == 1e-5
    assert (cfg.kda_num_heads, cfg.kda_head_dim, cfg.conv_kernel_size) == (96, 128, 4)
    assert cfg.gate_lower_bound == -5.0
    assert (cfg.num_attention_heads, cfg.q_lora_rank, cfg.kv_lora_rank) == (96, 1536, 512)
    assert (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim, cfg.v_head_dim) == (192, 128)
    assert cfg.kv_lora_rank + cfg.qk_rope_head_dim == 576
    assert (cfg.experts, cfg.top_k, cfg.routed_expert_hidden_size) == (896, 16, 3584)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size) == (3072, 6144)
    assert cfg.attn_res_block_size == 12
    assert (cfg.activation_situ_beta, cfg.activation_situ_linear_beta) == (4.0, 25.0)

    shapes = ref.param_shapes(cfg)
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == ((12288, 7168), "bfloat16")
    assert shapes["model.layers.0.self_attn.f_a_proj.weight"][0] == (128, 7168)
    assert shapes["model.layers.0.self_attn.f_b_proj.weight"][0] == (12288, 128)
    assert shapes["model.layers.0.self_attn.A_log"] == ((96,), "float32")
    assert shapes["model.layers.0.mlp.gate_proj.weight"][0] == (33792, 7168)
    assert shapes["model.layers.3.self_attn.q_b_proj.weight"][0] == (96 * 192, 1536)
    assert shapes["model.layers.3.self_attn.kv_a_proj_with_mqa.weight"][0] == (576, 7168)
    assert shapes["model.layers.3.self_attn.kv_b_proj.weight"][0] == (96 * 256, 512)
    assert shapes["model.layers.92.self_attn.g_proj.weight"][0] == (12288, 7168)
    moe = "model.layers.1.block_sparse_moe."
    assert shapes[moe + "experts.895.w1.weight_packed"] == ((3072, 1792), "uint8")
    assert shapes[moe + "experts.895.w1.weight_scale"] == ((3072, 112), "uint8")
    assert shapes[moe + "experts.0.w2.weight_packed"] == ((3584, 1536), "uint8")
    assert shapes[moe + "routed_expert_down_proj.weight"][0] == (3584, 7168)
    assert shapes["model.layers.5.mlp_res_proj.weight"][0] == (1, 7168)
    assert "model.layers.0.block_sparse_moe.gate.weight" not in shapes
    assert "model.layers.3.self_attn.A_log" not in shapes

    # Routed experts dominate: 92 layers x 896 experts x 3 x 3584 x 3072 = 2.7226e12. The rest
    # is ~57e9: 69 KDA layers x 0.444e9, 24 MLA x 0.232e9, 92 x 0.19e9 (shared experts, latent
    # projections, router), the 0.73e9 dense MLP and 2 x 1.17e9 embedding / LM head.
    routed = 92 * 896 * 3 * 3584 * 3072
    n_params = ref.count_parameters(cfg)
    assert 2.75e12 < n_params < 2.8e12, n_params
    assert 50e9 < n_params - routed < 65e9, n_params - routed


def test_config_variants_and_validation() -> None:
    raw = json.loads(FULL_JSON.read_text())
    expected = ref.load_config(raw)
    composite = {"model_type": "kimi_k3", "text_config": {**raw, "model_type": "kimi_linear"}}
    assert ref.load_config(composite) == expected
    lin = raw["linear_attn_config"]
    without_last = {**lin, "full_attn_layers": lin["full_attn_layers"][:-1]}
    with pytest.raises(ValueError, match=r"in neither \[93\]"):
        ref.load_config({**raw, "linear_attn_config": without_last})
    with pytest.raises(ValueError, match="twice"):
        ref.load_config({**raw, "linear_attn_config": {**lin, "kda_layers": [*lin["kda_layers"], 4]}})
    with pytest.raises(ValueError, match="hidden_act"):
        ref.load_config({**raw, "hidden_act": "silu"})
    with pytest.raises(ValueError, match="full-rank"):
        ref.load_config({**raw, "linear_attn_config": {**lin, "use_full_rank_gate": False}})
    with pytest.raises(ValueError, match="model_type"):
        ref.load_config({**raw, "model_type": "deepseek_v3"})


def test_mini_config_keeps_the_structure_and_splits_over_16_ranks(mini: KimiDims) -> None:
    n = mini.num_hidden_layers
    assert layers_of(mini, "mla") == tuple(i for i in range(n) if i % 4 == 3 or i == n - 1)
    assert (n - 1) % 4 != 3  # the last layer is MLA by K3's extra rule, not by the stride
    assert set(mini.attention_types) == {"linear_attention", "full_attention"}
    # Two residual-block boundaries inside the stack (layers 3 and 6), one at an MLA layer.
    assert mini.attn_res_block_size == 3 and n == 7
    assert layers_of(mini, "moe") == tuple(range(1, n))
    assert (mini.experts, mini.top_k, mini.num_shared_experts) == (32, 4, 2)
    # Same constants as K3 where they shape the math.
    full = ref.load_config(FULL_JSON)
    for field in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kda_head_dim", "conv_kernel_size",
                  "gate_lower_bound", "rms_norm_eps", "activation_situ_beta",
                  "activation_situ_linear_beta"):
        assert getattr(mini, field) == getattr(full, field), field
    ranks = 16
    per_rank = {
        "kda q/k/v/g columns (1 head)": mini.kda_num_heads * mini.kda_head_dim // ranks,
        "mla v/gate columns (1 head)": mini.num_attention_heads * mini.v_head_dim // ranks,
        "dense mlp columns": mini.intermediate_size // ranks,
        "vocab rows": mini.vocab_size // ranks,
        "shared expert columns (4-way, as K3 splits its experts)": mini.shared_expert_intermediate_size // 4,
    }
    assert all(v % 128 == 0 and v > 0 for v in per_rank.values()), per_rank
    assert mini.kda_num_heads % ranks == 0 and mini.num_attention_heads % ranks == 0
    assert mini.experts % ranks == 0  # two whole experts per rank
    for dim in (mini.hidden_size, mini.routed_expert_hidden_size, mini.moe_intermediate_size,
                mini.q_lora_rank, mini.kv_lora_rank):
        assert dim % 128 == 0, dim


def test_init_params(mini: KimiDims, mini_params: dict[str, np.ndarray]) -> None:
    """MXFP4 experts and KDA gates in K3's ranges (tests/families/test_conformance.py checks
    the table, dtypes and seed)."""
    prefix = "model.layers.2.block_sparse_moe.experts.7.w2."
    scales = mini_params[prefix + "weight_scale"]
    assert scales.min() >= 1 and scales.max() <= 254
    w2 = mxfp4_dequantize(mini_params[prefix + "weight_packed"], scales,
                          moe_reference.packed_shape(MOE, mini, "w2"))
    assert w2.shape == (mini.routed_expert_hidden_size, mini.moe_intermediate_size)
    assert abs(w2.std() * math.sqrt(mini.moe_intermediate_size) - 1) < 0.1  # N(0, 1/fan_in), quantized
    a = np.exp(mini_params["model.layers.0.self_attn.A_log"])
    assert np.all((a >= 1) & (a <= 16))


# ---------------------------------------------------------------------------------------------
# Building blocks


def test_router_bias_selects_but_does_not_weight() -> None:
    logits = jnp.array([[-1.0, 0.5, 2.0, 1.0, 0.0],
                        [3.0, -2.0, 0.0, 1.0, 2.5]])
    bias = jnp.array([1.5, 0.0, -1.0, 0.0, 0.2])
    ids, weights = moe_reference.route(logits, 2, True, "sigmoid", bias)
    # Biased scores, row 0: [1.77, .62, -.12, .73, .70] -> experts 0 and 3, although expert 2 has
    # the best raw score; row 1: [2.45, .12, -.5, .73, 1.12] -> 0 and 4.
    for row, chosen in ((0, [0, 3]), (1, [0, 4])):
        assert sorted(np.asarray(ids[row]).tolist()) == chosen
        raw = _sigmoid(np.asarray(logits[row], np.float64)[np.asarray(ids[row])])
        np.testing.assert_allclose(np.asarray(weights[row]), raw / raw.sum(), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(weights).sum(-1), 1.0, rtol=1e-6)
    _, scaled = moe_reference.route(logits, 2, True, "sigmoid", bias, 2.5)
    np.testing.assert_allclose(np.asarray(scaled), 2.5 * np.asarray(weights), rtol=1e-6)


def test_situ_formula() -> None:
    g = np.linspace(-40, 40, 81)
    u = np.linspace(-100, 100, 81)
    got = np.asarray(layer_ops.situ(jnp.asarray(g, jnp.float32), jnp.asarray(u, jnp.float32), 4.0, 25.0))
    np.testing.assert_allclose(got, _situ(g, u), rtol=1e-5, atol=1e-5)
    assert np.all(np.abs(got) <= 4 * 25)  # both factors are soft-capped


def _paper_block_attn_res(embedding: np.ndarray, n_layers: int, block: int,
                          sublayer: Callable[[int, np.ndarray], np.ndarray],
                          mix: Callable[[int, np.ndarray], np.ndarray]) -> np.ndarray:
    """Block AttnRes from its definition: source set of sublayer j of layer i = completed block
    sums b_0 (embedding), b_1 .. b_{i // block} (b_n = all outputs of layers (n-1)*block ..
    n*block - 1), plus the sum of the current block's earlier outputs when there are any."""
    outputs: list[tuple[int, np.ndarray]] = []  # (block index, sublayer output)

    def sources(current: int) -> np.ndarray:
        done = [embedding] + [sum(o for n, o in outputs if n == k) for k in range(1, current)]
        partial = [o for n, o in outputs if n == current]
        return np.stack(done + ([sum(partial)] if partial else []), axis=1)

    for j in range(2 * n_layers):
        current = j // 2 // block + 1
        outputs.append((current, sublayer(j, mix(j, sources(current)))))
    return mix(2 * n_layers, sources((n_layers - 1) // block + 1))


@pytest.mark.parametrize("n_layers,block", [(7, 3), (5, 2), (4, 12), (3, 1)])
def test_block_attention_residual_schedule(n_layers: int, block: int) -> None:
    rng = np.random.default_rng(n_layers * 10 + block)
    hidden, eps = 16, 1e-5
    mats = rng.normal(0, 1 / math.sqrt(hidden), (2 * n_layers, hidden, hidden))
    norms = 1 + 0.1 * rng.normal(size=(2 * n_layers + 1, hidden))
    projs = rng.normal(0, 1 / math.sqrt(hidden), (2 * n_layers + 1, 1, hidden))
    embedding = rng.normal(size=(2, hidden))
    counts: list[int] = []

    def np_mix(j: int, sources: np.ndarray) -> np.ndarray:
        counts.append(sources.shape[1])
        scores = (_rms(sources, norms[j], eps) * projs[j, 0]).sum(-1)
        w = np.exp(scores - scores.max(-1, keepdims=True))
        return ((w / w.sum(-1, keepdims=True))[..., None] * sources).sum(1)

    want = _paper_block_attn_res(embedding, n_layers, block,
                                 lambda j, h: np.tanh(_rms(h, np.ones(hidden), eps) @ mats[j]), np_mix)
    want_counts, counts = counts, []

    d = types.SimpleNamespace(attn_res_block_size=block, rms_norm_eps=eps, hidden_size=hidden,
                              num_hidden_layers=n_layers)
    ones = jnp.ones(hidden, jnp.float32)

    def query(j: int, prefix: str) -> dict[str, jax.Array]:
        return {f"{prefix}_norm.weight": jnp.asarray(norms[j], jnp.float32),
                f"{prefix}_proj.weight": jnp.asarray(projs[j], jnp.float32)}

    stream = block_reference.BLOCK_RESIDUALS.start(jnp.asarray(embedding, jnp.float32))
    for j in range(2 * n_layers):
        place = ("attn", "mlp")[j % 2]
        lp = query(j, block_reference.QUERIES[place]) | {block_reference.NORM_WEIGHTS[place]: ones}
        stream = block_reference.forward(BlockMix(place), lp, d, stream, {}, j // 2, None, None, "")
        counts.append(stream.visible().shape[1])
        out = jnp.tanh(jnp.matmul(stream.h, jnp.asarray(mats[j], jnp.float32), precision="highest"))
        stream = block_reference.forward(BlockAdd(place), {}, d, stream.leave(out), {}, j // 2, None, None,
                                         "")
    counts.append(stream.visible().shape[1])
    got = block_reference.BLOCK_RESIDUALS.finish(query(2 * n_layers, block_reference.OUTPUT), d, stream, None)
    assert counts == want_counts
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert want_counts[0] == 1 and want_counts[-1] == (n_layers - 1) // block + 2


# ---------------------------------------------------------------------------------------------
# KDA against an independent numpy derivation


def _naive_kda_one_head(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                        decay: np.ndarray, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Element loops: S[i,j] *= e^decay_i; S[i,j] += k_i beta (v_j - sum_i' S[i',j] k_i');
    o_j = sum_i S[i,j] q_i."""
    dk, dv = state.shape
    s = [[float(state[i, j]) * math.exp(decay[i]) for j in range(dv)] for i in range(dk)]
    for j in range(dv):
        delta = (float(v[j]) - sum(s[i][j] * float(k[i]) for i in range(dk))) * beta
        for i in range(dk):
            s[i][j] += float(k[i]) * delta
    return np.array([sum(s[i][j] * float(q[i]) for i in range(dk)) for j in range(dv)]), np.array(s)


def _numpy_kda_layer(p: dict[str, np.ndarray], cfg: KimiDims, x: np.ndarray, window: np.ndarray,
                     state: np.ndarray, naive_head: int) -> tuple[np.ndarray, np.ndarray]:
    """One token of KDA for batch 1 in float64, from the conv window ``[3P, K]`` (whose newest
    column is the bf16-stored projection). Returns (output, new state)."""
    nh, d = cfg.kda_num_heads, cfg.kda_head_dim
    taps = np.concatenate([p[f"{n}_conv1d.weight"][:, 0, :] for n in "qkv"])
    conv = (window * taps).sum(axis=1)
    conv = conv * _sigmoid(conv)
    q, k, v = (a.reshape(nh, d) for a in np.split(conv, 3))
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(d)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    gate = p["f_b_proj.weight"] @ (p["f_a_proj.weight"] @ x) + p["dt_bias"]
    decay = -5.0 * _sigmoid(np.exp(p["A_log"])[:, None] * gate.reshape(nh, d))
    beta = _sigmoid(p["b_proj.weight"] @ x)

    new_state = np.empty_like(state)
    o = np.empty((nh, d))
    for h in range(nh):
        s = np.exp(decay[h])[:, None] * state[h]
        s = s + np.outer(k[h], beta[h] * (v[h] - s.T @ k[h]))
        new_state[h], o[h] = s, s.T @ q[h]
    naive_o, naive_s = _naive_kda_one_head(state[naive_head], q[naive_head], k[naive_head], v[naive_head],
                                           decay[naive_head], float(beta[naive_head]))
    np.testing.assert_allclose(naive_s, new_state[naive_head], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(naive_o, o[naive_head], rtol=1e-9, atol=1e-12)

    g = (p["g_proj.weight"] @ x).reshape(nh, d)
    gated = _rms(o, p["o_norm.weight"], cfg.rms_norm_eps) * _sigmoid(g)
    return p["o_proj.weight"] @ gated.reshape(-1), new_state


def test_kda_matches_numpy_loops(mini: KimiDims, mini_params: dict[str, np.ndarray]) -> None:
    p64 = _sub64(mini_params, f"model.layers.{layers_of(mini, "kda")[1]}.self_attn.")
    rng = np.random.default_rng(1)
    nh, d, width = mini.kda_num_heads, mini.kda_head_dim, mini.conv_kernel_size - 1
    # Non-zero starting states so the decay, the conv history and the delta correction all act.
    conv_state = _bf16_round(rng.normal(size=(3 * mini.kda_num_heads * mini.kda_head_dim, width)))
    state = rng.normal(0, 0.3, size=(nh, d, d))
    jax_conv = jnp.asarray(conv_state[None], jnp.bfloat16)
    jax_state = jnp.asarray(state[None], jnp.float32)
    block = jax.jit(functools.partial(kda_reference.block, ATTENTION["kda"]), static_argnums=1)
    for step, head in enumerate((5, 0, nh - 1)):
        x = rng.normal(size=mini.hidden_size)
        out, jax_conv, jax_state = block(_to_jax(p64), mini, jnp.asarray(x[None], jnp.float32),
                                         jax_conv, jax_state)
        new_conv = np.asarray(jax_conv[0], np.float64)
        # The history shifts by one slot; the new slot is the bf16 of the q|k|v projections.
        # (Its exact bf16 rounding is taken from JAX: f32 and f64 may round a tie differently.)
        np.testing.assert_array_equal(new_conv[:, :-1], conv_state[:, 1:])
        projected = np.concatenate([p64[f"{n}_proj.weight"] @ x for n in "qkv"])
        np.testing.assert_allclose(new_conv[:, -1], projected, rtol=2 ** -8, atol=1e-6)
        window = np.concatenate([conv_state, new_conv[:, -1:]], axis=1)
        want_out, state = _numpy_kda_layer(p64, mini, x, window, state, head)
        tol = dict(rtol=1e-4, atol=1e-5, err_msg=f"step {step}")
        np.testing.assert_allclose(np.asarray(jax_state[0]), state, **tol)
        np.testing.assert_allclose(np.asarray(out[0]), want_out, **tol)
        conv_state = new_conv


# ---------------------------------------------------------------------------------------------
# Cached MLA against a from-scratch causal recomputation


def _numpy_latent_rows(p: dict[str, np.ndarray], cfg: KimiDims, xs: np.ndarray) -> np.ndarray:
    compressed = xs @ p["kv_a_proj_with_mqa.weight"].T
    kvl = cfg.kv_lora_rank
    return np.concatenate([_rms(compressed[:, :kvl], p["kv_a_layernorm.weight"], cfg.rms_norm_eps),
                           compressed[:, kvl:]], axis=-1)


def _numpy_causal_mla(p: dict[str, np.ndarray], cfg: KimiDims, xs: np.ndarray,
                      rows: np.ndarray) -> np.ndarray:
    """Gated NoPE MLA over a whole sequence ``xs [T, H]`` (prefill style), float64, with full
    192-wide per-head keys ``[k_nope | k_extra]``; ``rows`` are the (bf16-stored) latent rows."""
    t_len, nh, nope, vd = xs.shape[0], cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
    q_latent = _rms(xs @ p["q_a_proj.weight"].T, p["q_a_layernorm.weight"], cfg.rms_norm_eps)
    q = (q_latent @ p["q_b_proj.weight"].T).reshape(t_len, nh, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
    kv = (rows[:, :cfg.kv_lora_rank] @ p["kv_b_proj.weight"].T).reshape(t_len, nh, nope + vd)
    extra = np.broadcast_to(rows[:, None, cfg.kv_lora_rank:], (t_len, nh, cfg.qk_rope_head_dim))
    keys, values = np.concatenate([kv[..., :nope], extra], axis=-1), kv[..., nope:]
    gate = _sigmoid(xs @ p["g_proj.weight"].T)
    out = np.empty((t_len, cfg.hidden_size))
    for t in range(t_len):
        heads = []
        for h in range(nh):
            scores = keys[: t + 1, h] @ q[t, h] / math.sqrt(192)
            w = np.exp(scores - scores.max())
            heads.append((w / w.sum()) @ values[: t + 1, h])
        out[t] = p["o_proj.weight"] @ (np.concatenate(heads) * gate[t])
    return out


def test_cached_mla_matches_full_recompute(mini: KimiDims,
                                           mini_params: dict[str, np.ndarray]) -> None:
    p64 = _sub64(mini_params, f"model.layers.{layers_of(mini, "mla")[0]}.self_attn.")
    rng = np.random.default_rng(2)
    batch, t_len, context = 2, 6, 9
    xs = rng.normal(size=(batch, t_len, mini.hidden_size))
    cache = jnp.zeros((batch, context, mini.kv_lora_rank + mini.qk_rope_head_dim), jnp.bfloat16)
    block = jax.jit(functools.partial(mla_reference.block, ATTENTION["mla"]), static_argnums=1)
    got = []
    for t in range(t_len):
        out, cache = block(_to_jax(p64), mini, jnp.asarray(xs[:, t], jnp.float32), cache,
                           jnp.full((batch,), t, jnp.int32))
        got.append(np.asarray(out))
    got_all, stored = np.stack(got, axis=1), np.asarray(cache, np.float64)
    assert not np.any(stored[:, t_len:])  # slots past the last position untouched
    for b in range(batch):
        rows = stored[b, :t_len]
        np.testing.assert_allclose(rows, _numpy_latent_rows(p64, mini, xs[b]), rtol=2 ** -8, atol=1e-6)
        want = _numpy_causal_mla(p64, mini, xs[b], rows)
        np.testing.assert_allclose(got_all[b], want, rtol=2e-4, atol=2e-5)


# ---------------------------------------------------------------------------------------------
# Latent MoE against a numpy loop over the chosen experts


def test_moe_matches_numpy_loop(mini: KimiDims, mini_params: dict[str, np.ndarray]) -> None:
    p = _sub64(mini_params, "model.layers.2.block_sparse_moe.")
    rng = np.random.default_rng(3)
    xs = rng.normal(size=(3, mini.hidden_size))
    got = np.asarray(jax.jit(moe_reference.block, static_argnums=(0, 2))(MOE, _to_jax(p), mini,
                                                                          jnp.asarray(xs, jnp.float32)))

    def expert(e: int, w: str) -> np.ndarray:
        return mxfp4_dequantize(p[f"experts.{e}.{w}.weight_packed"], p[f"experts.{e}.{w}.weight_scale"],
                                moe_reference.packed_shape(MOE, mini, w)).astype(np.float64)

    for b, x in enumerate(xs):
        scores = _sigmoid(p["gate.weight"] @ x)
        chosen = np.argsort(-(scores + p["gate.e_score_correction_bias"]))[: mini.top_k]
        weights = scores[chosen] / scores[chosen].sum()
        z = p["routed_expert_down_proj.weight"] @ x
        y = sum(wt * (expert(e, "w2") @ _situ(expert(e, "w1") @ z, expert(e, "w3") @ z))
                for e, wt in zip(chosen, weights))
        y = _rms(y, p["routed_expert_norm.weight"], mini.rms_norm_eps)
        routed = p["routed_expert_up_proj.weight"] @ y
        shared = p["shared_experts.down_proj.weight"] @ _situ(p["shared_experts.gate_proj.weight"] @ x,
                                                              p["shared_experts.up_proj.weight"] @ x)
        np.testing.assert_allclose(got[b], routed + shared, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Whole-model decode


