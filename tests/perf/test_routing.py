"""The slowest expert group: the exact law of the most experts any covered group runs, against
an exhaustive count, a fixed-seed Monte Carlo and the mean; the groups a spec's reduce covers;
the simulator weighing the two whole counts around the expectation."""
import itertools
from fractions import Fraction

import numpy as np
import pytest

from mkc import cost
from mkc.compiler import check_spec
from mkc.perf import constants, routing
from mkc.perf.run import expert_mix, expected_experts, perf_trace, step_model
from mkc.perf.sim import Model, simulate
from tests_support import K3_SPEC, ROOT

QWEN_MOE = ROOT / "schedules" / "qwen3_5_35b_a3b.sched"


def _exhaustive(E, k, G, covered, B):
    """P(max = m) by listing every way B rows can pick k of E experts."""
    n = E // G
    subsets = list(itertools.combinations(range(E), k))
    counts: dict[int, int] = {}
    for rows in itertools.product(subsets, repeat=B):
        picked = set().union(*rows)
        m = max(sum(1 for e in picked if e // n == g) for g in range(covered))
        counts[m] = counts.get(m, 0) + 1
    total = len(subsets) ** B
    return tuple(Fraction(counts.get(m, 0), total) for m in range(max(counts) + 1))


@pytest.mark.parametrize("E,k,G,covered,B", [(6, 2, 3, 3, 2), (8, 2, 4, 4, 2), (8, 3, 2, 2, 2),
                                             (6, 2, 3, 2, 3), (8, 2, 4, 1, 2)])
def test_exact_law_equals_an_exhaustive_count(E, k, G, covered, B):
    exact = routing.max_distribution(E, k, G, covered, B)
    brute = _exhaustive(E, k, G, covered, B)
    assert exact[:len(brute)] == brute and not any(exact[len(brute):])
    assert sum(exact) == 1


def test_union_size_law_is_a_distribution_with_the_known_mean():
    E, k, B = 896, 16, 8
    pu = routing.union_size_distribution(E, k, B)
    assert sum(pu) == 1 and not any(pu[:k])
    mean = sum(u * p for u, p in enumerate(pu))
    assert float(mean) == pytest.approx(E * (1 - (1 - k / E) ** B), rel=1e-12)


def test_one_group_gives_the_mean_and_more_groups_a_larger_maximum():
    E, k, G = 256, 8, 8
    for B in (1, 2, 8):
        one = routing.expected_max(E, k, G, 1, B)
        assert one == pytest.approx(routing.expected_mean(E, k, G, B), rel=1e-12)
        maxima = [routing.expected_max(E, k, G, c, B) for c in range(1, G + 1)]
        assert all(b > a for a, b in zip(maxima, maxima[1:]))
    assert routing.expected_max(E, k, G, G, 8) > routing.expected_max(E, k, G, G, 4)


def test_monte_carlo_with_a_fixed_seed_agrees():
    """Kimi K3's routing (896 experts, top 16, 8 groups) at batch 1 and 8."""
    E, k, G = 896, 16, 8
    n, samples = E // G, 4000
    rng = np.random.default_rng(20261201)
    for B in (1, 8):
        keys = rng.random((samples, B, E))
        picks = np.argpartition(keys, k, axis=-1)[..., :k]          # k distinct per row
        hit = np.zeros((samples, E), bool)
        np.put_along_axis(hit, picks.reshape(samples, B * k), True, axis=-1)
        per_group = hit.reshape(samples, G, n).sum(-1)
        mc = per_group.max(-1)
        exact = routing.expected_max(E, k, G, G, B)
        assert abs(mc.mean() - exact) < 4 * mc.std() / samples ** 0.5, (B, mc.mean(), exact)
        assert per_group.mean() == pytest.approx(routing.expected_mean(E, k, G, B), rel=0.02)


def test_a_spec_reduces_routed_experts_over_every_group():
    k3 = check_spec(K3_SPEC).ir
    assert routing.reduce_peers(k3) == set(range(32))
    assert routing.expert_groups(k3) == (8, 8)                # EP8, TP4 within a group
    moe = check_spec(QWEN_MOE).ir
    assert routing.reduce_peers(moe) == set(range(8))
    assert routing.expert_groups(moe) == (8, 8)               # one group per core
    for s in (k3, moe):
        for B in (1, 8):
            slowest = expected_experts(s, B)
            assert slowest == pytest.approx(routing.expected_max(
                s.experts_total, s.top_k, 8, 8, B))
            assert slowest > cost.expected_local_experts(s, B)
    assert expected_experts(k3, 1) == pytest.approx(4.1762, abs=1e-4)
    assert expected_experts(check_spec(ROOT / "schedules" / "qwen3_8_27b.sched").ir, 1) is None


def test_the_modelled_step_weighs_the_two_whole_counts_around_the_expectation():
    s = check_spec(QWEN_MOE).ir
    x = expected_experts(s, 8)
    mix = expert_mix(s, 8)
    assert [n for n, _ in mix] == [int(x), int(x) + 1]
    assert sum(w for _, w in mix) == pytest.approx(1)
    assert sum(n * w for n, w in mix) == pytest.approx(x)
    res = step_model(s, 8, 1024, keep_timeline=False)
    whole = [simulate(Model(s, 8, 1024, constants.rates("tpu7x")), perf_trace(s, 8, 1024, experts=n),
                      keep_timeline=False).step_s for n, _ in mix]
    assert whole[0] < res.step_s < whole[1]
    assert res.step_s == pytest.approx(sum(w * t for (_, w), t in zip(mix, whole)))
    assert res.experts == pytest.approx(x) and res.parts == tuple(mix)
    assert sum(res.by_cause.values()) == pytest.approx(res.step_s)
    # a picture shows one concrete step: the nearer whole count
    pic = step_model(s, 8, 1024).concrete()
    assert pic.experts == round(x) and pic.timeline


def test_perf_reports_the_slowest_core_and_its_floor_beside_the_mean():
    from mkc.perf.run import run
    rep = run(check_spec(QWEN_MOE).ir, 8, 1024)
    assert rep["routed_experts_per_layer"] == pytest.approx(expected_experts(
        check_spec(QWEN_MOE).ir, 8))
    assert rep["routed_experts_per_layer_mean"] < rep["routed_experts_per_layer"]
    assert [p["experts"] for p in rep["routed_experts_simulated"]] == [10, 11]
    assert rep["slowest_core_hbm_floor_seconds"] > rep["hbm_floor_seconds"]
    dense = run(check_spec(ROOT / "schedules" / "qwen3_8_27b.sched").ir, 8, 1024)
    assert dense["slowest_core_hbm_floor_seconds"] == dense["hbm_floor_seconds"]
    assert dense["routed_experts_per_layer"] is None and not dense["routed_experts_simulated"]


def test_routing_as_fewer_independent_rows_bounds_a_step():
    """`--routing one`: every row picks the same experts, so a batch of 8 runs batch 1's experts
    and moves batch 1's expert bytes, and is faster than uniform routing; `sequences`: a verify
    step's rows of one sequence alike, the same as `one` for one sequence."""
    from mkc.perf.run import model, report
    s = check_spec(QWEN_MOE).ir
    rows, one = (report(model(s, 8, 1024, routing=r)) for r in ("rows", "one"))
    assert one["routed_experts_per_layer"] == pytest.approx(expected_experts(s, 1))
    assert one["routed_experts_per_layer_mean"] == pytest.approx(cost.expected_local_experts(s, 1))
    assert one["routing"] == "one"
    assert one["step_seconds"] < rows["step_seconds"]
    assert one["hbm_floor_seconds"] < rows["hbm_floor_seconds"]
    verify = {r: report(model(s, 1, 1024, verify_rows=4, routing=r))["step_seconds"]
              for r in ("sequences", "one", "rows")}
    assert verify["sequences"] == verify["one"] < verify["rows"]
