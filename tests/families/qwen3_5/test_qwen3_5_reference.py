"""The qwen3_5_text reference: config parsing and independent numpy re-derivations
of one gated-delta-net layer and of cached attention."""
from __future__ import annotations

import functools
import json
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from mkc.families.qwen3_5 import reference as ref
from mkc.families.qwen3_5.config import Qwen35Dims
from mkc.families.qwen3_5.graph import GATED_ATTENTION
from mkc.layers.gated_delta_net import reference as gdn
from mkc.layers.gqa import reference as gqa
from mkc.model.config import CONFIG_DIR

CONFIGS = CONFIG_DIR
FULL_JSON = CONFIGS / "qwen3_8_27b.json"
MINI_JSON = CONFIGS / "qwen3_8_mini.json"


@pytest.fixture(scope="module")
def mini() -> Qwen35Dims:
    return ref.load_config(MINI_JSON)


@pytest.fixture(scope="module")
def mini_params(mini: Qwen35Dims) -> dict[str, np.ndarray]:
    return ref.init_params(mini, seed=0)


def _f64(params: dict[str, np.ndarray], name: str) -> np.ndarray:
    return params[name].astype(np.float64)


def _bf16_round(x: np.ndarray) -> np.ndarray:
    return x.astype(ml_dtypes.bfloat16).astype(np.float64)


def _layers(d: Qwen35Dims, kind: str) -> tuple[int, ...]:
    return tuple(i for i, k in enumerate(d.layer_kinds) if k == kind)


# ---------------------------------------------------------------------------------------------
# Configs


def test_full_config() -> None:
    cfg = ref.load_config(FULL_JSON)
    assert cfg.num_hidden_layers == 64 and len(cfg.layer_kinds) == 64
    assert _layers(cfg, "gqa") == tuple(i for i in range(64) if i % 4 == 3)
    assert len(_layers(cfg, "gqa")) == 16 and len(_layers(cfg, "gdn")) == 48
    assert (cfg.hidden_size, cfg.vocab_size, cfg.intermediate_size) == (5120, 248320, 17408)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (24, 4, 256)
    assert cfg.rotary_dim == 64 and cfg.rope_theta == 1e7 and cfg.rms_norm_eps == 1e-6
    assert (cfg.linear_num_key_heads, cfg.linear_num_value_heads) == (16, 48)
    assert cfg.linear_conv_dim == 10240
    assert cfg.linear_num_value_heads * cfg.linear_value_head_dim == 6144

    shapes = ref.param_shapes(cfg)
    assert shapes["model.layers.0.linear_attn.in_proj_qkv.weight"][0] == (10240, 5120)
    assert shapes["model.layers.0.linear_attn.conv1d.weight"][0] == (10240, 1, 4)
    assert shapes["model.layers.0.linear_attn.out_proj.weight"][0] == (5120, 6144)
    assert shapes["model.layers.3.self_attn.q_proj.weight"][0] == (2 * 24 * 256, 5120)
    assert shapes["model.layers.3.self_attn.o_proj.weight"][0] == (5120, 24 * 256)
    assert shapes["lm_head.weight"][0] == (248320, 5120)
    assert "model.layers.3.linear_attn.A_log" not in shapes
    assert "model.layers.0.self_attn.q_proj.weight" not in shapes
    n_params = sum(math.prod(shape) for shape, _ in shapes.values())
    assert 26.5e9 < n_params < 27.5e9, n_params


def test_layer_kinds_from_interval_and_composite_config() -> None:
    raw = json.loads(FULL_JSON.read_text())
    expected = ref.load_config(raw)
    del raw["layer_types"]
    assert ref.load_config(raw) == expected  # full_attention_interval: 4 gives the same pattern
    assert ref.load_config({"model_type": "qwen3_5", "text_config": raw}) == expected
    with pytest.raises(ValueError, match="layer_types has 3 entries"):
        ref.load_config({**raw, "layer_types": ["linear_attention"] * 3})
    with pytest.raises(ValueError, match="rope_theta"):
        ref.load_config({**raw, "rope_parameters": {"rope_type": "default"}})


def test_mini_config_is_tp8_tile_aligned(mini: Qwen35Dims) -> None:
    full = ref.load_config(FULL_JSON)
    assert mini.layer_kinds == full.layer_kinds[: mini.num_hidden_layers]
    kinds = mini.layer_kinds
    transitions = {(a, b) for a, b in zip(kinds, kinds[1:]) if a != b}
    assert transitions == {("gdn", "gqa"), ("gqa", "gdn")}
    assert (mini.rms_norm_eps, mini.rope_theta, mini.rotary_dim / mini.head_dim) == (1e-6, 1e7, 0.25)
    tp = 8
    per_rank = {
        "q+gate columns": 2 * mini.num_attention_heads * mini.head_dim // tp,
        "gdn conv channels": mini.linear_conv_dim // tp,
        "gdn value columns": mini.linear_num_value_heads * mini.linear_value_head_dim // tp,
        "mlp columns": mini.intermediate_size // tp,
        "vocab rows": mini.vocab_size // tp,
    }
    assert all(v % 128 == 0 and v > 0 for v in per_rank.values()), per_rank
    assert mini.num_attention_heads % tp == 0 and mini.linear_num_key_heads % tp == 0
    assert mini.linear_num_value_heads % tp == 0
    assert mini.head_dim == mini.linear_key_head_dim == mini.linear_value_head_dim == 128
    assert mini.hidden_size % 128 == 0


