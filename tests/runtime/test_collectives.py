"""``mkc.runtime.collectives`` in one grid-less kernel under ``jax.shard_map`` on 16 ranks: a two-level
all-reduce (8, 1) then (2, 8), all-gathers over (16, 1) and (8, 1) and the sibling exchange, each
called twice in a row so the buffer parity alternates; and through the named stages
(`collectives.allreduce`) on random f32 partials with a bf16 wire: the one-shot two-level
all-reduce, its scattered form (reduce-scatter over (8, 1) into slots wider than the chunk, the
chunk over (2, 8), the f32 all-gather), the scattered form on columns that do not split into
whole lane tiles (chunks padded with zeros, the result cut back) and a direct scattered one
over (8, 1), each bit-equal
to the rounding emulation (`mkc.reference.rounding.allreduce`, which knows only the one-shot
stages). The scattered form and an all-gather overlapped (`InFlight`): started, advanced while
other collectives run, finished; bit-equal to the same run at once, and a mutant that reads its
slots without waiting for them is caught. Runs in TPU interpret mode on 16 virtual CPU devices
(on-wait and eager DMAs, and with race detection) and compile-only for tpu7x=2x2x2, with JAX's
deprecation warnings as errors.

Every run is a subprocess (the device count is fixed when jax initialises):
``python tests/runtime/test_collectives.py on_wait|eager|races|races_eager|compile [lean]`` prints one
``JSON`` line."""
from __future__ import annotations

import functools
import json
import os
import sys
import types
import warnings

if __name__ == "__main__":
    os.environ["JAX_PLATFORMS"] = "cpu"
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=16"
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")   # libtpu's lockfile, no TPU here

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh, PartitionSpec as P  # noqa: E402

from mkc.runtime import collectives as coll  # noqa: E402
from mkc.runtime.collectives import GatherSums, ReduceScatter, Stage  # noqa: E402

AXIS, RANKS, B, W = "tp", 16, 8, 128
F32, BF16 = jnp.float32, jnp.bfloat16
ROUNDS = 2
# name -> (group size, stride, buffer dtype); every buffer is [2, size, B, W] with its own counter.
BUFFERS = {"ar8": (8, 1, F32), "ar2": (2, 8, F32), "ag16": (16, 1, F32), "ag8": (8, 1, BF16),
           "sib": (2, 1, F32)}
# The named stages' buffers: name -> (shape, dtype, with semaphores and a use counter). The
# scattered two-level form's slots are twice its chunk (a payload narrower than its buffer);
# a reduce-scatter's send staging has no semaphores.
WIDE = 8 * W                       # the named stages' columns (chunks of W over 8 ranks)
# columns a scatter over 8 ranks pads: chunks of W, the seventh part-filled, the eighth empty
PADDED = 6 * W + 88
NAMED = {"os8": ((2, 8, B, WIDE), BF16, True), "os2": ((2, 2, B, WIDE), BF16, True),
         "rs8": ((2, 8, B, 2 * W), BF16, True), "st8": ((8, B, 2 * W), BF16, False),
         "ch2": ((2, 2, B, 2 * W), BF16, True), "gs8": ((2, 8, B, 2 * W), F32, True),
         "rsd": ((2, 8, B, W), BF16, True), "std": ((8, B, W), BF16, False),
         "gsd": ((2, 8, B, W), F32, True),
         # the overlapped scattered form's and all-gather's own buffers
         "rso": ((2, 8, B, 2 * W), BF16, True), "sto": ((8, B, 2 * W), BF16, False),
         "cho": ((2, 2, B, 2 * W), BF16, True), "gso": ((2, 8, B, 2 * W), F32, True),
         "ago": ((2, 16, B, W), F32, True)}
COUNTED = [n for n, (_, _, sems) in NAMED.items() if sems]


def _stage(cls, name: str, size: int, stride: int, **kw):
    return cls(buffer=name, counter=len(BUFFERS) + COUNTED.index(name), size=size, stride=stride, **kw)


