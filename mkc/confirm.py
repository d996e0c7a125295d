"""Confirm mkc's VMEM verdict with the real compiler: libtpu, compile-only, no TPU needed.

API (what `mkc check --confirm` calls)::

    confirm_kernels(spec_path: str | os.PathLike, model: str | None = None,
                    timeout: float = 900.0, progress: bool = False) -> list[VmemConfirmation]
    confirm_vmem(spec_path: str | os.PathLike, model: str | None = None,
                 batch: int | None = None, timeout: float = 900.0,
                 progress: bool = False) -> VmemConfirmation

It checks the spec with mkc, renders its module even when mkc rejects it for VMEM, and compiles
kernels against the spec's compile-only topology (`jax.experimental.topologies`), each in a
subprocess with `timeout` seconds, so a libtpu crash or hang cannot take mkc down:
`confirm_kernels` every kernel mkc's VMEM verdict judges (`mkc.checks.capacity.kernels`: the
decode step at each bounding batch, each verify step), `confirm_vmem` one, the kernel of `batch`
rows (`capacity.as_kernel`; default the widest). `VmemConfirmation` (a frozen dataclass,
`.to_json()` gives a dict) carries both verdicts side by side:

- `kernel: str`, the kernel compiled ("decode step, batch 8", "verify step, 16 rows (2
  sequences of 8)"); `batch` its rows;
- `mkc_fits: bool`, `mkc_peak_bytes: int`, `mkc_budget_bytes: int` (the modelled peak and what
  the spec allows, the reserve taken off), `mkc_limit_bytes: int` (what the compiler allows:
  the budget with the reserve), `mkc_overhead_bytes: int` (the modelled compiler scratch
  inside the peak);
- `libtpu: str`, one of `"fits"`, `"out_of_vmem"`, `"error"` (another compile error, or the
  spec failing a check other than VMEM so there is nothing to compile), `"timeout"`;
- `used_bytes: int | None`: VMEM the compiled kernel allocates (exact when it fits, read from
  the compiler's buffer assignment; the rounded "Used X" figure when it does not);
- `limit_bytes: int | None`: what the compiler allowed (`min(vmem limit, usable VMEM)`);
- `message: str` (libtpu's error, first lines), `allocations: list[dict]` (on an overflow:
  libtpu's largest allocations, each `{"bytes", "shape", "tag"}`), `seconds: float`;
- `agree: bool`: libtpu's verdict is mkc's at the compiler's limit: mkc's peak within the
  limit and libtpu fits, or over it and libtpu runs out of VMEM (`out_of_vmem`). The reserve
  is the user's headroom on top of the model, not libtpu's: a kernel in it fits both.

`python -m mkc.confirm SPEC [--model M] [--batch B]` prints them (every judged kernel, or the
kernel of B rows) and exits 1 when any disagrees. The worker half
(`python -m mkc.confirm --worker MODULE.py B`) is what runs in the subprocess.
"""
from __future__ import annotations

import argparse
import dataclasses
import glob
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

_UNITS = {"B": 1, "K": 2**10, "M": 2**20, "G": 2**30}