def test_init_params(mini_params: dict[str, np.ndarray]) -> None:
    """The ranges of Qwen3.5's own parameters (tests/families/test_conformance.py checks the
    table, dtypes and seed)."""
    norm = _f64(mini_params, "model.layers.0.input_layernorm.weight")
    assert abs(norm.mean()) < 0.05 and 0.01 < norm.std() < 0.5  # zero-centred, but not zero
    a = np.exp(_f64(mini_params, "model.layers.0.linear_attn.A_log"))
    assert np.all((a > 0.9) & (a < 17))


# ---------------------------------------------------------------------------------------------
# Whole-model decode


# ---------------------------------------------------------------------------------------------
# Gated delta net against an independent numpy derivation


def _naive_delta_rule_one_head(state: np.ndarray, q: np.ndarray, k: np.ndarray, v: np.ndarray,
                               g: float, beta: float) -> tuple[np.ndarray, np.ndarray]:
    """Element-by-element loops: S *= e^g; S[i,j] += k_i (v_j - sum_i' S[i',j] k_i') beta;
    o_j = sum_i S[i,j] q_i."""
    dk, dv = state.shape
    s = [[float(state[i, j]) * math.exp(g) for j in range(dv)] for i in range(dk)]
    for j in range(dv):
        predicted = sum(s[i][j] * float(k[i]) for i in range(dk))
        delta = (float(v[j]) - predicted) * beta
        for i in range(dk):
            s[i][j] += float(k[i]) * delta
    o = [sum(s[i][j] * float(q[i]) for i in range(dk)) for j in range(dv)]
    return np.array(o), np.array(s)