ONE_SHOT = (_stage(Stage, "os8", 8, 1), _stage(Stage, "os2", 2, 8))
SCATTERED = (_stage(ReduceScatter, "rs8", 8, 1, staging="st8"), _stage(Stage, "ch2", 2, 8),
             _stage(GatherSums, "gs8", 8, 1))
SCATTERED_DIRECT = (_stage(ReduceScatter, "rsd", 8, 1, staging="std"),
                    _stage(GatherSums, "gsd", 8, 1))
OVERLAPPED = (_stage(ReduceScatter, "rso", 8, 1, staging="sto"), _stage(Stage, "cho", 2, 8),
              _stage(GatherSums, "gso", 8, 1))
OVERLAPPED_GATHER = _stage(Stage, "ago", 16, 1)


class _LandsUnwaited(coll.InFlight):
    """The mutant: a stage's slots read without waiting for its copies (`mutant` modes)."""

    def _land(self):
        return self.stage.finish(self.refs, self.sent.par, self.width)
# output name -> per-rank shape, dtype; index 0/1 is the round.
OUTPUTS = {f"{name}{n}": (shape, dtype) for n in range(ROUNDS) for name, shape, dtype in
           [("ar", (B, W), F32), ("ag16", (B, 16 * W), F32), ("ag8", (B, 8 * W), BF16),
            ("sib", (B, 2 * W), F32), ("os", (B, WIDE), F32), ("sc", (B, WIDE), F32),
            ("sd", (B, WIDE), F32), ("ov", (B, WIDE), F32), ("og", (B, 16 * W), F32),
            ("sp", (B, PADDED), F32)]}


def _kernel(x_ref, y_ref, *refs, in_flight=coll.InFlight):
    """x_ref [ROUNDS, 3, B, W] f32: per round the all-reduce, all-gather and sibling inputs;
    y_ref [ROUNDS, B, WIDE] f32: per round the named stages' partial sums."""
    outs = dict(zip(OUTPUTS, refs))
    scratch = refs[len(OUTPUTS):]
    bufs = {name: scratch[3 * i:3 * i + 3] for i, name in enumerate(BUFFERS)}
    named = {}
    it = iter(scratch[3 * len(BUFFERS):-1])
    for name, (_, _, sems) in NAMED.items():
        named[name] = next(it)
        if sems:
            named[name + "__send"], named[name + "__recv"] = next(it), next(it)
    count = scratch[-1]
    named_refs = types.SimpleNamespace(**named, collective_count=count)
    coll.barrier(AXIS, RANKS)
    for i in range(len(BUFFERS) + len(COUNTED)):
        count[i] = 0

    def call(fn, name, value, *group):
        return fn(value, *bufs[name], count, list(BUFFERS).index(name), AXIS, *group)

    # Each buffer's uses come back to back, so nothing but the parity argument keeps a peer's next
    # share out of a slot this rank is still reading (a collective in between would order them).
    h = [call(coll.allreduce_stage, "ar8", x_ref[n, 0], 8, 1) for n in range(ROUNDS)]
    for n in range(ROUNDS):
        outs[f"ar{n}"][...] = call(coll.allreduce_stage, "ar2", h[n], 2, 8)
    for n in range(ROUNDS):
        outs[f"ag16{n}"][...] = call(coll.allgather, "ag16", x_ref[n, 1], 16, 1)
    for n in range(ROUNDS):
        outs[f"ag8{n}"][...] = call(coll.allgather, "ag8", x_ref[n, 1], 8, 1)
    for n in range(ROUNDS):
        outs[f"sib{n}"][...] = call(coll.exchange_with_sibling, "sib", x_ref[n, 2])
    for name, stages in (("os", ONE_SHOT), ("sc", SCATTERED), ("sd", SCATTERED_DIRECT)):
        for n in range(ROUNDS):
            outs[f"{name}{n}"][...] = coll.allreduce(named_refs, y_ref[n], stages, AXIS)
    for n in range(ROUNDS):
        outs[f"sp{n}"][...] = coll.allreduce(named_refs, y_ref[n, :, :PADDED], SCATTERED, AXIS)
    # Overlapped: both in flight at once, each stage landed after another collective ran.
    for n in range(ROUNDS):
        reduce = in_flight(named_refs, OVERLAPPED, y_ref[n], AXIS)
        g = OVERLAPPED_GATHER
        gather = in_flight(named_refs, (GatherSums(g.buffer, g.counter, g.size, g.stride),),
                           x_ref[n, 1], AXIS)
        outs[f"sd{n}"][...] = coll.allreduce(named_refs, y_ref[n], SCATTERED_DIRECT, AXIS)
        reduce.advance()
        outs[f"os{n}"][...] = coll.allreduce(named_refs, y_ref[n], ONE_SHOT, AXIS)
        reduce.advance()
        outs[f"og{n}"][...] = gather.finish()
        outs[f"ov{n}"][...] = reduce.finish()