@dataclass(frozen=True)
class VmemConfirmation:
    spec: str
    model: str
    batch: int                        # the kernel's rows
    topology: str
    mkc_fits: bool
    mkc_peak_bytes: int
    mkc_budget_bytes: int
    mkc_overhead_bytes: int
    libtpu: str                       # fits | out_of_vmem | error | timeout
    kernel: str = ""
    mkc_limit_bytes: int = 0          # the budget with the reserve: what libtpu is held to
    used_bytes: int | None = None
    limit_bytes: int | None = None
    message: str = ""
    allocations: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def mkc_fits_limit(self) -> bool:
        """mkc's verdict at the compiler's limit (the reserve left out)."""
        return self.mkc_peak_bytes <= (self.mkc_limit_bytes or self.mkc_budget_bytes)

    @property
    def agree(self) -> bool:
        return ((self.mkc_fits_limit and self.libtpu == "fits")
                or (not self.mkc_fits_limit and self.libtpu == "out_of_vmem"))

    def to_json(self) -> dict:
        return dataclasses.asdict(self) | {"agree": self.agree}


    def summary(self) -> str:
        mib = 2**20
        mkc = (f"mkc: {'fits' if self.mkc_fits else 'over'} ({self.mkc_peak_bytes / mib:.2f} "
               f"of {self.mkc_budget_bytes / mib:.2f} MiB)")
        if self.mkc_fits != self.mkc_fits_limit:
            mkc += (f", {'fits' if self.mkc_fits_limit else 'over'} the limit of "
                    f"{self.mkc_limit_bytes / mib:.2f} MiB")
        if self.libtpu == "fits":
            tpu = (f"libtpu: fits ({self.used_bytes / mib:.2f} of {self.limit_bytes / mib:.2f} "
                   "MiB)" if self.used_bytes is not None else "libtpu: fits")
        elif self.libtpu == "out_of_vmem":
            tpu = "libtpu: out of VMEM" + (
                f" (used {self.used_bytes / mib:.2f} of {self.limit_bytes / mib:.2f} MiB)"
                if self.used_bytes is not None and self.limit_bytes else "")
        else:
            tpu = f"libtpu: {self.libtpu}: {self.message.splitlines()[0] if self.message else ''}"
        return (f"{self.spec} ({self.model}), {self.kernel or f'batch {self.batch}'} on "
                f"{self.topology}: {mkc}; {tpu}; {'agree' if self.agree else 'DISAGREE'}")


def report(confirmations: list[VmemConfirmation]) -> dict:
    """`mkc check --confirm`'s JSON: each kernel's confirmation and whether all agree."""
    return {"agree": all(r.agree for r in confirmations),
            "kernels": [r.to_json() for r in confirmations]}


# ---- libtpu's verdict, from the compile's output -----------------------------------------
def _size(num: str, unit: str) -> int:
    return round(float(num) * _UNITS[unit])


def parse_compile_error(text: str) -> dict:
    """libtpu's error text -> {"libtpu", "used_bytes", "limit_bytes", "message", "allocations"}.

    Three VMEM failures exist: the program-level "Ran out of memory in memory space vmem. Used X
    of Y vmem" (the whole kernel, with a list of its largest allocations), and Mosaic's own
    "Allocation (size=N) would exceed memory (size=M)" for a single buffer, and the kernel over
    its own `vmem_limit_bytes`: "Scoped allocation with size X and limit Y exceeded"."""
    m = re.search(r"Ran out of memory in memory space vmem\. Used ([\d.]+)([KMGB]) of "
                  r"([\d.]+)([KMGB]) vmem", text)
    if m:
        allocs = []
        for block in re.split(r"\n\s*\d+\. Size: ", text)[1:]:
            size = re.match(r"([\d.]+)([KMGB])", block)
            shape = re.search(r"\n\s*Shape: (\S+)", block)
            tag = re.search(r"\n\s*(?:Tag|XLA label): ([^\n]+)", block)
            if size:
                allocs.append({"bytes": _size(*size.groups()),
                               "shape": shape.group(1) if shape else "",
                               "tag": tag.group(1)[:160] if tag else ""})
        return {"libtpu": "out_of_vmem", "used_bytes": _size(*m.groups()[:2]),
                "limit_bytes": _size(*m.groups()[2:]), "message": _first_lines(text, m.start()),
                "allocations": allocs}
    # Over the kernel's own limit (vmem_limit_bytes): Mosaic allocates scratch operands, then
    # scoped buffers, windows and spill slots, and stops at the first that does not fit, so
    # the size it reports is a lower bound of the kernel's need.
    m = re.search(r"Scoped allocation with size ([\d.]+)([KMGB]) and limit ([\d.]+)([KMGB]) "
                  r"exceeded scoped vmem limit", text)
    if m:
        return {"libtpu": "out_of_vmem", "used_bytes": _size(*m.groups()[:2]),
                "limit_bytes": _size(*m.groups()[2:]), "message": _first_lines(text, m.start()),
                "allocations": []}
    m = re.search(r"Allocation \(size=(\d+)\) would exceed memory \(size=(\d+)\)", text)
    if m:
        return {"libtpu": "out_of_vmem", "used_bytes": int(m.group(1)),
                "limit_bytes": int(m.group(2)), "message": _first_lines(text, m.start()),
                "allocations": []}
    return {"libtpu": "error", "used_bytes": None, "limit_bytes": None,
            "message": _first_lines(text, _error_start(text)), "allocations": []}