def _numpy_gdn_layer(p: dict[str, np.ndarray], cfg: Qwen35Dims, x: np.ndarray,
                     conv_state: np.ndarray, state: np.ndarray, naive_head: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """One token of Qwen3_5GatedDeltaNet for batch 1, written from the upstream math in float64.

    Returns (output, new conv window tail, new state, per-head outputs); ``naive_head`` is also
    recomputed with explicit loops and checked against the vectorised recurrence."""
    hk, hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
    kd = hk * dk
    mixed = _bf16_round(p["in_proj_qkv.weight"] @ x)               # conv input is stored as bf16
    window = np.concatenate([conv_state, mixed[:, None]], axis=1)  # [C, K]
    conv = (window * p["conv1d.weight"][:, 0, :]).sum(axis=1)
    conv = conv / (1 + np.exp(-conv))
    q, k, v = conv[:kd].reshape(hk, dk), conv[kd:2 * kd].reshape(hk, dk), conv[2 * kd:].reshape(hv, dv)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(dk)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    beta = 1 / (1 + np.exp(-(p["in_proj_b.weight"] @ x)))
    g = -np.exp(p["A_log"]) * np.log1p(np.exp(p["in_proj_a.weight"] @ x + p["dt_bias"]))

    new_state = np.empty_like(state)
    o = np.empty((hv, dv))
    for h in range(hv):
        kh = h // (hv // hk)
        s = state[h] * math.exp(g[h])
        s = s + np.outer(k[kh], (v[h] - s.T @ k[kh]) * beta[h])
        new_state[h], o[h] = s, s.T @ q[kh]
    naive_o, naive_s = _naive_delta_rule_one_head(state[naive_head], q[naive_head // (hv // hk)],
                                                  k[naive_head // (hv // hk)], v[naive_head],
                                                  float(g[naive_head]), float(beta[naive_head]))
    np.testing.assert_allclose(naive_s, new_state[naive_head], rtol=1e-9, atol=1e-12)
    np.testing.assert_allclose(naive_o, o[naive_head], rtol=1e-9, atol=1e-12)

    z = (p["in_proj_z.weight"] @ x).reshape(hv, dv)
    normed = o / np.sqrt((o * o).mean(-1, keepdims=True) + cfg.rms_norm_eps)
    gated = normed * p["norm.weight"] * z / (1 + np.exp(-z))
    return p["out_proj.weight"] @ gated.reshape(-1), window[:, 1:], new_state, o


def test_gated_delta_net_matches_numpy_loops(mini: Qwen35Dims,
                                             mini_params: dict[str, np.ndarray]) -> None:
    layer = _layers(mini, "gdn")[0]
    prefix = f"model.layers.{layer}.linear_attn."
    p64 = {n[len(prefix):]: _f64(mini_params, n) for n in mini_params if n.startswith(prefix)}
    p32 = {n: jnp.asarray(w, jnp.float32) for n, w in p64.items()}
    rng = np.random.default_rng(1)
    dk, dv, hv = mini.linear_key_head_dim, mini.linear_value_head_dim, mini.linear_num_value_heads
    # Start from non-zero states so the decay and the delta correction are both exercised.
    conv_state = _bf16_round(rng.normal(size=(mini.linear_conv_dim, mini.linear_conv_kernel_dim - 1)))
    state = rng.normal(0, 0.3, size=(hv, dk, dv))
    jax_conv = jnp.asarray(conv_state[None], jnp.bfloat16)
    jax_state = jnp.asarray(state[None], jnp.float32)
    block = jax.jit(gdn.block, static_argnums=1)
    for step, head in enumerate((5, 0, hv - 1)):  # 5 reads key head 2: exercises the grouping
        x = rng.normal(size=mini.hidden_size)
        out, jax_conv, jax_state = block(p32, mini, jnp.asarray(x[None], jnp.float32), jax_conv, jax_state)
        want_out, conv_state, state, _ = _numpy_gdn_layer(p64, mini, x, conv_state, state, head)
        np.testing.assert_allclose(np.asarray(jax_state[0]), state, rtol=1e-4, atol=1e-5,
                                   err_msg=f"step {step}")
        np.testing.assert_array_equal(np.asarray(jax_conv[0], np.float64), conv_state)
        np.testing.assert_allclose(np.asarray(out[0]), want_out, rtol=1e-4, atol=1e-5, err_msg=f"step {step}")


# ---------------------------------------------------------------------------------------------
# Cached attention against a from-scratch causal recomputation


def _numpy_causal_attention(p: dict[str, np.ndarray], cfg: Qwen35Dims, xs: np.ndarray) -> np.ndarray:
    """Gated GQA over a whole sequence ``xs [T, H]`` (prefill style), float64, from upstream's math."""
    t_len = xs.shape[0]
    hq, hkv, d, rot = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.rotary_dim
    qg = (xs @ p["q_proj.weight"].T).reshape(t_len, hq, 2 * d)
    q, gate = qg[..., :d], qg[..., d:].reshape(t_len, hq * d)
    k = (xs @ p["k_proj.weight"].T).reshape(t_len, hkv, d)
    v = (xs @ p["v_proj.weight"].T).reshape(t_len, hkv, d)

    def norm(a: np.ndarray, w: np.ndarray) -> np.ndarray:
        return a / np.sqrt((a * a).mean(-1, keepdims=True) + cfg.rms_norm_eps) * (1 + w)

    def rope(a: np.ndarray) -> np.ndarray:
        half = rot // 2
        freq = cfg.rope_theta ** (-np.arange(half) * 2.0 / rot)
        ang = np.arange(t_len)[:, None, None] * freq  # [T, 1, half]
        a1, a2 = a[..., :half], a[..., half:rot]
        return np.concatenate([a1 * np.cos(ang) - a2 * np.sin(ang),
                               a2 * np.cos(ang) + a1 * np.sin(ang), a[..., rot:]], axis=-1)

    q, k = rope(norm(q, p["q_norm.weight"])), rope(norm(k, p["k_norm.weight"]))
    k, v = _bf16_round(k), _bf16_round(v)  # the cache stores bf16
    out = np.empty((t_len, cfg.hidden_size))
    for t in range(t_len):
        heads = []
        for h in range(hq):
            kv = h // (hq // hkv)
            scores = k[: t + 1, kv] @ q[t, h] / math.sqrt(d)
            w = np.exp(scores - scores.max())
            heads.append((w / w.sum()) @ v[: t + 1, kv])
        attn = np.concatenate(heads) / (1 + np.exp(-gate[t]))
        out[t] = p["o_proj.weight"] @ attn
    return out


def test_cached_attention_matches_full_recompute(mini: Qwen35Dims,
                                                 mini_params: dict[str, np.ndarray]) -> None:
    layer = _layers(mini, "gqa")[0]
    prefix = f"model.layers.{layer}.self_attn."
    p64 = {n[len(prefix):]: _f64(mini_params, n) for n in mini_params if n.startswith(prefix)}
    p32 = {n: jnp.asarray(w, jnp.float32) for n, w in p64.items()}
    rng = np.random.default_rng(2)
    batch, t_len, context = 2, 7, 10
    xs = rng.normal(size=(batch, t_len, mini.hidden_size))
    shape = (batch, mini.num_key_value_heads, context, mini.head_dim)
    kc, vc = jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16)
    block = jax.jit(functools.partial(gqa.block, GATED_ATTENTION), static_argnums=1)
    got = []
    for t in range(t_len):
        out, kc, vc = block(p32, mini, jnp.asarray(xs[:, t], jnp.float32), kc, vc,
                            jnp.full((batch,), t, jnp.int32))
        got.append(np.asarray(out))
    got_all = np.stack(got, axis=1)
    for b in range(batch):
        np.testing.assert_allclose(got_all[b], _numpy_causal_attention(p64, mini, xs[b]),
                                   rtol=2e-4, atol=2e-5)
    assert not np.any(np.asarray(kc[:, :, t_len:], np.float32))  # slots past the last position untouched
