"""The qwen3_5_moe_text reference: the MoE block against an independent numpy derivation of
upstream's Qwen3_5MoeSparseMoeBlock, routing with and without top-k renormalisation
and the rounding emulation's expert-parallel decomposition."""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkc.families.qwen3_5_moe import reference as ref
from mkc.families.qwen3_5_moe.config import Qwen35MoeDims
from mkc.families.qwen3_5_moe.graph import LAYERS
from mkc.layers.moe import reference as moe_reference
from mkc.layers.reference import linear
from mkc.model.config import CONFIG_DIR
from mkc.reference.rounding import Reduce, Rounding

MINI_JSON = CONFIG_DIR / "qwen3_5_moe_mini.json"

decode = jax.jit(ref.decode_step, static_argnums=(1, 5))
moe = jax.jit(functools.partial(moe_reference.block, LAYERS["moe"][0]), static_argnums=(1, 3, 4))


@pytest.fixture(scope="module")
def mini() -> Qwen35MoeDims:
    return ref.load_config(MINI_JSON)


@pytest.fixture(scope="module")
def mini_params(mini: Qwen35MoeDims) -> dict[str, np.ndarray]:
    return ref.init_params(mini, seed=0)


def _layer_moe(params: dict[str, np.ndarray], layer: int) -> dict[str, np.ndarray]:
    prefix = f"model.layers.{layer}.mlp."
    return {n[len(prefix):]: params[n].astype(np.float64) for n in params if n.startswith(prefix)}


def _silu(a: np.ndarray) -> np.ndarray:
    return a / (1 + np.exp(-a))


