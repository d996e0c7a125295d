"""Compiled prices per op body: what libtpu schedules for one op, kept under what sets its cycles.

A whole-kernel measure (`mkc.perf.bundles`) prices one exact module: change the ring's depth,
a tile, the batch or a collective and it no longer applies. An op's cycles depend only on its
own body: the equations the kernel traces under its name scope (`mkc.runtime.scopes`), with
their shapes and dtypes (so its formats, rows, weight tiles and KV tile), the generation and
libtpu. `OpKey` holds exactly that: the sliced body's digest (`op_bodies`), the body function it
comes from, rows, the shapes it is handed, the chip and libtpu's version. Constants the body is
traced with but which set no cycles (the ring slot a tile lands in is an index modulo the ring's
depth, a layer's tile offset) are digested as "a literal", not by value.

Where an op measure comes from:

- **derived** from a whole-kernel measure whose key matches the module it was compiled from
  (`derive`): each op row of the kernel under its op's key. The shipped ones are in
  `mkc/perf/data/ops/<chip>.json` (`benchmarks/op_prices.py --ship` writes them).
- **compiled alone** (`compile_ops`): the op's sliced body in a kernel of its own, every value it
  is handed an input and every value it hands on an output, every ref it touches an input or
  scratch of the same memory space, compiled compile-only for one core of the spec's topology;
  its bundles all charged to it (`mkc.perf.bundles.rows`). One worker process compiles every
  missing op of a kernel, seconds each. Kept in the user's cache.

`assemble` gives `mkc.perf.sim.Model` a measure of a kernel from its ops': every op row by key,
and the collectives' and kernel statements' rows from a whole-kernel measure of the same spec
and kernel at the same rows when one's labels match (else they are counted). An op whose body
cannot compile alone (no libtpu, a compile error) is counted and named.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from mkc import ir

DATA = Path(__file__).parent / "data" / "ops"
SCHEMA = 1                # what an op measure holds: raise it when a row's reading changes
ROW_FIELDS = ("bundles", "cycles", "per_iteration", "read_cycles", "reads", "bound", "busiest",
              "run_time_loops", "slots")


@dataclass(frozen=True)
class OpKey:
    """What sets an op's compiled cycles."""

    chip: str
    libtpu: str
    body: str            # the function the op runs (module.qualname), or the tail's source
    kind: str            # layer kind, or "tail"
    op: str
    rows: int            # rows the kernel runs (a verify kernel's sequences x rows each)
    shapes: str          # what the body is handed: value and ref types, in order
    digest: str          # the sliced body: equations, shapes, dtypes, parameters

    @property
    def id(self) -> str:
        h = hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode())
        return h.hexdigest()[:24]


@dataclass
class OpBody:
    """One op's equations sliced out of the traced kernel: `free` the variables it reads that it
    does not define (values and refs), `outs` the values it defines that the kernel reads after."""

    kind: str
    op: str
    eqns: list
    free: list
    outs: list
    key: OpKey | None


# ---- slicing the traced kernel --------------------------------------------------------------
def _own_stack(e) -> tuple[str, ...]:
    return tuple(n for n in str(e.source_info.name_stack).split("/") if n)


def _locate(jaxpr, stack: tuple[str, ...], found: dict) -> None:
    """(jaxpr, [equation indices]) of each op scope, at the level the op's equations live."""
    from mkc.perf.work import subjaxprs
    from mkc.runtime import scopes
    for i, e in enumerate(jaxpr.eqns):
        here = stack + _own_stack(e)
        name = next((n for n in here if n.startswith(scopes.OP + ":")), None)
        if name is not None:
            kind, _, op = name[len(scopes.OP) + 1:].partition(".")
            where = found.setdefault((kind, op), (jaxpr, []))
            if where[0] is jaxpr:
                where[1].append(i)
            continue
        for sub in subjaxprs(e.params):
            _locate(sub, here, found)


