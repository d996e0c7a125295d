"""Every router kind of the library, its lowered `router` and `route` bodies (the MoE kind's
softmax top-k, sigmoid with the correction bias and groups, GPT-OSS's biased top k's softmax;
the sigmoid router as DeepSeek-V3, Kimi K3 and Muse Spark compose it) against an independent
numpy derivation of upstream's router, on rows built near the ties where selection alone
decides: two groups whose scores (best plus second-best corrected score) differ by DELTA, the
narrow winner the group with the larger best or the one with the larger second, at the lower or
the higher group index; a group whose two best are equal (a tie counts twice); two groups
exactly tied (the lower wins); two experts at the k-th pick DELTA apart where the correction
bias (or the router's bias) decides, each order; experts exactly tied (the lower lane wins).
The sigmoid routers' bias comes from the checkpoint through the family's packer, and the
reference's `route` and the harness's `selection_scores` read the same rows. DELTA is far above
f32 rounding and far below what a 1 % change of a term moves: each mutant below flips a pick
(applied to the source and this module run, every one failed it).

Mutants, 1.01 times ... (mkc/layers/moe/ unless named)         caught by
  the correction bias in the kernel's pick (lowering.py), in     every sigmoid case
    `Sigmoid.kernel` or `route_args` (options.py), as packed
    (weights.vector), in the reference's `sigmoid_route` or
    `sigmoid_selection` (reference.py)
  the group score's first or second term (lowering.py; the       deepseek (group rows)
    reference's `group_scores`)
  the router's bias (logits + 1.01 * bias)                       gpt_oss
  groups tied to the higher index                                deepseek (exact-tie row)
  a tie counting once (second = the next smaller value)          deepseek (doubled-best row)
  experts tied to the higher lane (mkc/runtime/experts.top_k)    every test but gpt_oss
"""
from __future__ import annotations

import dataclasses
import types

import jax.numpy as jnp
import numpy as np
import pytest

from mkc.families.deepseek_v3 import reference as deepseek
from mkc.families.deepseek_v3.graph import MOE as DEEPSEEK_MOE
from mkc.families.gpt_oss import reference as gpt_oss
from mkc.families.gpt_oss.graph import MOE as GPT_OSS_MOE
from mkc.families.kimi_k3 import reference as k3
from mkc.families.kimi_k3.graph import MOE as K3_MOE
from mkc.families.muse_spark import reference as muse_spark
from mkc.families.muse_spark.graph import MOE as MUSE_SPARK_MOE
from mkc.families.qwen3_moe import reference as qwen3_moe
from mkc.layers.moe import MoE
from mkc.layers.moe import lowering
from mkc.layers.moe import reference as moe_ref
from mkc.model.config import CONFIG_DIR
from layer_bodies import ONE_RANK, PREFIX
from tests_support import body_layer

DELTA = 1e-4
E, GROUPS, TOP_GROUPS, K = 16, 4, 2, 4
LOW = (0.13, 0.12)          # a group's other experts, below every pick


def _route_bodies(sub: MoE, d, product: np.ndarray, vectors: dict) -> tuple[np.ndarray, np.ndarray]:
    """The lowered router and route of `sub` on the router's product (ids best first, dense
    weights)."""
    picked = {}
    c = body_layer(d, {n: jnp.asarray(v, jnp.float32)[None, :] for n, v in vectors.items()},
                   matmul=lambda name, h: h, select_experts=lambda ids: picked.setdefault("ids", ids),
                   plan=types.SimpleNamespace(streamed={}))      # a split router's product: every column
    logits = lowering.router(sub, c, jnp.asarray(product, jnp.float32))
    ids, weights = lowering.route(sub, c, logits)
    np.testing.assert_array_equal(np.asarray(picked["ids"]), np.asarray(ids))
    return np.asarray(ids), np.asarray(weights, np.float64)


def _dense(ids: np.ndarray, w: np.ndarray, n: int) -> np.ndarray:
    out = np.zeros((len(ids), n))
    np.put_along_axis(out, ids, w, axis=-1)
    return out