def _error_start(text: str) -> int:
    for key in ("RESOURCE_EXHAUSTED", "INTERNAL", "INVALID_ARGUMENT", "UNIMPLEMENTED",
                "Error", "error"):
        i = text.rfind(key)
        if i >= 0:
            return i
    return max(0, len(text) - 2000)


def _first_lines(text: str, start: int, n: int = 4) -> str:
    return "\n".join(text[start:].splitlines()[:n])[:1200]


def _used_from_dump(dump_dir: str) -> tuple[int | None, int | None]:
    """(VMEM the Pallas kernel allocates, the scoped VMEM it was given), exact, from XLA's
    after-codegen HLO: the tpu_custom_call's used and granted scoped memory in space 1 (VMEM)."""
    used = limit = None
    for path in glob.glob(os.path.join(dump_dir, "*after_codegen.txt")):
        with open(path) as f:
            text = f.read()
        # The custom call spans lines (its frontend attributes hold newlines): read from each
        # tpu_custom_call to the next instruction's start.
        for m in re.finditer(r'custom_call_target="tpu_custom_call"', text):
            end = text.find("\n  %", m.end())
            call = text[m.end():end if end > 0 else len(text)]
            u = re.search(r'"used_scoped_memory_configs":\[\{"memory_space":"1",'
                          r'"offset":"\d+","size":"(\d+)"', call)
            g = re.search(r'"scoped_memory_configs":\[\{"memory_space":"1",'
                          r'"offset":"\d+","size":"(\d+)"', call)
            if u:
                used = max(used or 0, int(u.group(1)))
            if g:
                limit = max(limit or 0, int(g.group(1)))
    return used, limit


# ---- the compile (worker side) ------------------------------------------------------------
class RankMismatch(ValueError):
    """A module whose rank count is not its topology's device count (it cannot be placed)."""


