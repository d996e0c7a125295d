"""A seeded fuzz campaign: mutants of the shipped specs, their model configs and paths never
crash, hang or blow up mkc. Every outcome is a clean check (and, for the compiled ones, a
module that imports) or an MkcError whose diagnostics have a location and a hint. The same
generators feed `mkc fmt` (idempotent, the same AST and comments); `mkc retarget` gets
hostile --target, --models and -o values, `mkc check --model` hostile checkpoints (diagnostics,
never tracebacks) and `mkc lsp` hostile sessions (every request answered, no traceback).

The generators, the targets, the worker pool (CPU-time limit, memory cap) and the outcome
classes are the fuzz package's (tests/fuzz); this runs a few cases of every mutation kind of
each target. A failure names each signature with a reproducer: `benchmarks/fuzz_campaign.py
--seed SEED --only I --target T --kind K --emit DIR` writes the case's files.
"""
import subprocess
import sys
import time

import pytest


from fuzz import lsp, pool, retarget
from fuzz.cases import FAILURE_CLASSES
from fuzz.mutations import MUTATIONS, SPEC_TEXT_KINDS
from fuzz.targets import TARGETS, make_case, reproducer

SEED = 9
PER_KIND = 6               # cases of every mutation kind: QUICK in the quick tier, the rest slow
QUICK = 4
CPU_SECONDS = 3.0          # per case; a clean MINI check takes well under 0.5 s
# Cases per (target, kind) in the quick tier besides QUICK of each check kind: the new
# operators and a few others under fmt (hundredths of a second a case), retarget's kinds
# refused at the arguments (a retarget past them models candidate layouts, seconds: the slow
# tier), one checkpoint of each hostile kind (a K3 MINI one takes about 6 CPU seconds) and two
# editor sessions (about 2 s each).
QUICK_MORE = {("fmt", kind): QUICK for kind in ("list_duplicate", "unicode", "token_replace",
                                                "line_swap", "truncate")} | {
    ("fmt", "line_break"): 40, ("retarget", "rt_huge"): QUICK, ("retarget", "rt_malformed"): QUICK,
    ("lsp", "lsp_session"): 2} | {("checkpoint", kind): 1 for kind in TARGETS["checkpoint"].kinds()}
SLOW_MORE = ({("retarget", kind): 3 for kind in retarget.KINDS}
             | {("checkpoint", kind): 2 for kind in TARGETS["checkpoint"].kinds()}
             | {("lsp", "lsp_session"): 4})
TARGET_OFFSET = {"check": 0, "fmt": 100_000, "retarget": 200_000, "checkpoint": 300_000,
                 "lsp": 400_000}                                    # unique case numbers


def _cases(target: str, counts: dict, first: int = 0) -> list[tuple[int, str, str]]:
    """(case number, forced kind, target): case numbers are unique, so each is reproducible alone."""
    kinds = list(TARGETS[target].kinds())
    return [(TARGET_OFFSET[target] + kinds.index(kind) * 1000 + j, kind, target)
            for kind, n in counts.items() for j in range(first, first + n)]


def _counts(table: dict, target: str) -> dict:
    return {kind: n for (t, kind), n in table.items() if t == target}


def _campaign(cases: list[tuple[int, str, str]]) -> list[dict]:
    return pool.run_campaign(SEED, cases, workers=2, timeout=CPU_SECONDS, mem_gib=4.0,
                           compile_fraction=0.25)


@pytest.fixture(scope="module")
def outcomes() -> list[dict]:
    return _campaign(_cases("check", {kind: QUICK for kind in MUTATIONS})
                     + _cases("fmt", _counts(QUICK_MORE, "fmt"))
                     + _cases("retarget", _counts(QUICK_MORE, "retarget"))
                     + _cases("checkpoint", _counts(QUICK_MORE, "checkpoint"))
                     + _cases("lsp", _counts(QUICK_MORE, "lsp")))


@pytest.fixture(scope="module")
def more_outcomes() -> list[dict]:
    return _campaign(_cases("check", {kind: PER_KIND - QUICK for kind in MUTATIONS}, QUICK)
                     + _cases("fmt", {kind: PER_KIND - QUICK for kind in SPEC_TEXT_KINDS}, 100)
                     + _cases("retarget", _counts(SLOW_MORE, "retarget"), 100)
                     + _cases("checkpoint", _counts(SLOW_MORE, "checkpoint"), 100)
                     + _cases("lsp", _counts(SLOW_MORE, "lsp"), 100))


def _describe(failures: list[dict]) -> str:
    by_sig: dict[str, dict] = {}
    for r in failures:
        by_sig.setdefault(f"{r['cls']}: {r.get('sig', '')}", r)
    out = []
    for sig, r in by_sig.items():
        case = make_case(SEED, r["index"], 0.25, r["kind"], r["target"])
        out.append(f"{sig}\n{r.get('detail', '')[:400]}\n{reproducer(case)}"
                   f"\n(--seed {SEED} --only {r['index']} --target {r['target']} --kind {r['kind']})")
    return "\n\n".join(out)


