"""The compiled price of K3's routed-expert formats against libtpu's own schedule of one pack
group (benchmarks/format_probe.py --bundles): their ratio must follow it."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mkc import compiler
from mkc.perf import bundles, constants
from mkc.perf.sim import Model

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import bundles as shipped  # noqa: E402
import format_probe  # noqa: E402


@pytest.mark.slow
def test_expert_formats_are_priced_in_libtpu_s_proportions():
    """The price of one routed expert (a read of its slot: the compiled loop's iteration) at
    batch 8 in MXFP4, FP8 with 32-row scales and FP8 blocks, against the bundles libtpu
    schedules for 8 rows through one pack group of each: within 30 % (the probe's one group
    carries fixed work the kernel's loop spreads over its experts: K3's kernels read the MXFP4 :
    FP8-block ratio at 2.75, the probe at 2.2)."""
    price, cycles = {}, {}
    for fmt in shipped.K3_FORMATS:
        s = compiler.check_source(shipped.format_text(shipped.K3_SPEC, fmt), str(shipped.K3_SPEC)).ir
        measure = bundles.cached(s, "decode", 8)
        assert measure is not None, (f"no compiled measure of K3 with {fmt} experts for this "
                                     "code: .venv/bin/python benchmarks/bundles.py --only experts")
        m = Model(s, 8, s.context, constants.rates(s.chip), compiled=measure)
        price[fmt] = m.op_prices("moe", "routed_experts")[2]
        assert price[fmt] > 0
        cycles[fmt] = {r["key"]: r for r in measure["rows"]}["moe.routed_experts"]["per_iteration"]
    probe = {}
    for fmt in shipped.K3_FORMATS:
        verdict = format_probe.bundles("tpu7x", fmt)
        probe[fmt] = int(verdict.split()[0])
    for fmt in ("mxfp4", "fp8"):
        assert price[fmt] / price["fp8 block"] == pytest.approx(
            probe[fmt] / probe["fp8 block"], rel=0.30), (price, probe)
    said = " : ".join(f"{cycles[f]:.0f}" for f in ("mxfp4", "fp8", "fp8 block")) + " cycles"
    assert said in (ROOT / "docs" / "perf.md").read_text(), said