def _jaxpr(free: list, outs: list, eqns: list, effects=frozenset()):
    """A jaxpr of the sliced equations (JAX warns that it has no debug info: none is needed)."""
    import warnings

    import jax.extend.core as jcore
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return jcore.Jaxpr([], free, outs, eqns, effects)


def _digest(eqns: list, free: list, outs: list) -> str:
    """The body's equations as JAX prints them (no locations, no scopes), `_mask_numbers`ed:
    two bodies with equal digests run the same instructions on the same value shapes."""
    jaxpr = _jaxpr(free, outs, eqns)
    text = jaxpr.pretty_print(source_info=False, name_stack=False)
    text = _mask_numbers(text)
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()[:24]


_LITERAL_NUM = re.compile(r"(?<![\w.])-?[\d.]+(?:e[+-]?\d+)?(?=:\w+\[\])")
_REF_LEAD = re.compile(r"(Ref<\w+>\{\w+\[)\d+")


def _mask_numbers(text: str) -> str:
    """Literal values and a ref's leading dimension out (the ring's or a pool's slot count, a
    semaphore array's size: they index, they set no cycles); value shapes and parameters (a
    loop's length, slice sizes) stay."""
    return _REF_LEAD.sub(r"\1#", _LITERAL_NUM.sub("#", text))


def _aval_text(v) -> str:
    a = v.aval
    space = getattr(a, "memory_space", None)
    inner = getattr(a, "inner_aval", a)
    return (_REF_LEAD.sub(r"\1#", f"Ref<{space}>{{{inner.str_short()}}}")
            if hasattr(a, "inner_aval") else a.str_short())


def _slice(jaxpr, idx: list[int]) -> tuple[list, list, list]:
    import jax.extend.core as jcore
    eqns, defined, free = [], set(), []
    for i in idx:
        e = jaxpr.eqns[i]
        for v in e.invars:
            if isinstance(v, jcore.Var) and v not in defined and v not in free:
                free.append(v)
        defined.update(v for v in e.outvars if isinstance(v, jcore.Var))
        eqns.append(e)
    mine = set(idx)
    used_after = set()
    for n, e in enumerate(jaxpr.eqns):
        if n not in mine:
            used_after.update(v for v in e.invars if isinstance(v, jcore.Var))
    used_after.update(v for v in jaxpr.outvars if isinstance(v, jcore.Var))
    outs = [v for e in eqns for v in e.outvars
            if isinstance(v, jcore.Var) and not isinstance(v, jcore.DropVar) and v in used_after]
    return eqns, free, outs


def op_bodies(s: ir.ScheduleIR, batch: int, verify_rows: int | None = None,
              source: str | None = None) -> dict[tuple[str, str], OpBody]:
    """Every op of the kernel mkc emits for `s` at `batch` rows (a verify kernel of
    `verify_rows` rows a sequence: `batch` is then its rows), sliced, with its key."""
    from mkc.codegen.emit import render
    from mkc.perf import work
    from mkc.perf.bundles import libtpu_version
    source = source if source is not None else render(s, "")
    kernel = work.kernel_jaxpr(work.trace_source(source, batch, verify_rows).jaxpr)
    found: dict = {}
    _locate(kernel, (), found)
    kw = work.kernel_work(s, batch, verify_rows)
    lib = libtpu_version()
    out = {}
    for (kind, op), (jaxpr, idx) in found.items():
        eqns, free, outs = _slice(jaxpr, idx)
        key = OpKey(s.chip, lib, kw.source_of(kind, op), kind, op, batch,
                    ", ".join(_aval_text(v) for v in free), _digest(eqns, free, outs))
        out[kind, op] = OpBody(kind, op, eqns, free, outs, key)
    return out


# ---- the store ------------------------------------------------------------------------------
def user_cache() -> Path:
    """Where op measures compiled here are kept (MKC_OP_CACHE overrides)."""
    if own := os.environ.get("MKC_OP_CACHE"):
        return Path(own)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "mkc" / "ops"