def compile_module(path: str, batch: int, verify_rows: int | None = None) -> dict:
    """Compile a generated module's kernel at `batch` for its TOPOLOGY with libtpu, from
    abstract inputs (with `verify_rows` R: its verify step of R rows for `batch` sequences).
    Returns {"topology", "devices", "lower_s", "compile_s"}; raises what the compiler raises.
    Needs JAX_PLATFORMS=cpu and ALLOW_MULTIPLE_LIBTPU_LOAD=1 set before jax is imported (the
    worker does that)."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from mkc import files
    from mkc.target import topology_devices

    gen = files.import_generated(path, name="generated_module")
    devices = topology_devices(gen.TOPOLOGY)
    if len(devices) != gen.RANKS:
        raise RankMismatch(f"{path}: the module runs on {gen.RANKS} ranks but topology "
                           f"{gen.TOPOLOGY} has {len(devices)} devices; recompile its "
                           f"spec with `mesh {gen.AXIS} = {len(devices)}` or a topology "
                           f"of {gen.RANKS} devices")
    mesh = Mesh(np.array(devices), (gen.AXIS,))
    ranked = NamedSharding(mesh, P(gen.AXIS))
    weights, state = gen.abstract_inputs(batch)
    place = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=ranked)  # noqa: E731
    weights = {k: place(v) for k, v in weights.items()}
    state = {k: place(v) for k, v in state.items()}
    replicated = NamedSharding(mesh, P())
    rows = jax.ShapeDtypeStruct((batch,), np.int32, sharding=replicated)
    t0 = time.perf_counter()
    if verify_rows is None:
        lowered = gen.make_decode_step(mesh, batch).lower(weights, state, rows, rows)
    else:
        tokens = jax.ShapeDtypeStruct((batch, verify_rows), np.int32, sharding=replicated)
        caches = {k: v for k, v in state.items() if k not in gen.ROW_STATES}
        states = {k: v for k, v in state.items() if k in gen.ROW_STATES}
        lowered = gen.make_verify_step(mesh, batch, verify_rows).lower(weights, caches, states,
                                                                       tokens, rows)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"topology": gen.TOPOLOGY, "devices": len(devices), "lower_s": t1 - t0,
            "compile_s": t2 - t1}


# Set in a worker's environment: locate the kernel's instructions in the generated module.
LOCATE_IN_MODULE = "MKC_LOCATE_IN_MODULE"


def _worker(path: str, batch: int, verify_rows: int | None = None) -> int:
    """Compile in this process and print one JSON line: the verdict."""
    dump = tempfile.mkdtemp(prefix="mkc_confirm_dump_")
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + f" --xla_dump_to={dump}").strip()
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["ALLOW_MULTIPLE_LIBTPU_LOAD"] = "1"
    if os.environ.get(LOCATE_IN_MODULE):
        # Every instruction located at the generated module's line that called into mkc (an
        # op's call, a collective, a copy), not at the mkc line that emitted it.
        from jax._src import source_info_util
        source_info_util.register_exclusion(str(Path(__file__).resolve().parent) + os.sep)
    try:
        try:
            info = compile_module(path, batch, verify_rows)
        except Exception as e:  # noqa: BLE001 - the verdict is the point
            out = parse_compile_error(f"{type(e).__name__}: {e}")
        else:
            used, limit = _used_from_dump(dump)
            out = {"libtpu": "fits", "used_bytes": used, "limit_bytes": limit, "message": "",
                   "allocations": []} | info
    finally:
        if not os.environ.get("MKC_KEEP_DUMP"):
            shutil.rmtree(dump, ignore_errors=True)
    print("MKC_CONFIRM " + json.dumps(out), flush=True)
    return 0


def run_compile(module_path: str | os.PathLike, batch: int, timeout: float = 900.0,
                tick=None, verify_rows: int | None = None, env: dict | None = None) -> dict:
    """Compile a generated module at `batch` in a fresh subprocess (with `verify_rows` R: its
    verify step of R rows for `batch` sequences); libtpu's verdict as a dict (see
    `parse_compile_error`, plus "seconds"). `tick()`, if given, is called about once a second
    while the compile runs (a progress bar's refresh). `env` adds to the worker's environment
    (libtpu's flags, `LOCATE_IN_MODULE`)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
               TF_CPP_MIN_LOG_LEVEL=os.environ.get("TF_CPP_MIN_LOG_LEVEL", "3")) | (env or {})
    root = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    argv = [sys.executable, "-m", "mkc.confirm", "--worker", str(module_path), str(batch)]
    argv += [str(verify_rows)] if verify_rows else []
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                          cwd=root) as p:
        while True:
            left = t0 + timeout - time.perf_counter()
            try:
                stdout, stderr = p.communicate(timeout=max(0.0, min(1.0, left)))
                break
            except subprocess.TimeoutExpired:
                if left <= 1.0:
                    p.kill()
                    p.communicate()
                    return {"libtpu": "timeout", "used_bytes": None, "limit_bytes": None,
                            "message": f"no verdict within {timeout:.0f} s", "allocations": [],
                            "seconds": time.perf_counter() - t0}
                if tick:
                    tick()
    seconds = time.perf_counter() - t0
    for line in reversed(stdout.splitlines()):
        if line.startswith("MKC_CONFIRM "):
            return json.loads(line[len("MKC_CONFIRM "):]) | {"seconds": seconds}
    return {"libtpu": "error", "used_bytes": None, "limit_bytes": None,
            "message": f"compile process exited with {p.returncode}: "
                       + _first_lines(stderr, _error_start(stderr)),
            "allocations": [], "seconds": seconds}


# ---- the API -----------------------------------------------------------------------------
def confirm_kernels(spec_path: str | os.PathLike, model: str | None = None,
                    timeout: float = 900.0, progress: bool = False) -> list[VmemConfirmation]:
    """mkc's VMEM verdict and libtpu's for every kernel the verdict judges
    (`capacity.kernels`), one compile each. Raises MkcError only when the spec cannot be
    parsed or resolved. With `progress`, the stage and the time taken show on stderr when it
    is a terminal (a compile takes minutes)."""
    from mkc.progress import bar
    with bar(desc="confirm: checking the spec", show=progress,
             bar_format="{desc} [{elapsed}]") as shown:
        return _confirm(spec_path, model, None, timeout, shown)


def confirm_vmem(spec_path: str | os.PathLike, model: str | None = None,
                 batch: int | None = None, timeout: float = 900.0,
                 progress: bool = False) -> VmemConfirmation:
    """mkc's VMEM verdict and libtpu's for the kernel of `batch` rows (`capacity.as_kernel`;
    default: the widest). See `confirm_kernels`."""
    from mkc.progress import bar
    with bar(desc="confirm: checking the spec", show=progress,
             bar_format="{desc} [{elapsed}]") as shown:
        return _confirm(spec_path, model, batch, timeout, shown)[0]


