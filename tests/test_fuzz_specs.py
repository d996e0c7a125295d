"""A seeded fuzz campaign: mutants of both shipped specs, their model configs and paths never
crash, hang or blow up mkc. Every outcome is a clean check (and, for the compiled ones, a
module that imports) or an MkcError whose diagnostics have a location and a hint.

The generators, the worker pool (CPU-time limit, memory cap) and the outcome classes are
`benchmarks/fuzz_campaign.py`'s; this runs a few cases of every mutation kind. A failure names
each signature with a reproducer: `benchmarks/fuzz_campaign.py --seed SEED --only I --kind K
--emit DIR` writes the case's files.
"""
import sys

import pytest

from tests_support import ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import fuzz_campaign as fc  # noqa: E402

SEED = 9
PER_KIND = 12              # cases of every mutation kind: QUICK in the quick tier, the rest slow
QUICK = 4
CPU_SECONDS = 3.0          # per case; a clean MINI check takes well under 0.5 s


def _cases(first: int, last: int) -> list[tuple[int, str]]:
    """(case number, forced kind): case numbers are unique, so each is reproducible alone."""
    return [(k * 1000 + j, kind) for k, kind in enumerate(fc.MUTATIONS) for j in range(first, last)]


def _campaign(cases: list[tuple[int, str]]) -> list[dict]:
    return fc.run_campaign(SEED, cases, workers=2, timeout=CPU_SECONDS, mem_gib=4.0,
                           compile_fraction=0.25)


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return _campaign(_cases(0, QUICK))


@pytest.fixture(scope="module")
def more_outcomes() -> list[dict]:
    return _campaign(_cases(QUICK, PER_KIND))


def _describe(failures: list[dict]) -> str:
    by_sig: dict[str, dict] = {}
    for r in failures:
        by_sig.setdefault(f"{r['cls']}: {r.get('sig', '')}", r)
    out = []
    for sig, r in by_sig.items():
        case = fc.make_case(SEED, r["index"], 0.25, r["kind"])
        out.append(f"{sig}\n{r.get('detail', '')[:400]}\n{fc.reproducer(case)}"
                   f"\n(--seed {SEED} --only {r['index']} --kind {r['kind']})")
    return "\n\n".join(out)


def _judge(outcomes: list[dict], kind: str, count: int) -> None:
    mine = [r for r in outcomes if r["kind"] == kind]
    assert len(mine) == count
    failures = [r for r in mine if r["cls"] in fc.FAILURE_CLASSES]
    assert not failures, f"{len(failures)} of {len(mine)} {kind} mutants failed:\n" + _describe(failures)


@pytest.mark.parametrize("kind", list(fc.MUTATIONS))
def test_mutants_give_diagnostics_not_crashes(outcomes, kind):
    _judge(outcomes, kind, QUICK)


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(fc.MUTATIONS))
def test_more_mutants_give_diagnostics_not_crashes(more_outcomes, kind):
    _judge(more_outcomes, kind, PER_KIND - QUICK)


def test_the_campaign_sees_both_outcomes(outcomes):
    """The mutants reach the checker: many are rejected with diagnostics, some pass."""
    classes = [r["cls"] for r in outcomes]
    assert classes.count("diagnostic") > len(classes) // 3
    assert classes.count("ok") > 0