_READ: dict[Path, tuple[float, dict[str, dict]]] = {}


def _read(path: Path) -> dict[str, dict]:
    """A store file's measures by id (read again only when the file changed: a tuner prices
    hundreds of candidates)."""
    try:
        stamp = path.stat().st_mtime_ns
        if path in _READ and _READ[path][0] == stamp:
            return dict(_READ[path][1])
        entries = json.loads(path.read_text())["ops"]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    got = {e["id"]: e for e in entries if isinstance(e, dict) and e.get("schema") == SCHEMA}
    _READ[path] = (stamp, got)
    return dict(got)


def load(chip: str, places: tuple[Path, ...] | None = None) -> dict[str, dict]:
    """Every op measure of `chip`, by key id (the shipped first, the user's over them)."""
    got: dict[str, dict] = {}
    for place in places or (DATA, user_cache()):
        got.update(_read(place / f"{chip}.json"))
    return got


def save(entries: list[dict], chip: str, directory: Path | None = None) -> Path:
    """Add op measures to `directory`'s file of `chip` (one per key), atomically."""
    from mkc.files import write_atomically
    path = (directory or user_cache()) / f"{chip}.json"
    kept = _read(path)
    kept.update({e["id"]: e for e in entries})
    ordered = sorted(kept.values(), key=lambda e: (e["key"]["body"], e["key"]["rows"], e["id"]))
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, json.dumps({"ops": ordered}, indent=1, sort_keys=True) + "\n")
    return path


def entry(key: OpKey, row: dict, origin: str) -> dict:
    return {"schema": SCHEMA, "id": key.id, "key": asdict(key), "origin": origin,
            "row": {k: row[k] for k in ROW_FIELDS if k in row}}


def derive(s: ir.ScheduleIR, measure: dict, source: str | None = None) -> list[dict]:
    """Op measures from a whole-kernel measure of `s`'s module (`mkc.perf.bundles`), if its key
    matches that module (else none): each op row under its op's key."""
    from mkc.codegen.emit import render
    from mkc.perf import bundles
    source = source if source is not None else render(s, "")
    verify = measure["kernel"] == "verify"
    vr = s.verify_rows if verify else None
    if measure["key"] != bundles.cache_key(source, measure["kernel"], measure["batch"],
                                           measure["libtpu"], vr):
        return []
    rows = vr * measure["batch"] if vr else measure["batch"]
    bodies = op_bodies(s, rows, vr, source)
    origin = (f"derived: {measure['spec']} {measure['kernel']} kernel at {measure['batch']} "
              f"{'sequences' if verify else 'rows'} (mkc/perf/data/bundles)")
    out = []
    for r in measure["rows"]:
        b = bodies.get((r["kind"], r["name"])) if r["group"] == "op" else None
        if b is not None and b.key.libtpu == measure["libtpu"]:
            out.append(entry(b.key, r, origin))
    return out


# ---- compiling an op alone ------------------------------------------------------------------
_DUMP = ("--xla_jf_dump_to={0} --xla_jf_dump_llo_text=true "
         "--xla_mosaic_enable_llo_source_annotations=true")


