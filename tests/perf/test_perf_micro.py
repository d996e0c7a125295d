"""The step-time model against each published TPU7x micro-case (remote copies, the reference
kernel's all-gathers and all-reduces, its dense ring, a small matmul), priced through the
functions `mkc perf` uses (`benchmarks/validate_perf.py`): each within 15 % of its measurement.
"""
from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import validate_perf  # noqa: E402

from mkc.perf import constants  # noqa: E402
from mkc.compiler import check_spec  # noqa: E402
from mkc.steps.collectives import AllReduce, Round  # noqa: E402

PUBLISHED = json.loads(validate_perf.POINTS.read_text())
TOLERANCE = 0.15


@pytest.fixture(scope="module")
def host():
    return validate_perf.host_model()


@pytest.mark.parametrize("case", PUBLISHED["micro"], ids=lambda c: c["case"])
def test_each_published_micro_case_within_15_percent(case, host):
    got = validate_perf.micro_seconds(case, host)
    assert got == pytest.approx(case["measured_s"], rel=TOLERANCE), (
        f"{case['case']}: modelled {got * 1e6:.2f} us, measured {case['measured_s'] * 1e6:.2f} us")


def test_the_recorded_validation_is_what_the_model_prices_now(host):
    """tpu7x.json's `validation.micro` (rerun benchmarks/validate_perf.py after a model change)."""
    recorded = {m["case"]: m for m in constants.validation("tpu7x")["micro"]}
    for case in PUBLISHED["micro"]:
        assert recorded[case["case"]]["modelled_s"] == pytest.approx(
            validate_perf.micro_seconds(case, host), rel=1e-5), case["case"]


def test_copies_issue_one_after_another_and_share_the_chips_links(host):
    """A round's copies: the sibling's after the far ones' issue; copies to one chip share this
    core's link to it; the chip's cores together share its egress."""
    r, kib = host.rates, 1 << 10
    entry = r.collective_entry_s
    assert host.stage_seconds(2, 1, 64 * kib) == pytest.approx(
        r.sibling_copy_s - entry + 64 * kib / r.sibling_bytes_per_s)
    one = host.stage_seconds(2, 2, 64 * kib)
    assert one == pytest.approx(r.ici_copy_s - entry + 64 * kib / r.ici_link_bytes_per_s)
    # ranks 0, 2, 4, 6: one peer on each other chip, both cores of every chip sending at once
    three = host.stage_seconds(4, 2, 64 * kib)
    assert three == pytest.approx(r.ici_copy_s - entry + 2 * 3 * 64 * kib / r.ici_chip_bytes_per_s)
    # small copies to the 7 others: the issue chain decides, the sibling's copy last
    small = host.stage_seconds(8, 1, 1 * kib)
    assert small == pytest.approx(6 * r.remote_issue_s + r.sibling_copy_s - entry
                                  + kib / r.sibling_bytes_per_s)
    # an extra hop past the first costs ici_hop_s (the diagonal chip of a 2x2 host is 2 hops)
    hop = host.rates.replace(ici_hop_s=1e-6)
    far = type(host)(host.s, 1, 0, hop)
    assert far.stage_seconds(2, 6, 64 * kib) == pytest.approx(one + 1e-6)


def test_a_collective_pays_the_copies_entry_once_not_in_every_round(host):
    """A lone copy is the entry and one round; chained rounds add only their own part."""
    r, kib = host.rates, 1 << 10
    assert r.collective_entry_s > 0
    rounds = (Round(4, 2, 16 * kib), Round(2, 1, 64 * kib))
    assert host.collective_seconds(rounds) == pytest.approx(
        r.collective_entry_s + sum(host.round_seconds(rd) for rd in rounds))
    assert host.round_seconds(rounds[0], first=True) == pytest.approx(
        host.round_seconds(rounds[0]) + r.collective_entry_s)


def test_every_tpu7x_constant_is_measured_or_assumed_with_a_range():
    """No constant is fitted; an assumed one carries the range the validation sweeps."""
    for name, c in constants.load_data("tpu7x")["constants"].items():
        kind = c["source"].split(":")[0]
        assert kind in ("measured", "assumed"), (name, c["source"])
        if kind == "assumed":
            lo, hi = c["range"]
            assert lo <= c["value"] <= hi, name
            assert name in constants.validation("tpu7x")["sensitivity"], name


def test_reference_rounds_move_the_reference_kernel_s_bytes():
    """The direct all-reduce of [8, 8192] on a bf16 wire: 8 column blocks of [8, 1024] bf16,
    scattered then gathered; the hierarchical one: halves over the sibling, quarters across."""
    direct = validate_perf.reference_rounds({"allreduce": "direct", "rows": 8, "width": 8192,
                                             "wire": "bf16"})
    assert [(r.size, r.stride, r.nbytes) for r in direct] == [(8, 1, 16384), (8, 1, 16384)]
    hier = validate_perf.reference_rounds({"allreduce": "hierarchical", "rows": 8, "width": 8192,
                                           "wire": "bf16"})
    assert [(r.size, r.stride, r.nbytes) for r in hier] == [
        (2, 1, 65536), (4, 2, 16384), (4, 2, 16384), (2, 1, 65536)]
    assert isinstance(hier[0], Round)


def test_the_reference_kernels_all_reduces_are_spec_clauses():
    """The reference kernel's all-reduces of the published micro-cases are what two spec
    clauses build (the same groups, bytes and sums, round by round): reduce-scatter +
    all-gather on the bf16 wire is `direct wire bf16 scatter gather bf16`; the hierarchical one
    `two_level chip wire bf16 scatter nested gather bf16` (Muse Spark's batch-8 sum of its
    picks' outputs, [8, 8 x 4096] as [64, 4096])."""
    spec = ROOT / "benchmarks" / "data" / "calibration" / "muse_spark.sched"
    s = check_spec(spec).ir
    direct = next(a for a in s.kinds["moe"].allreduces if a.after_op == "routed_experts")
    hierarchical = replace(direct, algorithm="two_level", stages=((2, 1), (4, 2)), nested=True)
    for entry, name in ((direct, "direct"), (hierarchical, "hierarchical")):
        assert (entry.wire_dtype, entry.gather_dtype, entry.scatter_from) == ("bf16", "bf16", 1)
        got = AllReduce(0, op="routed_experts", entry=entry).rounds(8, s.cores_per_chip)
        want = validate_perf.reference_rounds({"allreduce": name, "rows": 64, "width": 4096,
                                               "wire": "bf16"})
        assert [(r.size, r.stride, r.nbytes, r.sums) for r in got] == [
            (r.size, r.stride, r.nbytes, r.sums) for r in want], name
