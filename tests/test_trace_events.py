"""Trace events are typed (one frozen dataclass per kind), and every consumer dispatches on the
type through a table that refuses an event type it does not know, naming itself and the type,
rather than passing over it."""
from dataclasses import FrozenInstanceError, dataclass

import pytest

from mkc.checks.capacity import check_vmem, vmem_budget
from mkc.checks.dma import check_dma
from mkc.checks.pool import check_pools
from mkc.compiler import check_spec
from mkc.diagnostics import Span
from mkc.perf import constants
from mkc.perf.perfetto import vmem_series
from mkc.perf.sim import Mark, Model, Result, simulate
from mkc.perf.work import KernelWork, Work
from mkc.trace import (EVENT_TYPES, Alloc, Event, EventHandlers, TraceOptions, UnknownEventError,
                       build_trace)
from tests_support import K3_SPEC, SPEC


@dataclass(frozen=True, slots=True)
class Stray(Event):
    """An event kind no consumer has been taught."""


STRAY = Stray(0, "nowhere", Span.unknown("t.sched"))


@pytest.fixture(scope="module")
def qwen():
    return check_spec(SPEC, "qwen3_8_mini").ir


def _simulate(s, events):
    work = KernelWork(1, {}, Work(), "synthetic")
    return simulate(Model(s, 1, 0, constants.rates("tpu7x"), work=work), events)


def _perfetto_counters(s, events):
    res = Result(0.0, {}, {}, [], 0, 0.0, 0, marks=[Mark(0.0, e) for e in events])
    return vmem_series(s, res, 1)


CONSUMERS = {
    "the DMA check": check_dma,
    "the pool check": check_pools,
    "the VMEM timeline": check_vmem,
    "the step-time simulator": _simulate,
    "the Perfetto VMEM counters": _perfetto_counters,
}


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
def test_every_consumer_refuses_an_event_type_it_does_not_know(qwen, consumer):
    with pytest.raises(UnknownEventError, match=f"{consumer} does not handle trace event type Stray"):
        CONSUMERS[consumer](qwen, [STRAY])


def test_the_vmem_budget_refuses_it_too(qwen):
    """`vmem_budget` (the report, `expect`, the LSP) reads the VMEM timeline's dispatch."""
    events = build_trace(qwen)
    with pytest.raises(UnknownEventError, match="Stray"):
        vmem_budget(qwen, events[:5] + [STRAY] + events[5:])


def test_a_table_missing_an_event_type_is_refused_when_built():
    with pytest.raises(UnknownEventError, match="the test consumer has no entry for trace event "
                                                "types Free, CopyStart"):
        EventHandlers("the test consumer", {Alloc: None})


def test_every_event_kind_is_a_frozen_dataclass_and_every_trace_holds_only_them():
    assert all(t.__dataclass_params__.frozen for t in EVENT_TYPES)
    with pytest.raises(FrozenInstanceError):
        STRAY.seq = 1
    found = set()
    for spec, model in ((SPEC, "qwen3_8_mini"), (K3_SPEC, None)):
        s = check_spec(spec, model).ir
        found |= {type(e) for e in build_trace(s, TraceOptions(compute=True))}
    assert found == set(EVENT_TYPES)