def _standalone(body: OpBody, vmem_limit: int):
    """A pallas_call running `body` once: (the call, its abstract inputs). The loads of its
    input values and the stores of its outputs (a few bundles) are charged to the op too."""
    import jax
    import jax.numpy as jnp
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    inputs, in_specs, scratch, plan = [], [], [], []
    for v in body.free:
        a = v.aval
        if hasattr(a, "inner_aval"):
            inner, space = a.inner_aval, str(a.memory_space)
            if "semaphore" in space:
                sem = (pltpu.SemaphoreType.DMA if "dma" in str(inner.dtype)
                       else pltpu.SemaphoreType.REGULAR)
                scratch.append(sem(inner.shape))
                plan.append(("scratch", None))
            elif space == "vmem":
                scratch.append(pltpu.VMEM(inner.shape, inner.dtype))
                plan.append(("scratch", None))
            elif space == "smem":
                scratch.append(pltpu.SMEM(inner.shape, inner.dtype))
                plan.append(("scratch", None))
            else:
                inputs.append(jax.ShapeDtypeStruct(inner.shape, inner.dtype))
                in_specs.append(pl.BlockSpec(memory_space=pltpu.HBM))
                plan.append(("ref", None))
        else:
            dtype = jnp.int32 if a.dtype == jnp.bool_ else a.dtype
            shape = a.shape or (1,)
            inputs.append(jax.ShapeDtypeStruct(shape, dtype))
            in_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM if not a.shape else pltpu.VMEM))
            plan.append(("value", a))
    # a first output of its own: a body that only stores to refs still returns something, so
    # the call is not dropped as dead
    out_shapes = [jax.ShapeDtypeStruct((1,), jnp.int32)]
    out_specs = [pl.BlockSpec(memory_space=pltpu.SMEM)]
    for v in body.outs:
        a = v.aval
        dtype = jnp.int32 if a.dtype == jnp.bool_ else a.dtype
        out_shapes.append(jax.ShapeDtypeStruct(a.shape or (1,), dtype))
        out_specs.append(pl.BlockSpec(memory_space=pltpu.SMEM if not a.shape else pltpu.VMEM))
    from jax._src import core as jax_core
    effects = jax_core.join_effects(*(e.effects for e in body.eqns)) if body.eqns else set()
    jaxpr = _jaxpr(body.free, body.outs, body.eqns, effects)
    n_in, n_out = len(inputs), len(out_shapes)

    def kernel(*refs):
        ins, outs, scr = refs[:n_in], refs[n_in:n_in + n_out], iter(refs[n_in + n_out:])
        it = iter(ins)
        args = []
        for how, a in plan:
            if how == "scratch":
                args.append(next(scr))
            elif how == "ref":
                args.append(next(it))
            else:
                ref = next(it)
                x = ref[0] if not a.shape else ref[...]
                args.append(x != 0 if a.dtype == jnp.bool_ else x)
        got = jax_core.eval_jaxpr(jaxpr, [], *args)
        outs[0][0] = jnp.int32(0)
        for ref, x in zip(outs[1:], got):
            x = x.astype(jnp.int32) if x.dtype == jnp.bool_ else x
            if ref.shape != x.shape:
                ref[0] = x
            else:
                ref[...] = x

    call = pl.pallas_call(
        kernel, out_shape=tuple(out_shapes), in_specs=in_specs, out_specs=tuple(out_specs),
        scratch_shapes=scratch, name=_kernel_name(body),
        compiler_params=pltpu.CompilerParams(vmem_limit_bytes=vmem_limit, has_side_effects=True))
    return call, inputs


def _kernel_name(body: OpBody) -> str:
    return f"mkc_op_{body.kind}_{body.op}"


