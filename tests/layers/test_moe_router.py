"""The MoE kind's sigmoid router (DeepSeek-V3's `DeepseekV3TopkRouter`, Kimi K3's with one
group): the kernel's routing body and the reference's `route` against an independent numpy
derivation of upstream's router, where the group limit, the correction bias, the
renormalisation and the scaling each decide something; and the ungated shared expert's
weights table."""
from __future__ import annotations

import numpy as np
import pytest

import jax.numpy as jnp

from mkc.layers.moe import MoE
from mkc.layers.moe import lowering
from mkc.layers.moe import reference as ref
from mkc.layers.moe.options import SIGMOID

E, GROUPS, TOP_GROUPS, K = 32, 4, 2, 4


def _upstream(logits: np.ndarray, bias: np.ndarray, k: int, groups: int, top_groups: int,
              renormalise: bool, scaling: float) -> tuple[np.ndarray, np.ndarray]:
    """DeepseekV3TopkRouter.forward in f64 numpy: (ids as sorted sets, weights by id)."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    choice = scores + bias
    per = choice.reshape(len(choice), groups, -1)
    group_scores = np.sort(per, axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-group_scores, axis=-1, kind="stable")[:, :top_groups]
    mask = np.zeros_like(group_scores, bool)
    np.put_along_axis(mask, best, True, axis=-1)
    choice = np.where(np.repeat(mask, E // groups, axis=-1), choice, -np.inf)
    ids = np.argsort(-choice, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(scores, ids, -1)
    if renormalise:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    w = w * scaling
    dense = np.zeros_like(scores)
    np.put_along_axis(dense, ids, w, axis=-1)
    return np.sort(ids, -1), dense


def _case(seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Logits [6, E] and a bias [E]: rows 0-2 random; row 3 the best two scores alone in their
    groups, two groups of two close behind (the group limit takes those four); row 4 scores
    tied, the bias alone picks; row 5 a group whose single best expert leads every other (its
    second best decides it loses)."""
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, 1.5, (6, E)).astype(np.float32)
    bias = rng.normal(0, 0.05, E).astype(np.float32)
    logits[3] = -3.0
    logits[3, [0, 1, 8, 9, 16, 24]] = 1.0, 1.0, 1.0, 0.9, 3.0, 3.0
    logits[4] = 0.3
    logits[5] = -1.0
    logits[5, 0] = 6.0
    logits[5, 8:10], logits[5, 16:18], logits[5, 24:26] = 2.0, 1.9, 1.8
    return logits, bias


@pytest.mark.parametrize("renormalise, scaling", [(True, 2.5), (False, 1.0)])
def test_the_sigmoid_router_is_upstreams_with_its_groups(renormalise, scaling):
    logits, bias = _case(0)
    want_ids, want = _upstream(logits, bias, K, GROUPS, TOP_GROUPS, renormalise, scaling)
    # the regime: without the group limit, or without the bias, rows pick otherwise
    free_ids, _ = _upstream(logits, bias, K, 1, 1, renormalise, scaling)
    unbiased_ids, _ = _upstream(logits, 0 * bias, K, GROUPS, TOP_GROUPS, renormalise, scaling)
    assert not np.array_equal(free_ids[3], want_ids[3]) and not np.array_equal(free_ids[5], want_ids[5])
    assert not np.array_equal(unbiased_ids, want_ids)
    assert 0 not in want_ids[5]          # the best expert's group has no second: it is left out

    weights, ids = lowering.sigmoid_route_weights(jnp.asarray(logits), jnp.asarray(bias)[None], K,
                                                  renormalise, scaling, GROUPS, TOP_GROUPS)
    np.testing.assert_array_equal(np.sort(np.asarray(ids), -1), want_ids)
    np.testing.assert_allclose(np.asarray(weights), want, rtol=1e-6, atol=1e-7)

    r_ids, r_weights = ref.route(jnp.asarray(logits), K, renormalise, "sigmoid", jnp.asarray(bias),
                                 scaling, GROUPS, TOP_GROUPS)
    np.testing.assert_array_equal(np.sort(np.asarray(r_ids), -1), want_ids)
    dense = np.zeros_like(want)
    np.put_along_axis(dense, np.asarray(r_ids), np.asarray(r_weights), axis=-1)
    np.testing.assert_allclose(dense, want, rtol=1e-6, atol=1e-7)
    emulated = ref.dense_route_weights(jnp.asarray(logits), r_ids, renormalise, "sigmoid", scaling)
    np.testing.assert_allclose(np.asarray(emulated), want, rtol=1e-6, atol=1e-7)


def test_the_selection_scores_name_both_choices_of_a_group_limited_router():
    """The harness's near-tie rule reads the experts' choice (other groups' experts finite and
    far below) and the groups' choice."""
    logits, bias = _case(1)
    (experts, k), (groups, top) = ref.selection_scores(jnp.asarray(logits), K, True, "sigmoid",
                                                       jnp.asarray(bias), 2.5, GROUPS, TOP_GROUPS)
    assert (k, top) == (K, TOP_GROUPS) and np.all(np.isfinite(experts))
    assert np.asarray(groups).shape == (6, GROUPS)
    ids, _ = ref.route(jnp.asarray(logits), K, True, "sigmoid", jnp.asarray(bias), 2.5, GROUPS, TOP_GROUPS)
    np.testing.assert_array_equal(np.sort(np.argsort(-np.asarray(experts), -1)[:, :K], -1),
                                  np.sort(np.asarray(ids), -1))


def test_an_ungated_shared_experts_tensors_are_deepseeks():
    """DeepSeek-V3's MoE: the correction bias beside the router, the shared experts under
    `mlp.shared_experts.`, no shared expert gate."""
    class D:
        hidden_size, experts, top_k, moe_intermediate_size, shared_expert_intermediate_size = 64, E, K, 16, 32
    moe = MoE(routing=SIGMOID, shared_expert=True, shared_gate=False, shared_prefix="shared_experts.")
    shapes = ref.block_shapes(moe, D, "model.layers.3.")
    assert set(shapes) == {f"model.layers.3.mlp.{n}" for n in (
        "gate.weight", "gate.e_score_correction_bias", "experts.gate_up_proj", "experts.down_proj",
        *(f"shared_experts.{m}_proj.weight" for m in ("gate", "up", "down")))}
    part = moe.part(D, {"experts": 4, "mlp": 2})
    assert "correction_bias" in part.tensors and "shared_gate" not in part.tensors
    residual = next(op for op in part.ops if op.name == "mlp_residual")
    route = next(op for op in part.ops if op.name == "route")
    assert residual.reads == ("shared_out", "routed_out", "x") and "correction_bias" in route.reads