def _best_first(pick: np.ndarray, k: int) -> np.ndarray:
    """upstream's torch.topk order: largest first, ties to the lower index."""
    return np.argsort(-pick, axis=-1, kind="stable")[:, :k]


def upstream_sigmoid(logits, bias, k, groups, top_groups, renormalise, scaling):
    """DeepseekV3TopkRouter (groups) / Kimi K3's (one group), f64 numpy."""
    scores = 1 / (1 + np.exp(-logits.astype(np.float64)))
    pick = scores + bias.astype(np.float64)
    if groups > 1:
        per = pick.reshape(len(pick), groups, -1)
        group_scores = np.sort(per, axis=-1)[..., -2:].sum(-1)
        mask = np.zeros_like(group_scores, bool)
        np.put_along_axis(mask, _best_first(group_scores, top_groups), True, axis=-1)
        pick = np.where(np.repeat(mask, pick.shape[1] // groups, axis=-1), pick, -np.inf)
    ids = _best_first(pick, k)
    w = np.take_along_axis(scores, ids, -1)
    if renormalise:
        w = w / w.sum(-1, keepdims=True)
    return ids, _dense(ids, w * scaling, pick.shape[1])


def upstream_softmax(logits, k, renormalise):
    """Qwen3MoeSparseMoeBlock's router: softmax over all experts, top k, renormalised or not."""
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p = p / p.sum(-1, keepdims=True)
    ids = _best_first(p, k)
    w = np.take_along_axis(p, ids, -1)
    return ids, _dense(ids, w / w.sum(-1, keepdims=True) if renormalise else w, p.shape[1])


def upstream_top_k_softmax(logits, k):
    """GptOssTopKRouter: the top k logits, their softmax over those k."""
    ids = _best_first(logits, k)
    top = np.take_along_axis(logits, ids, -1)
    w = np.exp(top - top.max(-1, keepdims=True))
    return ids, _dense(ids, w / w.sum(-1, keepdims=True), logits.shape[1])


BIAS = np.random.default_rng(3).permutation(np.linspace(-0.1, 0.1, E)).astype(np.float32)


def _logits_for(picks: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Logits whose sigmoid plus `bias` is `picks` (to f32 rounding)."""
    score = picks - bias
    assert np.all((score > 0) & (score < 1))
    return np.log(score / (1 - score)).astype(np.float32)


def _row(*groups: tuple[float, float]) -> np.ndarray:
    """A row of corrected scores: each group's two best, then LOW."""
    return np.concatenate([[*g, *LOW] for g in groups])


def _group_rows() -> np.ndarray:
    """Rows 0-3: groups 0 and 1 DELTA apart behind group 2, which leads; the narrow winner has
    the larger best (rows 0, 2) or the larger second (rows 1, 3), at index 0 (rows 0, 3) or 1.
    Row 4: group 3's two best equal (0.8 + 0.8 beats group 1's 0.85 + 0.65; counted once it
    would not). Row 5: groups 0 and 1 exactly tied, the lower taken. Rows 4 and 5 are exact
    ties (read with a zero bias); no two other picks of a row are equal."""
    lead, last = (0.88, 0.6), (0.2, 0.15)
    big_best, big_second = (0.85, 0.3), (0.65, 0.5)
    up = lambda g, i: tuple(v + DELTA * (j == i) for j, v in enumerate(g))     # noqa: E731
    return np.stack([
        _row(up(big_best, 1), big_second, lead, last),
        _row(big_best, up(big_second, 1), lead, last),
        _row(big_second, up(big_best, 1), lead, last),
        _row(up(big_second, 1), big_best, lead, last),
        _row(lead, (0.85, 0.65), last, (0.8, 0.8)),
        _row(big_best, big_best, lead, last),
    ])


def _expert_rows(bias: np.ndarray, groups: int) -> np.ndarray:
    """Two rows where the k-th and (k+1)-th picks, experts a and b (b's correction bias the
    larger by at least 0.1), are DELTA apart, a ahead then b; k - 1 clear leaders in their
    groups (so those groups are the ones eligible), every other pick clear below."""
    a, b = (int(i) for i in np.argsort(bias)[[1, -2]])      # a small bias, a large one
    assert bias[b] - bias[a] > 0.1
    size = E // groups
    mates = [e for e in range(E) if e not in (a, b) and e // size in (a // size, b // size)]
    rows = []
    for ahead in (a, b):
        picks = np.full(E, 0.3)
        picks[mates[:K - 1]] = (0.85, 0.8, 0.75)
        picks[[a, b]] = 0.6
        picks[ahead] += DELTA
        rows.append(picks)
    return np.stack(rows)


def _sigmoid_router(family: str, renormalise: bool = True):
    """A sigmoid router's MoE and dims: DeepSeek-V3's (groups), Kimi K3's (one group, its
    router split: logits lane padded past the experts), Muse Spark's (one group, the router's
    bf16 pair, its logits scaled by `output_multiplier`); E experts, top K, their scaling
    factor 2 (K3's, Muse Spark's) so that it shows."""
    if family == "deepseek":
        d = deepseek.load_config(CONFIG_DIR / "deepseek_v3_mini.json")
        return DEEPSEEK_MOE, dataclasses.replace(d, experts=E, top_k=K, n_group=GROUPS, topk_group=TOP_GROUPS,
                                                 norm_topk_prob=renormalise)
    module, sub, config = {"kimi_k3": (k3, K3_MOE, "kimi_k3_mini"),
                           "muse_spark": (muse_spark, MUSE_SPARK_MOE, "muse_spark_mini")}[family]
    d = module.load_config(CONFIG_DIR / f"{config}.json")
    return sub, dataclasses.replace(d, experts=E, top_k=K, routed_scaling_factor=2.0)


def _sigmoid_rows(family: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """(corrected scores [R, E], correction bias [E]) sets: with groups, the group rows and the
    expert rows under BIAS, then the exact ties under a zero bias; with one group, the expert
    rows, then five equal scores (the four lowest lanes taken) under a zero bias."""
    zero = np.zeros(E, np.float32)
    if family == "deepseek":
        rows = _group_rows()
        return [(np.concatenate([rows[:4], _expert_rows(BIAS, GROUPS)]), BIAS), (rows[4:], zero)]
    tie = np.full(E, 0.45)
    tie[[3, 7, 9, 12, 14]] = 0.7
    return [(_expert_rows(BIAS, 1), BIAS), (tie[None], zero)]


def _kernel_route(sub: MoE, d, logits: np.ndarray, bias: np.ndarray
                  ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's side from the checkpoint: the correction bias as the family's packer puts
    it in the layer's vectors (`weights.vector`), the router's product that gives `logits`
    (the pair's hi columns, lo zero; divided by the router's logit factor; zero columns past
    the experts where the router is split), the lowered `router` and `route` bodies -> (the
    logits they scored, ids best first, dense weights)."""
    hf = {PREFIX + sub.prefix + sub.routing.vector_tensor(sub.routing.bias): bias}
    packed = sub.module("weights").vector(sub, hf, d, PREFIX, sub.routing.bias, 0, ONE_RANK)
    scale = sub.routing.logit_scale(d)
    columns = sub.router_cols(d, {"router": 1}) * (2 if sub.routing.weight_pair else 1)
    product = np.zeros((len(logits), columns), np.float32)
    product[:, :E] = logits / scale if scale is not None else logits
    scored = product[:, :E] * np.float32(scale) if scale is not None else product[:, :E]
    ids, weights = _route_bodies(sub, d, product, {sub.routing.bias: packed[0]})
    return scored, ids, weights


@pytest.mark.parametrize("family, renormalise", [("deepseek", True), ("deepseek", False), ("kimi_k3", True),
                                                 ("muse_spark", True)])
def test_sigmoid_routers_near_a_tie_pick_as_upstream(family, renormalise):
    """Each sigmoid router, the kernel's side (packer and bodies) and the reference's (`route`
    and the harness's `selection_scores` on `route_args` of the checkpoint's tensors), on rows
    where the correction bias or a group score decides a pick by DELTA."""
    sub, d = _sigmoid_router(family, renormalise)
    routing = sub.routing
    for picks, bias in _sigmoid_rows(family):
        logits, ids, weights = _kernel_route(sub, d, _logits_for(picks, bias), bias)
        groups = getattr(d, "n_group", 1)
        want_ids, want = upstream_sigmoid(logits, bias, K, groups, TOP_GROUPS if groups > 1 else 1,
                                          routing.renormalise(d), routing.scaling(d))
        np.testing.assert_array_equal(ids, want_ids)
        np.testing.assert_allclose(weights, want, rtol=1e-6, atol=1e-7)

        p = {"gate.e_score_correction_bias": jnp.asarray(bias)}
        args = moe_ref.route_args(sub, p, d)
        r_ids, r_weights = moe_ref.route(jnp.asarray(logits), *args)
        np.testing.assert_array_equal(np.sort(np.asarray(r_ids), -1), np.sort(want_ids, -1))
        np.testing.assert_allclose(_dense(np.asarray(r_ids), np.asarray(r_weights, np.float64), E), want,
                                   rtol=1e-6, atol=1e-7)
        choices = moe_ref.selection_scores(jnp.asarray(logits), *args)
        experts, k = choices[0] if isinstance(choices, list) else choices
        np.testing.assert_array_equal(_best_first(np.asarray(experts), k), want_ids)
        if family != "deepseek":
            tie = want_ids[-1] if bias is not BIAS else None
            assert tie is None or list(tie) == [3, 7, 9, 12]
        elif bias is BIAS:      # the narrow winners' groups: 0, 1, 1, 0
            assert [0 in i for i in want_ids[:4]] == [True, False, False, True]
        else:                   # the doubled best's group; of two tied, the lower
            assert 12 in want_ids[0] and 0 in want_ids[1] and 4 not in want_ids[1]


@pytest.mark.parametrize("renormalise", [True, False])
def test_softmax_experts_near_a_tie_pick_as_upstream(renormalise):
    """Qwen3-MoE's router: the k-th and (k+1)-th logits DELTA apart each way, and exactly tied."""
    d = dataclasses.replace(qwen3_moe.load_config(CONFIG_DIR / "qwen3_moe_mini.json"), experts=E,
                            top_k=K, norm_topk_prob=renormalise)
    rows = np.zeros((3, E), np.float32)
    rows[:, [1, 6, 11]] = 2.0
    rows[:, [4, 13]] = 1.0
    rows[0, 13] += DELTA
    rows[1, 4] += DELTA
    want_ids, want = upstream_softmax(rows.astype(np.float64), K, renormalise)
    assert 13 in want_ids[0] and 4 in want_ids[1] and 4 in want_ids[2]
    ids, weights = _route_bodies(MoE(), d, rows, {})
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want, rtol=1e-6, atol=1e-7)


def test_gpt_oss_experts_near_a_tie_pick_by_the_routers_bias():
    """GPT-OSS's router: products DELTA apart after its bias, which decides (the expert with
    the smaller product and the larger bias ahead, then behind)."""
    d = dataclasses.replace(gpt_oss.load_config(CONFIG_DIR / "gpt_oss_mini.json"), experts=E, top_k=K)
    a, b = (int(i) for i in np.argsort(BIAS)[[1, -2]])
    rows = np.zeros((2, E), np.float32)
    rows[:, [e for e in range(E) if e not in (a, b)][:K - 1]] = 3.0
    for r, ahead in enumerate((a, b)):
        rows[r, [a, b]] = 1.0 - BIAS[[a, b]]
        rows[r, ahead] += DELTA
    want_ids, want = upstream_top_k_softmax(rows.astype(np.float64) + BIAS, K)
    assert a in want_ids[0] and b in want_ids[1]
    ids, weights = _route_bodies(GPT_OSS_MOE, d, rows, {"router_bias": BIAS})
    np.testing.assert_array_equal(ids, want_ids)
    np.testing.assert_allclose(weights, want, rtol=1e-6, atol=1e-7)