def _compile_worker(spec_json: str) -> int:
    """In a worker process (libtpu's dump flags set): compile each op asked alone, read its
    bundles, print one JSON line of rows (or of why not)."""
    import jax

    from mkc.perf import bundles, llo, work
    from mkc.target import topology_devices
    job = json.loads(Path(spec_json).read_text())
    source, batch, vr = job["source"], job["batch"], job["verify_rows"]
    module = work.import_source(source)
    kernel = work.kernel_jaxpr(work.trace_module(module, batch, vr).jaxpr)
    found: dict = {}
    _locate(kernel, (), found)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    devices = topology_devices(module.TOPOLOGY)
    dev = devices[0]
    # The kernel's mesh, each rank running the body: the target's generation for Pallas'
    # queries while tracing (no TPU here), and the ranks a body's copies to other cores name.
    mesh = Mesh(np.array(devices), (module.AXIS,))
    whole = NamedSharding(mesh, PartitionSpec())
    dump = Path(job["dump"])
    results = {}
    for kind, op in job["ops"]:
        jaxpr, idx = found[kind, op]
        body = OpBody(kind, op, *_slice(jaxpr, idx), None)
        before = set(dump.rglob("*final_bundles.txt"))
        try:
            call, inputs = _standalone(body, module.VMEM_LIMIT_BYTES)
            sharded = [jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=whole) for x in inputs]
            mapped = jax.shard_map(call, mesh=mesh, in_specs=tuple(PartitionSpec() for _ in inputs),
                                   out_specs=PartitionSpec(), check_vma=False)
            with jax.set_mesh(mesh), jax.default_device(dev):
                jax.jit(mapped).lower(*sharded).compile()
        except Exception as e:  # noqa: BLE001 - the reason is the result
            results[f"{kind}.{op}"] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
            continue
        files = [f for f in set(dump.rglob("*final_bundles.txt")) - before
                 if "schedule-analysis" not in f.name]
        files = [f for f in files if _kernel_name(body) in f.name]
        if not files:
            results[f"{kind}.{op}"] = {"error": "libtpu wrote no LLO"}
            continue
        parsed = llo.parse(max(files, key=lambda f: f.stat().st_size).read_text(errors="replace"))
        run_time = {f"{kind}.{op}"} if any(lp.trips is None for lp in llo.loops(parsed)) else set()
        label = bundles.Label("op", kind, op)
        found_rows = bundles.rows(parsed, {}, 0, None, run_time)
        results[f"{kind}.{op}"] = _merge(found_rows, label)
    print("MKC_OPS " + json.dumps(results), flush=True)
    return 0


def _merge(found: list, label) -> dict:
    """The standalone kernel's rows (all one op's: they carry no location) as that op's row."""
    from mkc.perf.bundles import Row
    r = Row(label.key, label.group, label.kind, label.name)
    for x in found:
        r.bundles += x.bundles
        r.cycles += x.cycles
        r.per_iteration += x.per_iteration
        r.read_cycles += x.read_cycles
        r.reads += x.reads
        r.run_time_loops += x.run_time_loops
        for k, v in x.slots.items():
            r.slots[k] = r.slots.get(k, 0.0) + v
    if found:
        top = max(found, key=lambda x: x.cycles + x.per_iteration)
        r.bound, r.busiest = top.bound, top.busiest
    return r.to_json()


def compile_ops(s: ir.ScheduleIR, batch: int, verify_rows: int | None,
                bodies: dict[tuple[str, str], OpBody], want: list[tuple[str, str]],
                source: str | None = None, timeout: float = 900.0,
                directory: Path | None = None) -> tuple[list[dict], dict]:
    """Compile each op of `want` alone (one worker process for all), keep them (in the user's
    cache, or `directory`) and return their measures; and {op key: why not} for those that
    did not compile. MKC_OP_KEEP_DUMP=DIR keeps libtpu's dumps there (to read an op's LLO)."""
    from mkc.codegen.emit import render
    source = source if source is not None else render(s, "")
    todo, failed = list(want), {}
    if not todo:
        return [], failed
    keep = os.environ.get("MKC_OP_KEEP_DUMP")
    with tempfile.TemporaryDirectory(prefix="mkc-ops-") as tmp:
        tmp = keep or tmp
        job = Path(tmp) / "job.json"
        job.write_text(json.dumps({"source": source, "batch": batch, "verify_rows": verify_rows,
                                   "ops": todo, "dump": str(Path(tmp) / "jf")}))
        root = str(Path(__file__).resolve().parent.parent.parent)
        env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1",
                   TF_CPP_MIN_LOG_LEVEL="3", LIBTPU_INIT_ARGS=_DUMP.format(Path(tmp) / "jf"))
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
        try:
            p = subprocess.run([sys.executable, "-m", "mkc.perf.op_measures", "--worker",
                                str(job)], capture_output=True, text=True, env=env,
                               timeout=timeout, cwd=root)
        except subprocess.TimeoutExpired:
            return [], failed | {f"{k}.{o}": f"no compile within {timeout:.0f} s"
                                 for k, o in todo}
    line = next((ln for ln in reversed(p.stdout.splitlines()) if ln.startswith("MKC_OPS ")), None)
    if line is None:
        why = (p.stderr.strip().splitlines() or [f"exit {p.returncode}"])[-1][:300]
        return [], failed | {f"{k}.{o}": why for k, o in todo}
    got = json.loads(line[len("MKC_OPS "):])
    entries = []
    for k, o in todo:
        r = got.get(f"{k}.{o}", {"error": "not reported"})
        if "error" in r:
            failed[f"{k}.{o}"] = r["error"]
        else:
            entries.append(entry(bodies[k, o].key, r, "compiled alone"))
    if entries:
        save(entries, s.chip, directory)
    return entries, failed