def build(mesh: Mesh, interpret, mutant: bool = False):
    """The jitted collective step over ``mesh``: x [RANKS, ROUNDS, 3, B, W] -> outputs stacked
    over ranks (`mutant`: its overlapped collectives `_LandsUnwaited`)."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    scratch = []
    for size, _, dtype in BUFFERS.values():
        scratch += [pltpu.VMEM((2, size, B, W), dtype), pltpu.SemaphoreType.DMA((2, size)),
                    pltpu.SemaphoreType.DMA((2, size))]
    for shape, dtype, sems in NAMED.values():
        scratch.append(pltpu.VMEM(shape, dtype))
        if sems:
            scratch += [pltpu.SemaphoreType.DMA(shape[:2])] * 2
    scratch.append(pltpu.SMEM((len(BUFFERS) + len(COUNTED),), jnp.int32))
    kernel = functools.partial(_kernel, in_flight=_LandsUnwaited) if mutant else _kernel
    call = pl.pallas_call(
        kernel, out_shape=[jax.ShapeDtypeStruct(s, d) for s, d in OUTPUTS.values()],
        in_specs=[vmem, vmem], out_specs=[vmem] * len(OUTPUTS), scratch_shapes=scratch,
        compiler_params=pltpu.CompilerParams(collective_id=0, has_side_effects=True),
        interpret=interpret if interpret is not None else False)

    def per_rank(x, y):
        return [o[None] for o in call(x[0], y[0])]

    return jax.jit(jax.shard_map(per_rank, mesh=mesh, in_specs=(P(AXIS), P(AXIS)),
                                 out_specs=[P(AXIS)] * len(OUTPUTS), check_vma=False))


def inputs() -> tuple[np.ndarray, np.ndarray]:
    """x: random small integers per rank (exact in bf16 and in any f32 summation order), offset
    in round 2, so a share from the wrong rank or round shows. y: random normal partial sums,
    whose f32 sums depend on the order of the additions and whose bf16 roundings are inexact."""
    rng = np.random.default_rng(0)
    x = rng.integers(-8, 9, (RANKS, ROUNDS, 3, B, W)).astype(np.float32)
    x[:, 1] += 32.0                       # round 2 differs everywhere from round 1
    y = rng.standard_normal((RANKS, ROUNDS, B, WIDE)).astype(np.float32)
    return x, y


def expected(x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """Per-rank results [RANKS, ...] of every output: in numpy, and for the named stages the
    rounding emulation of the one-shot stages (every rank ends with the same value)."""
    from mkc.reference.rounding import Reduce, allreduce
    want = {}
    for n in range(ROUNDS):
        partials = [y[r, n] for r in range(RANKS)]
        two = np.asarray(allreduce(partials, Reduce(((8, 1), (2, 8)), "bf16")))
        want[f"os{n}"] = want[f"sc{n}"] = want[f"ov{n}"] = np.broadcast_to(two, (RANKS, B, WIDE))
        want[f"sp{n}"] = want[f"os{n}"][..., :PADDED]       # column by column, the same sums
        # a direct all-reduce over each host's 8 ranks: rank r holds its host's sum
        direct = [np.asarray(allreduce(partials[h:h + 8], Reduce(((8, 1),), "bf16")))
                  for h in (0, 8)]
        want[f"sd{n}"] = np.stack([direct[r // 8] for r in range(RANKS)])
        want[f"ar{n}"] = np.broadcast_to(x[:, n, 0].sum(0), (RANKS, B, W))
        ag = [np.concatenate(list(x[g:g + size, n, 1]), axis=-1) for size in (16, 8)
              for g in range(0, RANKS, size)]
        want[f"ag16{n}"] = want[f"og{n}"] = np.stack([ag[0]] * RANKS)
        want[f"ag8{n}"] = np.stack([ag[1 + r // 8] for r in range(RANKS)])
        want[f"sib{n}"] = np.stack([np.concatenate([x[r & ~1, n, 2], x[r | 1, n, 2]], axis=-1)
                                    for r in range(RANKS)])
    return want


def run_interpret(mode: str) -> dict:
    """Exact-equality verdict per output, a digest of their bytes and whether the race
    detector fired (`mutant_...`: the mode's run of the mutant)."""
    import hashlib
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    params = {"on_wait": pltpu.InterpretParams(),
              "eager": pltpu.InterpretParams(dma_execution_mode="eager"),
              "races": pltpu.InterpretParams(detect_races=True, vector_clock_size=64, on_race="warn"),
              "races_eager": pltpu.InterpretParams(detect_races=True, vector_clock_size=64,
                                                   on_race="warn", dma_execution_mode="eager")
              }[mode.removeprefix("mutant_")]
    mesh = Mesh(np.array(jax.devices()[:RANKS]), (AXIS,))
    x, y = inputs()
    got = build(mesh, params, mode.startswith("mutant_"))(jnp.asarray(x), jnp.asarray(y))
    want = expected(x, y)
    ok = {name: bool(np.array_equal(np.asarray(g, np.float32), want[name]))
          for name, g in zip(OUTPUTS, got)}
    digest = hashlib.sha256(b"".join(np.asarray(g).tobytes() for g in got)).hexdigest()
    return {"mode": mode, "ok": ok, "digest": digest, "races_found": bool(ipc.races.races_found)}


def run_compile() -> dict:
    from jax.experimental import topologies
    from jax.sharding import NamedSharding
    topo = topologies.get_topology_desc("tpu7x=2x2x2", platform="tpu")
    # The groups assume core-fastest rank numbering: rank = 8 * host + 2 * chip_in_host + core.
    assert [d.core_on_chip for d in topo.devices] == [0, 1] * (RANKS // 2), topo.devices
    assert [d.process_index for d in topo.devices] == [r // 8 for r in range(RANKS)], topo.devices
    mesh = Mesh(np.array(topo.devices), (AXIS,))
    x = jax.ShapeDtypeStruct((RANKS, ROUNDS, 3, B, W), F32, sharding=NamedSharding(mesh, P(AXIS)))
    y = jax.ShapeDtypeStruct((RANKS, ROUNDS, B, WIDE), F32, sharding=NamedSharding(mesh, P(AXIS)))
    build(mesh, None).lower(x, y).compile()
    return {"mode": "compile", "compiled": "tpu7x=2x2x2"}


# ---- pytest side: one subprocess per mode a session, shared by the checks of that mode --------
@functools.cache
def _run(mode: str, lean: bool = True) -> dict:
    """`lean`: with `mkc.interpret.lean_interpreter`, as the runners run (tests/test_interpret.py
    compares it with JAX's own)."""
    from conftest import run_python
    from tests_support import cpu_compilation_cache, once_per_session

    def run() -> dict:
        r = run_python([__file__, mode] + ["lean"] * lean, timeout=600,
                       env=None if mode == "compile" else cpu_compilation_cache())
        assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
        return json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("JSON "))[5:])

    return once_per_session(f"collectives-{mode}-{'lean' if lean else 'jax'}", run)


# CI runs both DMA modes with race detection (the same DMAs and checks, and the detector);
# without it, the extended tier's
@pytest.fixture(params=[pytest.param("on_wait", marks=pytest.mark.extended),
                        pytest.param("eager", marks=pytest.mark.extended), "races", "races_eager"])
def interpreted(request) -> dict:
    return _run(request.param)


@pytest.mark.parametrize("rnd", range(ROUNDS))
def test_two_level_allreduce_equals_the_sum_on_every_rank(interpreted, rnd):
    assert interpreted["ok"][f"ar{rnd}"], interpreted


@pytest.mark.parametrize("rnd", range(ROUNDS))
@pytest.mark.parametrize("group", ["ag16", "ag8"])
def test_allgather_equals_the_concatenation(interpreted, group, rnd):
    assert interpreted["ok"][f"{group}{rnd}"], interpreted


@pytest.mark.parametrize("rnd", range(ROUNDS))
def test_sibling_exchange_in_core_order(interpreted, rnd):
    assert interpreted["ok"][f"sib{rnd}"], interpreted


@pytest.mark.parametrize("rnd", range(ROUNDS))
@pytest.mark.parametrize("form", ["os", "sc", "sd", "sp"])
def test_named_stages_bit_equal_to_the_rounding_emulation(interpreted, form, rnd):
    """The one-shot two-level all-reduce, its scattered form (also on padded chunks) and the
    direct scattered one: every rank's result bit-equal to the emulation of the one-shot
    stages."""
    assert interpreted["ok"][f"{form}{rnd}"], interpreted


@pytest.mark.parametrize("rnd", range(ROUNDS))
@pytest.mark.parametrize("form", ["ov", "og"])
def test_overlapped_bit_equal_to_the_collective_run_at_once(interpreted, form, rnd):
    """The scattered form and a 16-rank all-gather in flight together, each stage landed after
    another collective ran: bit-equal to the emulation and the concatenation."""
    assert interpreted["ok"][f"{form}{rnd}"], interpreted


@pytest.mark.parametrize("mode", ["on_wait", "races_eager"])
def test_an_overlapped_collective_landing_unwaited_is_caught(mode):
    """The mutant reads its slots without waiting for the copies into them: on-wait DMAs never
    run, so its results are wrong; eager ones may already have landed, so the race detector
    must say so."""
    result = _run(f"mutant_{mode}")
    if mode == "on_wait":
        assert not (result["ok"]["ov0"] and result["ok"]["og0"]), result
    else:
        assert result["races_found"] is True, result


def test_from_rows_picks_the_form_by_the_kernels_rows():
    chosen = coll.FromRows(8, ONE_SHOT, SCATTERED)
    assert chosen.at(7) == ONE_SHOT and chosen.at(8) == chosen.at(16) == SCATTERED
    nested = coll.FromRows(8, coll.FromRows(4, ONE_SHOT, SCATTERED_DIRECT), SCATTERED)
    assert (nested.at(3), nested.at(4), nested.at(7), nested.at(8)) == (
        ONE_SHOT, SCATTERED_DIRECT, SCATTERED_DIRECT, SCATTERED)


@pytest.mark.parametrize("mode", ["races", "races_eager"])
def test_no_races(mode):
    """Both DMA modes: on-wait runs a copy when its receiver waits, which hides a write racing
    a read before that wait; eager runs it at start. The detector itself is guarded by
    tests/race_detector_canary.py (test_interpret_mini)."""
    result = _run(mode)
    assert result["races_found"] is False, result


def test_all_three_compile_for_tpu7x_2x2x2():
    """Lowered through Mosaic and compiled by libtpu (a few seconds, so not marked slow)."""
    assert _run("compile")["compiled"] == "tpu7x=2x2x2"


if __name__ == "__main__":
    warnings.simplefilter("error", DeprecationWarning)     # no deprecated JAX API, traced or lowered
    mode = sys.argv[1]
    lean = []
    if sys.argv[2:] == ["lean"]:
        from mkc.interpret import lean_interpreter
        lean = lean_interpreter()
    result = run_compile() if mode == "compile" else {**run_interpret(mode), "lean": lean}
    print("JSON " + json.dumps(result))
