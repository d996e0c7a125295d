"""A worker process: it runs cases one at a time (`run_case`) and classifies each outcome."""
from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

from fuzz.cases import Case, normalized
from fuzz.targets import TARGETS, TargetUnavailable, make_case


def _mkc_frame(tb_frames, mkc_dir: str) -> str:
    inner = [f for f in tb_frames if f.filename.startswith(mkc_dir)]
    if not inner:
        return "no mkc frame"
    f = inner[-1]
    return f"mkc/{os.path.relpath(f.filename, mkc_dir)}:{f.name}"


def run_case(case: Case, work: Path) -> dict:
    """Run one case in the current process with its target; its outcome."""
    import traceback

    import mkc
    from mkc.diagnostics import MkcError
    mkc_dir = os.path.dirname(mkc.__file__) + os.sep
    d = work / f"case{case.index}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    os.chdir(d)
    res = {"index": case.index, "kind": case.kind, "base": case.base, "target": case.target,
           "stage": "check"}
    try:
        res.update(TARGETS[case.target].run(case, d, res))
    except MkcError as e:
        res.update(_diagnostic_outcome(e, case.spec.decode("utf-8", errors="replace"), res["stage"]))
    except TargetUnavailable as e:
        res.update(cls="crash", sig=f"target {case.target} unavailable", detail=str(e))
    except CaseTimeout as e:             # the pool's SIGUSR2 at the deadline: where it was
        frames = traceback.extract_tb(e.__traceback__)
        mk = [f for f in frames if f.filename.startswith(mkc_dir)
              and not f.filename.endswith("compiler.py")][:3]
        res.update(cls="hang", sig="hang @ " + (" > ".join(
            f"mkc/{os.path.relpath(f.filename, mkc_dir)}:{f.name}" for f in mk) or "no mkc frame"),
            detail=_frames_text(frames, 6))
    except MemoryError as e:
        frames = traceback.extract_tb(e.__traceback__)
        res.update(cls="memory", sig=f"{res['stage']}: MemoryError @ {_mkc_frame(frames, mkc_dir)}",
                   detail=_frames_text(frames), restart=True)
    except BaseException as e:          # noqa: BLE001 - RecursionError, SystemExit, anything
        frames = traceback.extract_tb(e.__traceback__)
        res.update(cls="traceback",
                   sig=f"{res['stage']}: {type(e).__name__} @ {_mkc_frame(frames, mkc_dir)}",
                   detail=f"{type(e).__name__}: {str(e)[:300]}\n{_frames_text(frames)}")
    finally:
        os.chdir(work)
        shutil.rmtree(d, ignore_errors=True)
    if case.target != "check" and res.get("sig"):      # signatures name their target
        res["sig"] = f"[{case.target}] {res['sig']}"
    res.pop("stage")
    return {k: v for k, v in res.items() if v is not None}


def _diagnostic_outcome(e, source: str, stage: str) -> dict:
    """An MkcError's class: diagnostic if every diagnostic has a file, line, column, code and
    hint and the error renders; else bad_diagnostic."""
    bad = []
    for dg in e.diagnostics:
        s = dg.span
        if not (s.file and s.line >= 1 and s.column >= 1 and dg.hint and dg.code):
            bad.append(f"{dg.code}: file={s.file!r} line={s.line} column={s.column} "
                       f"hint={bool(dg.hint)}")
    try:
        e.render(source)
    except Exception as r:              # noqa: BLE001 - classify, do not crash the worker
        bad.append(f"render raises {type(r).__name__}")
    if not bad:
        return {"cls": "diagnostic", "codes": e.codes}
    return {"cls": "bad_diagnostic", "codes": e.codes,
            "sig": f"{stage}: {bad[0].split(':')[0]} "
                   f"{normalized(bad[0].split(':', 1)[1]) if ':' in bad[0] else ''}",
            "detail": "; ".join(bad) + f" | {str(e)[:300]}"}


class CaseTimeout(BaseException):
    """Raised in a worker by SIGUSR2 when its case overran (not an Exception: mkc cannot catch it)."""


def _frames_text(frames, n: int = 4) -> str:
    return "\n".join(f"  {f.filename}:{f.lineno} in {f.name}" for f in frames[-n:])


def worker_main(work: str, mem_bytes: int, timeout: float, compile_fraction: float,
                preimport: bool) -> None:
    """Serve cases: read `seed index [kind]` lines on stdin, answer one JSON line each."""
    import faulthandler
    import resource
    os.nice(10)
    try:                                 # Linux: die with the pool, even in a hanging case
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if mem_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                        # anything the checker or a module prints goes to stderr
    sys.setrecursionlimit(10000)
    import mkc.compiler  # noqa: F401
    if preimport:                        # a generated module's imports, paid once per worker
        from jax.experimental.pallas import tpu  # noqa: F401
    workdir = Path(work)
    stack = open(workdir / "stack.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack)    # the pool asks for a stack on a hang

    def overran(*_):
        raise CaseTimeout
    signal.signal(signal.SIGUSR2, overran)               # the pool interrupts an overrunning case
    proto.write("READY\n")
    for line in sys.stdin:
        seed, index, target, *kind = line.split()
        t0 = time.perf_counter()
        try:
            res = run_case(make_case(int(seed), int(index), compile_fraction, kind[0] if kind else None,
                                     target), workdir)
        except MemoryError:
            res = {"index": int(index), "cls": "memory", "sig": "MemoryError in the harness",
                   "restart": True}
        res["seconds"] = round(time.perf_counter() - t0, 4)
        proto.write(json.dumps(res) + "\n")
        if res.get("restart"):
            return