# ---- a kernel's measure from its ops' -------------------------------------------------------
def _collectives(labels) -> dict[tuple[str, str, int], int]:
    """(kind, collective, n-th of that kind and collective) -> its spec line, in line order."""
    seen: dict[tuple[str, str], int] = {}
    out = {}
    for kind, name, line in sorted(labels, key=lambda x: (x[0], x[2], x[1])):
        n = seen[kind, name] = seen.get((kind, name), -1) + 1
        out[kind, name, n] = line
    return out


def _near(ours: float | None, theirs: float) -> bool:
    """An op's cycles as another kernel scheduled the same body, or one a few rows or a tile
    away: within 15 % (and 50 cycles); another model's shapes are far outside."""
    return ours is not None and abs(ours - theirs) <= 0.15 * max(ours, theirs) + 50


def family_measure(s: ir.ScheduleIR, kernel: str, batch: int, source: str,
                   ops: dict[str, float] | None = None) -> dict | None:
    """The statement rows (collectives, copies, kernel statements) of a whole-kernel measure of
    the same spec name, kernel and batch (any module) whose collectives are the module's, each
    kind's in the same order (their spec lines moved to the module's), as {"spec", "batch",
    "rows"}; None without one. It must be of the same layers (another model under the spec's
    name is not) with at least half its op rows' cycles near those of `ops` ({"kind.op":
    cycles}; `_near`): a variant of the spec (formats, geometry), the nearest if several."""
    from mkc.perf import bundles
    mine = _collectives({(lab.kind, lab.name, lab.spec_line)
                         for lab in bundles.line_labels(source).values()
                         if lab.group == "collective"})
    found: list[tuple[int, dict]] = []
    calls = bundles.layer_calls(s)
    for place in (bundles.DATA, bundles.user_cache()):
        try:
            entries = json.loads((place / f"{s.name}.json").read_text())["measures"]
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for e in entries:
            if not (isinstance(e, dict) and e.get("schema") == bundles.SCHEMA
                    and e.get("kernel") == kernel and e.get("batch") == batch
                    and e.get("calls") == calls and e.get("topology") == s.topology):
                continue
            theirs = _collectives({(r["kind"], r["name"], r["spec_line"]) for r in e["rows"]
                                   if r["group"] == "collective"})
            if set(theirs) != set(mine):
                continue
            moved = {(k, line): mine[k, name, n] for (k, name, n), line in theirs.items()}
            rows = [r | {"spec_line": moved[r["kind"], r["spec_line"]]}
                    if r["group"] == "collective" else r for r in e["rows"] if r["group"] != "op"]
            theirs_ops = [r for r in e["rows"] if r["group"] == "op"]
            agree = sum(1 for r in theirs_ops if _near((ops or {}).get(r["key"]), r["cycles"]))
            if 2 * agree >= len(theirs_ops):
                found.append((agree, {"spec": e["spec"], "batch": e["batch"], "rows": rows}))
    return max(found, key=lambda x: x[0])[1] if found else None


