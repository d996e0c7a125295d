"""The compute work of the kernel mkc emits, counted from the kernel itself.

The generated module for a schedule is rendered, its kernel traced to a jaxpr at the batch the
model prices (`jax.make_jaxpr`, no device, about a second for full K3), and every equation
counted under the op whose name scope it was traced in (`mkc.runtime.scopes`):

- **vector**: elementwise, comparison, select, cast and reduction equations on arrays, in VPU
  element operations: the operand's vector registers, each (8, 128) 32-bit values or
  (16, 128) bf16 ones, times 1024. A [1, 128] row costs a whole register, as on the VPU.
- **transcendental**: exp, log, logistic, tanh, rsqrt, ... (the EUP), in the same units.
- **matrix**: each `dot_general` as the values loaded into the MXU (batch x contracted x the
  larger free size, the operand held stationary) and the rows streamed past them (the smaller
  free size), keyed by the MXU input type.

Free: scalar (rank-0) work (the scalar unit), layout changes (slice, reshape, broadcast,
concatenate, iota, bitcast), loads and stores, DMAs and semaphores. A loop of static length
inside an op counts its body that many times (a loop that calls ops, as the layer loop does,
counts once: the trace says how often each op runs); a loop whose length is decided at run time (the routed
experts, the KV tiles) counts one iteration, which is how the model uses it: work under
`mkc_weights` is priced per weight value the trace reads, work under `mkc_kv_tile` per KV tile
read. Of the two arms of a branch, the costlier is counted (per op and region).
"""
from __future__ import annotations

import hashlib
import importlib
import math
import time
import types
from collections import defaultdict
from dataclasses import dataclass, field
from functools import lru_cache

import jax
import jax.extend.core as jcore
import numpy as np

from mkc import files, ir
from mkc.model.contracts import body_of
from mkc.runtime import scopes

ELEMENTWISE = frozenset({
    "abs", "add", "and", "ceil", "clamp", "convert_element_type", "div", "eq", "floor", "ge",
    "gt", "integer_pow", "is_finite", "le", "lt", "max", "min", "mul", "ne", "neg", "nextafter",
    "not", "or", "population_count", "reduce_precision", "rem", "round", "select_n",
    "shift_left", "shift_right_arithmetic", "shift_right_logical", "sign", "square", "sub",
    "xor", "transpose"})
TRANSCENDENTAL = frozenset({
    "atan2", "cbrt", "cos", "erf", "erf_inv", "erfc", "exp", "exp2", "expm1", "log", "log1p",
    "logistic", "pow", "rsqrt", "sin", "sqrt", "tan", "tanh"})
REDUCTION = frozenset({"argmax", "argmin", "cumlogsumexp", "cummax", "cummin", "cumprod",
                       "cumsum", "reduce_and", "reduce_max", "reduce_min", "reduce_or",
                       "reduce_prod", "reduce_sum", "reduce_xor"})

LANES = 128
VREG_VALUES = 1024           # 32-bit values in one (8, 128) vector register: the unit of `vector`