def _numpy_moe(p: dict[str, np.ndarray], x: np.ndarray, top_k: int, renormalize: bool
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One row of Qwen3_5MoeSparseMoeBlock in float64, written from upstream's description:
    softmax over all experts, top-k, optional renormalisation, per-expert SwiGLU with the fused
    gate|up rows split in two, the shared expert scaled by sigmoid(shared_expert_gate x).
    Returns (output, chosen expert ids largest first, their weights)."""
    logits = p["gate.weight"] @ x
    probs = np.exp(logits - logits.max())
    probs /= probs.sum()
    ids = np.argsort(-probs, kind="stable")[:top_k]
    weights = probs[ids] / (probs[ids].sum() if renormalize else 1.0)
    out = np.zeros_like(x)
    for e, w in zip(ids, weights):
        gate_up = p["experts.gate_up_proj"][e]
        inter = gate_up.shape[0] // 2
        hidden = _silu(gate_up[:inter] @ x) * (gate_up[inter:] @ x)
        out += w * (p["experts.down_proj"][e] @ hidden)
    shared = p["shared_expert.down_proj.weight"] @ (
        _silu(p["shared_expert.gate_proj.weight"] @ x) * (p["shared_expert.up_proj.weight"] @ x))
    gate = 1 / (1 + np.exp(-(p["shared_expert_gate.weight"] @ x)[0]))
    return out + gate * shared, ids, weights


# ---------------------------------------------------------------------------------------------
# Routing and the MoE block


@pytest.mark.parametrize("renormalize", [True, False])
def test_route(renormalize: bool) -> None:
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(5, 16)) * 2
    ids, weights = ref.route(jnp.asarray(logits, jnp.float32), 4, renormalize)
    probs = np.exp(logits) / np.exp(logits).sum(-1, keepdims=True)
    want_ids = np.argsort(-probs, axis=-1)[:, :4]
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    chosen = np.take_along_axis(probs, want_ids, axis=-1)
    want = chosen / chosen.sum(-1, keepdims=True) if renormalize else chosen
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-5)
    sums = np.asarray(weights).sum(-1)
    if renormalize:
        np.testing.assert_allclose(sums, 1.0, rtol=1e-6)
    else:
        assert np.all(sums < 1.0)


@pytest.mark.parametrize("renormalize", [True, False])
def test_moe_block_matches_numpy(mini: Qwen35MoeDims, mini_params: dict[str, np.ndarray],
                                 renormalize: bool) -> None:
    cfg = dataclasses.replace(mini, norm_topk_prob=renormalize)
    rng = np.random.default_rng(4)
    x = rng.normal(size=(6, mini.hidden_size))
    for layer in (0, 3):
        p64 = _layer_moe(mini_params, layer)
        got = np.asarray(moe({n: jnp.asarray(w, jnp.float32) for n, w in p64.items()}, cfg,
                             jnp.asarray(x, jnp.float32), None, ""))
        for b in range(x.shape[0]):
            want, ids, weights = _numpy_moe(p64, x[b], mini.top_k, renormalize)
            assert len(set(ids)) == mini.top_k and 0 < weights.min()
            np.testing.assert_allclose(got[b], want, rtol=1e-4, atol=1e-5 * np.abs(want).max(),
                                       err_msg=f"layer {layer} row {b}")


def test_renormalisation_changes_the_output(mini: Qwen35MoeDims,
                                            mini_params: dict[str, np.ndarray]) -> None:
    """Without renormalisation the routed part shrinks by the chosen experts' total probability
    (below 1); the shared expert is untouched. Zeroing the shared expert isolates the routed part."""
    p = {n: jnp.asarray(w, jnp.float32) for n, w in _layer_moe(mini_params, 1).items()}
    p["shared_expert_gate.weight"] = jnp.full_like(p["shared_expert_gate.weight"], 0.0)
    p["shared_expert.down_proj.weight"] = jnp.zeros_like(p["shared_expert.down_proj.weight"])
    x = jnp.asarray(np.random.default_rng(5).normal(size=(3, mini.hidden_size)), jnp.float32)
    on = moe(p, mini, x, None, "")
    off = moe(p, dataclasses.replace(mini, norm_topk_prob=False), x, None, "")
    _, weights = ref.route(linear(x, p["gate.weight"]), mini.top_k, False)
    mass = np.asarray(weights).sum(-1)
    assert np.all((mass > 0.05) & (mass < 0.95)), mass
    np.testing.assert_allclose(np.asarray(off), np.asarray(on) * mass[:, None], rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# Whole-model decode


# ---------------------------------------------------------------------------------------------
# Rounding emulation


def _rounding(cfg: Qwen35MoeDims, expert_tp: int, matmul_input: str, wire: str) -> Rounding:
    """An 8-rank schedule's rounding facts, written by hand (no graph exists for this family):
    heads, the shared expert and the vocabulary split over all ranks; the experts in
    ``8 // expert_tp`` groups, each expert's width split ``expert_tp`` ways inside its group;
    one direct all-reduce stage over the 8 ranks; the KV cache read in 16-token tiles."""
    ranks = 8
    direct = Reduce(((ranks, 1),), wire)
    reduces = tuple((kind, op, direct) for kind, ops in (
        ("gdn", ("out_proj",)), ("gqa", ("o_proj",)), ("moe", ("shared_down", "routed_experts")),
        ("embed", ("embed",))) for op in ops)
    shard = {"nv": cfg.linear_num_value_heads // ranks, "nq": cfg.num_attention_heads // ranks,
             "shared": cfg.shared_expert_intermediate_size // ranks, "vocab": cfg.vocab_size // ranks,
             "expert_tp": expert_tp, "expert_width": cfg.moe_intermediate_size // expert_tp,
             "local_experts": cfg.experts // (ranks // expert_tp)}
    return Rounding(ranks=ranks, reduces=reduces, storage=(("gdn", "conv", "bf16"),
                    ("gdn", "recurrent", "f32"), ("gqa", "kv", "bf16")),
                    shard=tuple(sorted(shard.items())), matmul_input=matmul_input,
                    kv_tiles=(("gqa", 16),))


@pytest.mark.parametrize("expert_tp", [1, 2])
def test_expert_parallel_split_sums_to_the_plain_block(mini: Qwen35MoeDims,
                                                       mini_params: dict[str, np.ndarray],
                                                       expert_tp: int) -> None:
    """Without bf16 anywhere, the per-rank partial sums of the emulation add up to the plain
    block up to f32 summation order: every expert and width slice is counted exactly once."""
    p = {n: jnp.asarray(w, jnp.float32) for n, w in _layer_moe(mini_params, 2).items()}
    x = jnp.asarray(np.random.default_rng(6).normal(size=(3, mini.hidden_size)), jnp.float32)
    plain = np.asarray(moe(p, mini, x, None, "moe"))
    split = np.asarray(moe(p, mini, x, _rounding(mini, expert_tp, "f32", "f32"), "moe"))
    np.testing.assert_allclose(split, plain, rtol=1e-5, atol=1e-6 * np.abs(plain).max())


def test_rounding_emulation_decode_is_close_to_plain(mini: Qwen35MoeDims,
                                                     mini_params: dict[str, np.ndarray]) -> None:
    """bf16 matmul inputs and a bf16 wire move the logits at bf16 scale, no more. (Run eagerly:
    the emulation's per-rank loops make a graph that takes far longer to compile than to run.)"""
    rounding = _rounding(mini, 1, "bf16", "bf16")
    tokens, positions = jnp.array([5, 900], jnp.int32), jnp.zeros((2,), jnp.int32)
    cache = ref.init_cache(mini, batch=2, context=16)
    plain, _ = decode(mini_params, mini, cache, tokens, positions)
    emulated, new = ref.decode_step(mini_params, mini, cache, tokens, positions, rounding)
    assert all(np.all(np.isfinite(np.asarray(v, np.float32))) for v in new.values())
    err = float(jnp.max(jnp.abs(emulated - plain)) / jnp.max(jnp.abs(plain)))
    assert 1e-5 < err < 3e-2, err