def compiling() -> bool:
    """Whether a missing op is compiled alone (MKC_OP_COMPILE=0 turns it off: then it is
    counted)."""
    return os.environ.get("MKC_OP_COMPILE", "1") != "0"


def assemble(s: ir.ScheduleIR, batch: int, sequences: int | None = None,
             compile_missing: bool | None = None, source: str | None = None) -> dict:
    """A measure of the kernel at `batch` rows (a verify kernel for `sequences`) from op
    measures: every op by its key, compiled alone when missing (with `compile_missing`), and
    the collectives' and kernel statements' rows from `family_measure` if there is one (else
    counted). Its "op_level" says where each part came from."""
    from mkc.codegen.emit import render
    from mkc.perf import bundles
    t0 = time.perf_counter()
    source = source if source is not None else render(s, "")
    verify_rows = batch // sequences if sequences else None
    kernel = "verify" if sequences else "decode"
    bodies = op_bodies(s, batch, verify_rows, source)
    store = load(s.chip)
    rows, origin = [], {}
    missing = [k for k, b in bodies.items() if b.key.id not in store]
    compile_missing = compiling() if compile_missing is None else compile_missing
    failed: dict = {}
    compiled: list[dict] = []
    if missing and compile_missing:
        compiled, failed = compile_ops(s, batch, verify_rows, bodies, missing, source)
        store.update({e["id"]: e for e in compiled})
    for (kind, op), b in bodies.items():
        e = store.get(b.key.id)
        if e is None:
            failed.setdefault(f"{kind}.{op}", "not measured")
            continue
        rows.append({"key": f"{kind}.{op}", "group": "op", "kind": kind, "name": op,
                     "spec_line": 0, "hottest": {}} | e["row"])
        origin[f"{kind}.{op}"] = e["origin"]
    fam = family_measure(s, kernel, sequences or batch, source,
                         {r["key"]: r["cycles"] for r in rows})
    if fam is not None:
        rows += [r for r in fam["rows"] if r["group"] != "op"]
    derived = sum(1 for o in origin.values() if o.startswith("derived"))
    alone = len(origin) - derived
    # without a whole-kernel measure the collectives are priced by their counted sums: named
    collectives = [] if fam else sorted({lab.key for lab in bundles.line_labels(source).values()
                                         if lab.group == "collective"})
    return {"schema": bundles.SCHEMA, "key": "", "spec": s.name, "chip": s.chip,
            "topology": s.topology, "kernel": kernel, "batch": sequences or batch,
            "verify_rows": verify_rows, "libtpu": bundles.libtpu_version(),
            "calls": bundles.layer_calls(s), "rows": rows,
            "op_level": {"ops_derived": derived, "ops_compiled_alone": alone,
                         "ops_compiled_now": len(compiled),
                         "ops_counted": failed, "collectives_counted": collectives,
                         "origin": origin,
                         "statements_from": (f"{fam['spec']}'s whole-kernel measure at "
                                             f"{fam['batch']} (its collectives, copies and "
                                             f"kernel statements)" if fam else
                                             "counted (no whole-kernel measure of this spec "
                                             "at these rows)"),
                         "seconds": round(time.perf_counter() - t0, 2)}}


def describe(measure: dict) -> str:
    """The `priced by` text of an op-level measure."""
    o = measure["op_level"]
    counted = o["ops_counted"]
    return (f"compiled per op: the cycles libtpu {measure['libtpu']} scheduled for each op body "
            f"({o['ops_derived']} from whole-kernel measures of the same body, "
            f"{o['ops_compiled_alone']} compiled alone, {o.get('ops_compiled_now', 0)} of them "
            f"just now; mkc.perf.op_measures)"
            + (f", {len(counted)} counted ({', '.join(sorted(counted))})" if counted else "")
            + f"; collectives and kernel statements {o['statements_from']}")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        sys.exit(_compile_worker(sys.argv[2]))
    sys.exit("usage: python -m mkc.perf.op_measures --worker JOB.json")