def _confirm(spec_path, model, batch, timeout, shown) -> list[VmemConfirmation]:
    from mkc.checks import capacity, run_checks
    from mkc.codegen.emit import render
    from mkc.diagnostics import MkcError
    from mkc.lang.parser import parse_file
    from mkc.resolve import resolve
    from mkc.trace import build_trace

    sched, text = parse_file(spec_path)
    s = resolve(sched, model)
    todo = capacity.kernels(s) if batch is None else [capacity.as_kernel(s, batch)]
    budget = capacity.vmem_budget_bytes(s)
    base = dict(spec=str(spec_path), model=s.model, topology=s.topology, mkc_budget_bytes=budget,
                mkc_limit_bytes=budget + s.vmem_reserve)
    try:
        events = run_checks(s)
    except MkcError as e:
        # a headroom expectation short is mkc's VMEM verdict too: the kernels still compile
        other = [d for d in e.diagnostics if d.code not in ("E-VMEM-CAPACITY", "E-EXPECT")]
        if other:
            why = "mkc rejects the spec for other reasons: " + "; ".join(
                f"{d.code}: {d.message}" for d in other)
            return [VmemConfirmation(**base, batch=k.rows, kernel=str(k), mkc_fits=False,
                                     mkc_peak_bytes=0, libtpu="error", message=why,
                                     mkc_overhead_bytes=capacity.compiler_overhead_bytes(s, k))
                    for k in todo]
        # A buffer over the budget on its own stops the checks before the trace (whose size is
        # bounded only when every buffer fits): count resident buffers and the largest scoped.
        alone = any("alone needs" in d.message for d in e.diagnostics)
        events = [] if alone else build_trace(s)
    out = []
    with tempfile.TemporaryDirectory(prefix="mkc_confirm_") as tmp:
        path = Path(tmp) / f"{s.name}.py"
        shown.set_description_str("confirm: rendering the module")
        try:
            path.write_text(render(s, text))
            rendered = {}
        except Exception as e:  # noqa: BLE001 - report, never crash the CLI
            rendered = {"libtpu": "error", "message": f"codegen failed: {type(e).__name__}: {e}"}
        for i, k in enumerate(todo):
            peak, _, _ = capacity.vmem_budget(s, events, k)
            if not events:
                peak += max((x.vmem_bytes for x in capacity.kernel_buffers(s, k) if x.scope),
                            default=0)
            r = rendered
            if not r:
                shown.set_description_str(
                    f"confirm: compiling the {k} with libtpu ({i + 1} of {len(todo)}; gives up "
                    f"after {timeout:.0f} s)")
                r = run_compile(path, k.sequences if k.verify else k.rows, timeout,
                                tick=shown.refresh,
                                verify_rows=k.rows // k.sequences if k.verify else None)
            out.append(VmemConfirmation(
                **base, batch=k.rows, kernel=str(k), mkc_fits=peak <= budget, mkc_peak_bytes=peak,
                mkc_overhead_bytes=capacity.compiler_overhead_bytes(s, k), libtpu=r["libtpu"],
                used_bytes=r.get("used_bytes"), limit_bytes=r.get("limit_bytes"),
                message=r.get("message", ""), allocations=r.get("allocations", []),
                seconds=round(r.get("seconds", 0.0), 2)))
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return _worker(argv[1], int(argv[2]), int(argv[3]) if len(argv) > 3 else None)
    from mkc.arguments import float_at_least, int_at_least
    ap = argparse.ArgumentParser(prog="python -m mkc.confirm", description=__doc__.splitlines()[0])
    ap.add_argument("spec")
    ap.add_argument("--model")
    ap.add_argument("--batch", type=int_at_least(1))
    ap.add_argument("--timeout", type=float_at_least(1), default=900.0, metavar="SECONDS")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rs = ([confirm_vmem(a.spec, a.model, a.batch, a.timeout, progress=True)] if a.batch else
          confirm_kernels(a.spec, a.model, a.timeout, progress=True))
    print(json.dumps([r.to_json() for r in rs], indent=1) if a.json
          else "\n".join(r.summary() for r in rs))
    return 0 if all(r.agree for r in rs) else 1


if __name__ == "__main__":
    sys.exit(main())
