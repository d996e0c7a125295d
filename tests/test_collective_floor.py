"""benchmarks/collective_floor.py: K3's blocking collectives against every algorithm over the
same ranks and against the latency floor."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import collective_floor  # noqa: E402

from mkc.compiler import check_spec  # noqa: E402
from mkc.perf.run import model  # noqa: E402
from mkc.steps.collectives import AllReduce  # noqa: E402


@pytest.fixture(scope="module")
def k3():
    return check_spec(ROOT / "schedules" / "kimi_k3.sched").ir


def _rows(s, batch):
    mod = model(s, batch)
    calls = collective_floor.blocking_collectives(s, batch, mod.tokens)
    return mod, calls, {(r.kind, r.name): r for r in collective_floor.measure(mod, calls)}


def test_the_floor_is_below_the_best_which_is_below_the_spec(k3):
    mod, calls, rows = _rows(k3, 8)
    assert all(r.floor_s < r.best_s <= r.spec_s for r in rows.values())
    # the shipped spec runs the best algorithm for each
    assert all(r.best == "as written" for r in rows.values())
    # every layer's serial reductions, none overlapped
    assert rows["kda", "allreduce o_proj"].calls == k3.layer_kinds.count("kda")
    assert rows["moe", "allreduce routed_experts"].calls == k3.layer_kinds.count("moe")
    assert not any("shared_down" in name for _, name in rows)
    # a gather over a host's 2 x 2 chips: one copy from the far chip, 2 hops away
    r = mod.rates
    assert rows["moe", "allgather latent_up"].floor_s == pytest.approx(r.ici_copy_s + r.ici_hop_s)


def test_the_routed_sum_scatters_padded_to_whole_lane_tiles_and_one_shot_costs_more(k3):
    """3584 columns over a host's 8 cores: chunks of 448 padded to 512."""
    mod = model(k3, 8)
    calls = collective_floor.blocking_collectives(k3, 8, mod.tokens)
    step = next(st for _, st, _ in calls if isinstance(st, AllReduce) and st.op == "routed_experts")
    assert [r.nbytes for r in step.rounds(8, 2)] == [8 * 512 * 2, 8 * 512 * 2, 8 * 512 * 4]
    alts = dict(collective_floor.alternatives(step, k3, 8))
    assert alts["two_level host scatter (padded)"] == step.rounds(8, 2)
    m = collective_floor.sim.Model(k3, 8, mod.tokens, mod.rates, compiled=mod.measure)
    one_shot, scattered = (sum(m.round_seconds(r) for r in alts[name])
                           for name in ("two_level host", "two_level host scatter (padded)"))
    assert scattered < one_shot


def test_latency_level_meeting_a_target_and_the_docs_row(k3):
    mod, calls, rows = _rows(k3, 8)
    best = sum(r.best_s * r.calls for r in rows.values())
    f = collective_floor.latency_level_for(mod, calls, 0.8e-3)
    assert 0 < f < 1
    spec, floor = (sum(getattr(r, k) * r.calls for r in rows.values()) for k in ("spec_s", "floor_s"))
    row = f"| {spec * 1e3:.3f} | {best * 1e3:.3f} | {floor * 1e3:.3f} | {f:.2f} x the measured latencies |"
    assert row in (ROOT / "docs" / "perf.md").read_text()
    scaled = mod.rates.replace(**{k: getattr(mod.rates, k) * f
                                  for k in collective_floor.LATENCIES})
    at_f = sum(r.best_s * r.calls for r in collective_floor.measure(mod, calls, scaled))
    assert at_f == pytest.approx(0.8e-3, rel=1e-3) and at_f < best
    assert collective_floor.latency_level_for(mod, calls, 10 * best) == 1.0
    assert collective_floor.latency_level_for(mod, calls, 1e-6) is None
