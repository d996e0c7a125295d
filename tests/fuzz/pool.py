"""The campaign's pool of long-lived worker processes: CPU-time limits, a memory cap, hangs
found by a stack dump, crashes by a worker's exit."""
from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fuzz.cases import FAILURE_CLASSES, PERF_TIMEOUT_FACTOR, ROOT, models_steps
from fuzz.targets import TARGETS, external, make_case, target_of

# A case blocked without computing (on a pipe, a lock) is a hang after this much wall time in
# which it and its children gained less than STALL_CPU_SECONDS: a computing process gets more
# on a machine loaded hundreds of times over. No wall-clock limit on a case that computes.
STALL_SECONDS = 60.0
STALL_CPU_SECONDS = 0.1


class Worker:
    def __init__(self, args: list[str], work: Path, log: Path):
        self.work = work
        self.log = open(log, "ab")
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "tests"), str(ROOT), env.get("PYTHONPATH", "")]
                                            ).rstrip(os.pathsep)
        self.proc = subprocess.Popen([sys.executable, "-m", "fuzz", "--worker",
                                      str(work), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=work, env=env)
        self.buf = b""
        self.current: int | None = None
        self.deadline = time.monotonic() + 300      # start-up: imports on a loaded machine
        self.ready = False
        self.cpu0 = 0.0
        self.interrupted = False         # SIGUSR2 sent for the current case
        self.case_timeout = 0.0          # CPU seconds the current case may take
        self.progress = (0.0, 0.0)       # (CPU seconds, monotonic time) when it last computed

    def cpu(self) -> float:
        """CPU seconds the worker and its children (an lsp case's server) have used: the
        machine may be shared, so a hang is measured in CPU time, and a case blocked without
        computing by a stretch of wall time without CPU progress."""
        (process_cpu,) = external("lsp", "process_cpu")
        return process_cpu(self.proc.pid)

    def overdue(self, timeout: float) -> bool:
        now = time.monotonic()
        if not self.ready:
            return now > self.deadline
        cpu = self.cpu()
        if cpu - self.cpu0 > max(timeout, self.case_timeout):
            return True
        if self.interrupted:             # asked where it is: it has until the deadline to say
            return now > self.deadline
        if cpu - self.progress[0] >= STALL_CPU_SECONDS:
            self.progress = (cpu, now)
        return now - self.progress[1] > STALL_SECONDS

    def send(self, seed: int, index: int, kind: str | None, target: str, timeout: float) -> None:
        self.current = index
        self.interrupted = False
        self.cpu0 = self.cpu()
        self.case_timeout = timeout
        self.progress = (self.cpu0, time.monotonic())
        self.proc.stdin.write(f"{seed} {index} {target} {kind or ''}\n".encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def _stack_signature(path: Path, mkc_dir: str) -> tuple[str, str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "no stack dump", ""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
    # faulthandler lists the most recent call first (the pool asks for the dump with SIGUSR1
    # at the deadline). The signature is the outermost three mkc frames below the compiler
    # driver, where the unbounded loop is entered; the innermost frame moves with the moment.
    mk = [(f, ln, fn) for f, ln, fn in frames if f.startswith(mkc_dir)]
    detail = "\n".join(f"  {a}:{b} in {c}" for a, b, c in frames[:7])
    if not mk:
        lines = [f"{Path(f).name}:{fn}" for f, _, fn in frames[:1]]
        return f"no mkc frame ({lines[0] if lines else 'empty dump'})", detail
    outer = [x for x in reversed(mk) if not x[0].endswith("compiler.py")][:3]
    return " > ".join(f"mkc/{os.path.relpath(f, mkc_dir)}:{fn}" for f, _, fn in outer), detail


class _Progress:
    """The campaign's progress when asked: a bar on stderr on a terminal; otherwise (a log) a
    line on stdout every 30 s."""

    def __init__(self, total: int, show: bool):
        from mkc.progress import bar
        self.bar = bar(total=total, desc="fuzz cases", unit="case", show=show)
        self.lines, self.total, self.t_last = show and self.bar.disable, total, time.monotonic()

    def advance(self, results: list[dict]) -> None:
        def bad() -> int:
            return sum(r["cls"] in FAILURE_CLASSES for r in results)
        if len(results) > self.bar.n:
            self.bar.set_postfix_str(f"{bad()} failures", refresh=False)
            self.bar.update(len(results) - self.bar.n)
        if self.lines and time.monotonic() - self.t_last > 30:
            self.t_last = time.monotonic()
            print(f"  ... {len(results)}/{self.total} cases, {bad()} failures", flush=True)

    def close(self) -> None:
        self.bar.close()


def case_timeout(seed: int, index: int, target: str, timeout: float) -> float:
    """CPU seconds case `index` may take: its target's share of `timeout` (and more for a
    check case that models its steps)."""
    name = target_of(seed, index, target)
    factor = PERF_TIMEOUT_FACTOR if name == "check" and models_steps(seed, index) else 1.0
    return timeout * TARGETS[name].timeout_factor * factor


def run_campaign(seed: int, indices: list, workers: int = 2, timeout: float = 10.0,
                 mem_gib: float = 4.0, compile_fraction: float = 0.2, kind: str | None = None,
                 progress: bool = False, target: str = "check") -> list[dict]:
    """Run cases on a pool of long-lived workers (at most `workers` processes at a time).

    indices: case numbers, or (number, kind) or (number, kind, target) tuples forcing a
    mutation kind (and a target) per case."""
    kinds = {i[0]: i[1] for i in indices if isinstance(i, tuple)}
    targets = {i[0]: i[2] for i in indices if isinstance(i, tuple) and len(i) > 2}
    indices = [i[0] if isinstance(i, tuple) else i for i in indices]
    mkc_dir = str(ROOT / "mkc") + os.sep           # the workers import mkc from ROOT
    todo = list(reversed(indices))
    total = len(todo)
    results: list[dict] = []
    root = Path(tempfile.mkdtemp(prefix="mkc_fuzz_"))
    args = [str(int(mem_gib * (1 << 30))), str(timeout), str(compile_fraction),
            "0"]        # "1": import jax at worker start; lazily is cheaper after a hang restart
    n_started = 0

    def start() -> Worker:
        nonlocal n_started
        n_started += 1
        w = root / f"w{n_started}"
        w.mkdir()
        return Worker(args, w, root / f"w{n_started}.log")

    shown = _Progress(total, progress)
    pool = [start() for _ in range(max(1, min(workers, total)))]
    sel = selectors.DefaultSelector()
    for w in pool:
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)

    def replace(w: Worker) -> None:
        sel.unregister(w.proc.stdout)
        w.stop()
        pool.remove(w)
        if todo or any(x.current is not None for x in pool):
            nw = start()
            pool.append(nw)
            sel.register(nw.proc.stdout, selectors.EVENT_READ, nw)

    def log_tail(w: Worker) -> str:
        try:
            return (w.work.parent / f"{w.work.name}.log").read_text(errors="replace")[-800:]
        except OSError:
            return ""

    try:
        while todo or any(w.current is not None for w in pool):
            for w in list(pool):
                if w.ready and w.current is None and todo:
                    idx = todo.pop()
                    tgt = targets.get(idx, target)
                    w.send(seed, idx, kinds.get(idx, kind), tgt, case_timeout(seed, idx, tgt, timeout))
            for key, _ in sel.select(timeout=0.25):
                w = key.data
                chunk = os.read(w.proc.stdout.fileno(), 1 << 16)
                if not chunk:                                     # the worker died
                    if w.current is not None:
                        idx = w.current
                        rc = w.proc.wait()
                        tail = log_tail(w)
                        cls = "memory" if "MemoryError" in tail or "std::bad_alloc" in tail else "crash"
                        results.append({"index": idx, "cls": cls, "sig": f"worker exit {rc}",
                                        "detail": tail[-400:], "seconds": None})
                    replace(w)
                    continue
                w.buf += chunk
                while b"\n" in w.buf:
                    line, w.buf = w.buf.split(b"\n", 1)
                    if line == b"READY":
                        w.ready = True
                        continue
                    res = json.loads(line)
                    results.append(res)
                    w.current = None
                    if res.get("restart"):
                        replace(w)
                        break
            for w in list(pool):
                if (w.current is not None or not w.ready) and w.overdue(timeout):
                    if not w.ready:
                        raise RuntimeError(f"fuzz worker did not start: {log_tail(w)}")
                    if not w.interrupted:        # first ask the case to stop where it is
                        w.interrupted = True
                        w.proc.send_signal(signal.SIGUSR2)
                        w.cpu0 += 2.0            # it has 2 more CPU seconds (or 30 s) to answer
                        w.deadline = time.monotonic() + 30
                        continue
                    idx = w.current
                    (w.work / "stack.txt").write_text("")
                    w.proc.send_signal(signal.SIGUSR1)
                    time.sleep(0.5)
                    sig, detail = _stack_signature(w.work / "stack.txt", mkc_dir)
                    case = make_case(seed, idx, compile_fraction, kinds.get(idx, kind),
                                     targets.get(idx, target))
                    prefix = "" if case.target == "check" else f"[{case.target}] "
                    results.append({"index": idx, "kind": case.kind, "base": case.base,
                                    "target": case.target, "cls": "hang",
                                    "sig": f"{prefix}hang @ {sig}", "detail": detail,
                                    "seconds": w.case_timeout})
                    w.current = None
                    replace(w)
            shown.advance(results)
    except KeyboardInterrupt:            # Ctrl-C (or kill -INT): report the cases done so far
        print(f"  interrupted after {len(results)} of {total} cases", flush=True)
    finally:
        shown.close()
        for w in pool:
            w.stop()
        shutil.rmtree(root, ignore_errors=True)
    for r in results:                    # crash records lack kind/base/target: fill them in
        if "kind" not in r:
            case = make_case(seed, r["index"], compile_fraction, kinds.get(r["index"], kind),
                             targets.get(r["index"], target))
            r["kind"], r["base"], r["target"] = case.kind, case.base, case.target
        if r["index"] in kinds:
            r["forced_kind"] = kinds[r["index"]]
        if r["index"] in targets:
            r["forced_target"] = targets[r["index"]]
    results.sort(key=lambda r: r["index"])
    return results


