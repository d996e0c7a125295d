"""The step-time model prices each collective by the bytes the emitted kernel sends: every
round's payload in the dtype of the receive buffer the generated module declares (a share is
cast to that dtype and copied slot to slot, `mkc.runtime.collectives._exchange`)."""
import numpy as np
import pytest

from mkc import ir
from mkc.codegen.emit import render
from mkc.compiler import check_source
from mkc.perf.run import perf_trace
from mkc.perf.work import import_source
from mkc.steps.collectives import AllGather, AllReduce, Exchange, OverlapPart, OverlapStart
from mkc.trace import Collective
from tests_support import K3_SPEC, k3_split_router_text

BATCH = 8


@pytest.fixture(scope="module")
def k3():
    """K3 with its router split, so every kind of collective runs (the shipped spec's router is
    whole)."""
    s = check_source(k3_split_router_text(), str(K3_SPEC)).ir
    return s, import_source(render(s, "")), perf_trace(s, BATCH, 256)


def _collectives(events) -> list:
    """The collective steps of a trace, an overlapped one once (at its start)."""
    tags = [e.tag for e in events if isinstance(e, Collective)]
    return [t.collective if isinstance(t, OverlapStart) else t for t in tags
            if isinstance(t, OverlapStart) or not isinstance(t, OverlapPart)]


def _scratch(module, name: str) -> tuple[int, int]:
    """(columns per row, bytes per value) of a receive buffer as the emitted module declares it."""
    got = module.SCRATCH_SHAPES[name]
    return got.shape[-1], np.dtype(got.dtype).itemsize


def test_every_collective_round_moves_its_payload_in_the_emitted_buffer_dtype(k3):
    s, module, events = k3
    steps = _collectives(events)
    assert {type(t) for t in steps} == {AllReduce, AllGather, Exchange}
    for step in steps:
        rounds = step.rounds(BATCH, s.cores_per_chip)
        x = step.entry
        if isinstance(step, AllReduce):
            if x.scattered(BATCH):
                continue        # test_a_scattering_all_reduce_is_priced_by_the_form_its_kernel_runs
            assert len(rounds) == len(x.stages)
            for rd, (size, stride) in zip(rounds, x.stages):
                _, itemsize = _scratch(module, ir.AllReduce.buffer_name(x.wire_dtype, size, stride,
                                                                        owner=x.owner))
                assert rd.nbytes == BATCH * x.width * itemsize, step
            continue
        # a gather or exchange sends its whole [B, width] share: the receive slot's width
        name = (ir.AllGather if isinstance(step, AllGather) else ir.Exchange).buffer_name(x.after_op)
        cols, itemsize = _scratch(module, name)
        (rd,) = rounds
        assert cols == x.width
        assert rd.nbytes == BATCH * cols * itemsize, step


def test_k3_gathers_are_priced_as_bf16(k3):
    """K3's latent all-gathers receive bf16: 2 bytes a value on the wire, not 4."""
    s, module, events = k3
    gathers = {t.op: t for t in _collectives(events) if isinstance(t, AllGather)}
    assert set(gathers) == {"latent_down", "latent_up"}
    for op, step in gathers.items():
        assert _scratch(module, ir.AllGather.buffer_name(op))[1] == 2
        (rd,) = step.rounds(BATCH, s.cores_per_chip)
        assert rd.nbytes == BATCH * step.entry.width * 2


@pytest.mark.parametrize("rows", [1, 7, BATCH])
def test_a_scattering_all_reduce_is_priced_by_the_form_its_kernel_runs(k3, rows):
    """K3's `scatter from 8 rows` (and the overlapped shared-expert sum's `scatter`, at every
    width): where the kernel runs one-shot stages, the whole width to every peer; scattered,
    the chunk (7168 / 8 columns; the routed experts' 3584 / 8 padded to 512) to every peer of
    the host and across hosts in the wire dtype of the buffers the module declares (the
    overlapped sum's its own, the others as wide as the widest chunk), then the chunk sums
    gathered over the host in f32; each stage's sums over the chunk."""
    s, module, events = k3
    steps = [t for t in _collectives(events)
             if isinstance(t, AllReduce) and t.entry.scatter_from is not None]
    assert {st.entry.after_op for st in steps} == {"o_proj", "down", "shared_down", "embed",
                                                   "routed_experts"}
    for step in steps:
        x = step.entry
        rounds = step.rounds(rows, s.cores_per_chip)
        if not x.scattered(rows):
            assert [(r.size, r.stride, r.nbytes) for r in rounds] == [
                (size, stride, rows * x.width * 2) for size, stride in x.stages]
            continue
        assert rows == BATCH or x.after_op == "shared_down"
        chunk = 512 if x.after_op == "routed_experts" else x.width // 8
        assert x.chunk == chunk
        names = [ir.AllReduce.role_buffer_name(role, wire, *group, x.owner) for role, wire, group
                 in (("scatter", "bf16", (8, 1)), ("chunk", "bf16", (4, 8)), ("sums", "f32", (8, 1)))]
        assert [(r.size, r.stride) for r in rounds] == [(8, 1), (4, 8), (8, 1)]
        for rd, name in zip(rounds, names):
            cols, itemsize = _scratch(module, name)
            assert cols == 7168 // 8 and rd.nbytes == rows * chunk * itemsize, (step, name)
        assert [r.sums for r in rounds] == [7 * rows * chunk, 3 * rows * chunk, 0]