def vreg_values(shape: tuple[int, ...], dtype) -> float:
    """VPU element operations to touch every value of an array once: its vector registers
    (the last two dims tiled (8, 128) for 32-bit values, (16, 128) for 16-bit, ...) x 1024."""
    if not shape:
        return 0.0
    itemsize = min(4, np.dtype(dtype).itemsize)
    sublanes = 8 * (4 // itemsize)
    rows, cols = (1, shape[-1]) if len(shape) == 1 else shape[-2:]
    lead = math.prod(shape[:-2]) if len(shape) > 2 else 1
    return float(lead * -(-rows // sublanes) * -(-cols // LANES) * VREG_VALUES)


MIXED_FP8 = "bf16xfp8"
MIXED_FP4 = "bf16xfp4"


def mxu_type(a, b) -> str:
    """The MXU input type of a dot of dtypes a and b: the wider of the two, except bf16 with
    fp8 ("bf16xfp8") or fp4 ("bf16xfp4"): bf16 rows through fp8 or fp4 weights pushed as they
    are (`Rates.mxu_rate`)."""
    names = {np.dtype(jax.numpy.bfloat16): "bf16", np.dtype(np.float32): "f32",
             np.dtype(np.int8): "int8", np.dtype(np.uint8): "int8"}
    kinds = []
    for d in (np.dtype(a), np.dtype(b)):
        if d in names:
            kinds.append(names[d])
        elif "float8" in d.name:
            kinds.append("fp8")
        elif "float4" in d.name or d.name.startswith("int4"):
            kinds.append("fp4")
        else:
            kinds.append("f32")
    if sorted(kinds) == ["bf16", "fp8"]:
        return MIXED_FP8
    if sorted(kinds) == ["bf16", "fp4"]:
        return MIXED_FP4
    order = ["fp4", "int8", "fp8", "bf16", "f32"]
    return max(kinds, key=order.index)


@dataclass
class Work:
    """Counted work (see the module docstring for the units)."""

    vector: float = 0.0
    transcendental: float = 0.0
    # (MXU input type, rows streamed) -> values loaded into the MXU
    matrix: dict[tuple[str, int], float] = field(default_factory=dict)

    @property
    def matrix_values(self) -> float:
        return sum(self.matrix.values())

    @property
    def size(self) -> float:
        """One number to compare the arms of a branch by."""
        return self.vector + self.transcendental + self.matrix_values

    def add(self, other: "Work", times: float = 1.0) -> None:
        self.vector += times * other.vector
        self.transcendental += times * other.transcendental
        for k, v in other.matrix.items():
            self.matrix[k] = self.matrix.get(k, 0.0) + times * v

    def scaled(self, times: float) -> "Work":
        w = Work()
        w.add(self, times)
        return w


# What the generated module runs for the trace's tail ops (module.py.j2's prologue/epilogue).
TAIL_SOURCES = {"embed": "mkc.runtime.collectives.embed and the lowering's prologue",
                "final_norm": "the lowering's final_hidden",
                "lm_head": "mkc.runtime.ring.matmul (the vocab-sharded lm_head)"}


@dataclass
class OpWork:
    """One op's counted work: `at_op` where it begins, `weights` for the weight values its
    matmuls under `mkc_weights` take in (`weight_values` of them: priced per value read), and
    `kv_tile` for one KV tile."""

    kind: str
    op: str
    at_op: Work = field(default_factory=Work)
    weights: Work = field(default_factory=Work)
    kv_tile: Work = field(default_factory=Work)
    dynamic_loop: bool = False     # op-level work in a loop of run-time length (counted once)

    @property
    def weight_values(self) -> float:
        return self.weights.matrix_values

    def per_weight_value(self) -> Work:
        """The weights-region work per weight value fed to the MXU (zero without any)."""
        n = self.weight_values
        return self.weights.scaled(1.0 / n) if n else Work()


@dataclass
class KernelWork:
    """Counted work of one kernel (one rank, one batch)."""

    batch: int
    ops: dict[tuple[str, str], OpWork]
    outside: Work                  # work in no op's scope (barriers, collectives' sums, ...)
    source: str                    # where the ops' bodies live (the family's lowering module)
    trace_seconds: float = 0.0
    run_time_loop_ops: frozenset = frozenset()   # ops with work in a loop of run-time length
    # (kind, op) -> the function its body is (module.qualname), where the module says
    sources: dict = field(default_factory=dict)

    def op(self, kind: str, name: str) -> OpWork:
        got = self.ops.get((kind, name))
        return got if got is not None else OpWork(kind, name)

    def source_of(self, kind: str, name: str) -> str:
        """Where an op's counted work was traced from: its compute body (a layer library
        function, or the family lowering's own), or, for the tail, the module's epilogue and
        prologue."""
        if kind == scopes.TAIL:
            return TAIL_SOURCES.get(name, "the generated module")
        return self.sources.get((kind, name), f"{self.source}.{name}")


# ---- counting --------------------------------------------------------------------------------
def subjaxprs(params: dict) -> list[jcore.Jaxpr]:
    """The jaxprs an equation's params hold (a loop's body, a branch, a call's)."""
    out = []
    for v in params.values():
        for x in (v if isinstance(v, (tuple, list)) else (v,)):
            if isinstance(x, jcore.ClosedJaxpr):
                out.append(x.jaxpr)
            elif isinstance(x, jcore.Jaxpr):
                out.append(x)
    return out


def _where(stack: tuple[str, ...]) -> tuple[tuple[str, str] | None, str]:
    """(op key, region) of a name stack: the outermost op scope and, inside it, the outermost
    weights or KV-tile scope."""
    key, region = None, "op"
    for name in stack:
        if key is None and name.startswith(scopes.OP + ":"):
            kind, _, op = name[len(scopes.OP) + 1:].partition(".")
            key = (kind, op)
        elif key is not None and region == "op" and name in (scopes.WEIGHTS, scopes.KV_TILE):
            region = name
    return key, region


Tally = dict  # (op key | None, region) -> Work


def _count(jaxpr: jcore.Jaxpr, stack: tuple[str, ...], dynamic: set) -> Tally:
    tally: Tally = defaultdict(Work)
    for e in jaxpr.eqns:
        own = tuple(n for n in str(e.source_info.name_stack).split("/") if n)
        here = stack + own
        name = e.primitive.name
        subs = subjaxprs(e.params)
        if name == "cond":
            arms = [_count(j, here, dynamic) for j in subs]
            for key in {k for arm in arms for k in arm}:
                tally[key].add(max((arm.get(key, Work()) for arm in arms), key=lambda w: w.size))
            continue
        if subs:
            times = 1.0
            if name == "scan" and _where(here)[0] is not None:
                # a loop inside an op; a loop that calls ops (the layer loop) is the trace's
                # business: an op's work is counted per call
                times = float(e.params["length"])
            elif name == "while":
                subs = [e.params["body_jaxpr"].jaxpr]
            for j in subs:
                for (key, region), w in _count(j, here, dynamic).items():
                    tally[key, region].add(w, times)
                    if name == "while" and w.size:
                        dynamic.add((key, region))
            continue
        work = _eqn_work(e)
        if work is not None:
            tally[_where(here)].add(work)
    return tally


def _eqn_work(e) -> Work | None:
    name = e.primitive.name
    if name == "dot_general":
        (lc, rc), (lb, rb) = e.params["dimension_numbers"]
        a, b = e.invars[0].aval, e.invars[1].aval
        batch = math.prod(a.shape[d] for d in lb)
        k = math.prod(a.shape[d] for d in lc)
        m = math.prod(s for d, s in enumerate(a.shape) if d not in lc and d not in lb)
        n = math.prod(s for d, s in enumerate(b.shape) if d not in rc and d not in rb)
        return Work(matrix={(mxu_type(a.dtype, b.dtype), min(m, n)): float(batch * k * max(m, n))})
    if name in ELEMENTWISE or name in TRANSCENDENTAL:
        avals = [v.aval for v in e.outvars] + [v.aval for v in e.invars if hasattr(v, "aval")]
        shaped = [a for a in avals if getattr(a, "shape", ())]
        if not shaped:
            return None
        n = max(vreg_values(a.shape, a.dtype) for a in shaped)
        return Work(transcendental=n) if name in TRANSCENDENTAL else Work(vector=n)
    if name in REDUCTION:
        a = e.invars[0].aval
        return Work(vector=vreg_values(a.shape, a.dtype)) if a.shape else None
    return None


def count_kernel(closed: jcore.ClosedJaxpr, batch: int, source: str) -> KernelWork:
    """Count a traced kernel (the jaxpr of its `pallas_call` body, or any jaxpr holding one)."""
    jaxpr = kernel_jaxpr(closed.jaxpr)
    dynamic: set = set()
    tally = _count(jaxpr, (), dynamic)
    ops: dict[tuple[str, str], OpWork] = {}
    outside = Work()
    for (key, region), w in tally.items():
        if key is None:
            outside.add(w)
            continue
        ow = ops.setdefault(key, OpWork(*key))
        {"op": ow.at_op, scopes.WEIGHTS: ow.weights, scopes.KV_TILE: ow.kv_tile}[region].add(w)
    for key, region in dynamic:
        if key in ops and region == "op":
            ops[key].dynamic_loop = True
    return KernelWork(batch, ops, outside, source,
                      run_time_loop_ops=frozenset(key for key, _ in dynamic if key in ops))


def kernel_jaxpr(jaxpr: jcore.Jaxpr) -> jcore.Jaxpr:
    """The body of the first pallas_call in `jaxpr` (searched depth first), else `jaxpr`."""
    for e in jaxpr.eqns:
        if e.primitive.name == "pallas_call":
            return e.params["jaxpr"]
        for j in subjaxprs(e.params):
            found = kernel_jaxpr(j)
            if found is not j:
                return found
    return jaxpr


# ---- the emitted module, traced ------------------------------------------------------------
@lru_cache(maxsize=64)
def import_source(source: str) -> types.ModuleType:
    """The generated module `source`, imported (once a source)."""
    name = "mkc_priced_" + hashlib.sha256(source.encode()).hexdigest()[:16]
    # registered: dataclasses in the module look themselves up in sys.modules
    return files.import_generated(source=source, name=name, register=True)


def trace_module(module: types.ModuleType, batch: int,
                 verify_rows: int | None = None) -> jcore.ClosedJaxpr:
    """The kernel of a generated module at `batch` rows (a verify kernel with `verify_rows`),
    traced for one rank from abstract inputs."""
    rows = jax.ShapeDtypeStruct((batch,), np.int32)
    R = verify_rows or 1
    states = module.state_shapes(batch // R, R) if verify_rows else module.state_shapes(batch)
    args = [rows, rows, jax.ShapeDtypeStruct(module.HOST.tables().shape, np.int32),
            jax.ShapeDtypeStruct(module.HOST.tile_classes().shape, np.int32),
            *[jax.ShapeDtypeStruct(*v) for v in module.vmem_input_shapes(batch).values()],
            *[jax.ShapeDtypeStruct(*v) for v in module.hbm_shapes().values()],
            *[jax.ShapeDtypeStruct(*v) for v in states.values()]]
    call = module.build_kernel(batch, verify_rows=verify_rows)
    return jax.make_jaxpr(call, axis_env=[(module.AXIS, module.RANKS)])(*args)


_COUNTED: dict[tuple[str, int, int | None], KernelWork] = {}


@lru_cache(maxsize=4)
def trace_source(source: str, batch: int, verify_rows: int | None) -> jcore.ClosedJaxpr:
    """`trace_module` of the generated module `source` (cached)."""
    return trace_module(import_source(source), batch, verify_rows)


def clear_cache() -> None:
    """Forget counted and traced kernels (their key is the module's source: a changed lowering
    function is not seen until then)."""
    _COUNTED.clear()
    trace_source.cache_clear()
    kernel_digest.cache_clear()


@lru_cache(maxsize=8)
def kernel_digest(source: str, batch: int, verify_rows: int | None = None) -> str:
    """A digest of what libtpu is given to compile: the module's kernel at `batch` rows, traced,
    with its named scopes and without source locations. A lowering function rewritten to emit
    the same operations (moved, renamed, shared between families) leaves it unchanged."""
    text = trace_source(source, batch, verify_rows).pretty_print(source_info=False, name_stack=True)
    return hashlib.sha256(" ".join(text.split()).encode()).hexdigest()


def _function_name(body) -> str:
    fn = getattr(body, "func", body)          # a composed kind's body: options bound by partial
    return f"{fn.__module__}.{fn.__qualname__}"


def kernel_work(s: ir.ScheduleIR, batch: int, verify_rows: int | None = None) -> KernelWork:
    """The counted work of the kernel mkc emits for `s` at `batch` rows (cached per module
    source and batch)."""
    from mkc.codegen.emit import render          # codegen loads JAX's Pallas: only when priced
    source = render(s, "")
    key = (hashlib.sha256(source.encode()).hexdigest(), batch, verify_rows)
    if key not in _COUNTED:
        t0 = time.perf_counter()
        closed = trace_source(source, batch, verify_rows)
        kw = count_kernel(closed, batch, f"{s.family_package}.lowering")
        lowering = importlib.import_module(kw.source)   # the module the traced kernel imported
        kw.sources = {(kind, op): _function_name(body_of(lowering, kind, op))
                      for kind, op in kw.ops if kind != scopes.TAIL}
        kw.trace_seconds = time.perf_counter() - t0
        _COUNTED[key] = kw
    return _COUNTED[key]