def _judge(outcomes: list[dict], target: str, kind: str, count: int) -> None:
    mine = [r for r in outcomes if r["target"] == target and r["kind"] == kind]
    assert len(mine) == count
    failures = [r for r in mine if r["cls"] in FAILURE_CLASSES]
    assert not failures, (f"{len(failures)} of {len(mine)} {target} {kind} mutants failed:\n"
                          + _describe(failures))


def _params(pairs) -> list:
    return [pytest.param(t, k, id=f"{t}-{k}") for t, k in pairs]


QUICK_COUNTS = {("check", kind): QUICK for kind in MUTATIONS} | QUICK_MORE
SLOW_COUNTS = ({("check", kind): PER_KIND - QUICK for kind in MUTATIONS}
               | {("fmt", kind): PER_KIND - QUICK for kind in SPEC_TEXT_KINDS} | SLOW_MORE)


@pytest.mark.parametrize("target,kind", _params(QUICK_COUNTS))
def test_mutants_give_diagnostics_not_crashes(outcomes, target, kind):
    _judge(outcomes, target, kind, QUICK_COUNTS[target, kind])


# CI fuzzes QUICK cases of every kind (the quick tier); the extended tier the rest.
@pytest.mark.extended
@pytest.mark.parametrize("target,kind", _params(SLOW_COUNTS))
def test_more_mutants_give_diagnostics_not_crashes(more_outcomes, target, kind):
    _judge(more_outcomes, target, kind, SLOW_COUNTS[target, kind])


def test_the_campaign_sees_both_outcomes(outcomes):
    """The mutants reach the checker, the formatter and retarget's checks: many are rejected
    with diagnostics, some pass. Every hostile checkpoint is refused with a diagnostic; every
    session ends with each request answered."""
    for target in ("check", "fmt", "retarget"):
        classes = [r["cls"] for r in outcomes if r["target"] == target]
        assert classes.count("diagnostic") > len(classes) // 4, target
        assert target == "retarget" or classes.count("ok") > 0, target
    assert {r["cls"] for r in outcomes if r["target"] == "checkpoint"} == {"diagnostic"}
    assert {r["cls"] for r in outcomes if r["target"] == "lsp"} == {"ok"}


SESSION_OK = {"unanswered": [], "tracebacks": [], "died": False, "exit_code": 0, "stderr": ""}


@pytest.mark.parametrize("report,cls", [
    ({}, "ok"),
    ({"unanswered": ["frame 5: no answer in 10 s"]}, "lsp_unanswered"),
    ({"tracebacks": [{"stderr": 'Traceback (most recent call last):\n  File "/x/mkc/lsp.py", line 9, '
                                'in hover\nKeyError: 1'}]}, "traceback"),
    ({"died": True, "exit_code": -11}, "crash"),
    ({"exit_code": 1}, "crash"),
    ({"exit_code": None}, "hang"),
])
def test_an_lsp_session_is_classified(monkeypatch, tmp_path, report, cls):
    """run_session's report becomes the case's class; a traceback's signature is its mkc frame."""
    monkeypatch.setattr(lsp, "run_session", lambda frames, timeout: SESSION_OK | report)
    case = make_case(SEED, 0, target="lsp")
    outcome = lsp.run(case, tmp_path, {})
    assert outcome["cls"] == cls
    if cls == "traceback":
        assert outcome["sig"] == "traceback @ mkc/lsp.py:hover"


# A child that computes for a fraction of a CPU second in a grandchild (as an lsp case's server
# computes while its worker waits), then blocks on its input without computing.
_COMPUTES_THEN_BLOCKS = ("import subprocess, sys; subprocess.run([sys.executable, '-c', 'import time\\n"
                         "t = time.process_time()\\nwhile time.process_time() - t < 0.3: pass']); "
                         "sys.stdin.read()")


def test_a_case_is_judged_by_cpu_time_not_wall_time():
    """On a loaded machine a case's wall time runs far ahead of its CPU time: a case sent an
    hour ago that has computed since (its worker's children count) is not overdue; one blocked
    for a minute without computing is."""
    proc = subprocess.Popen([sys.executable, "-c", _COMPUTES_THEN_BLOCKS], stdin=subprocess.PIPE)
    try:
        worker = pool.Worker.__new__(pool.Worker)       # the pool's judge of this process
        worker.proc, worker.ready = proc, True
        hour_ago = time.monotonic() - 3600
        worker.interrupted, worker.case_timeout, worker.cpu0 = False, 10.0, worker.cpu()
        worker.progress, worker.deadline = (worker.cpu0, hour_ago), hour_ago + 30
        give_up = time.monotonic() + 120
        while worker.cpu() - worker.cpu0 < 0.3 and time.monotonic() < give_up:
            time.sleep(0.05)
        assert worker.cpu() - worker.cpu0 >= 0.3      # the grandchild's CPU, seen
        assert not worker.overdue(10.0)
        # then blocked: no more CPU (a loaded machine may run the grandchild's last slices later)
        last = worker.cpu()
        while time.monotonic() < give_up:
            time.sleep(0.5)
            if (now := worker.cpu()) == last:
                break
            last = now
        worker.progress = (worker.cpu(), time.monotonic() - pool.STALL_SECONDS - 1)
        assert worker.overdue(10.0)                   # blocked on its input since
        worker.cpu0 -= 10.0
        assert worker.overdue(10.0)                   # past its CPU seconds
    finally:
        proc.kill()
        proc.wait()
