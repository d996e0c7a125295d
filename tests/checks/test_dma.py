"""check_dma on hand-built traces: the synchronisation rules no valid spec can reach."""
from mkc.checks.dma import check_dma
from mkc.compiler import check_spec
from mkc.tags import LayerState
from mkc.diagnostics import Span
from mkc.trace import TraceBuilder
from tests_support import SPEC
import pytest


@pytest.fixture(scope="module")
def schedule():
    return check_spec(SPEC, "qwen3_8_mini").ir


LOADED, UPDATED = LayerState(0), LayerState(0, updated=True)


def _codes(schedule, tb: TraceBuilder) -> list[str]:
    tb.exit("exit", Span.unknown("t.sched"))
    return [d.code for d in check_dma(schedule, tb.events)]


def test_clean_copy_passes(schedule):
    tb = TraceBuilder()
    tb.start(dst="x", slot=None, sem=("s",), nbytes=64, tag=LOADED, where="p", span=schedule.stream.span)
    tb.wait(sem=("s",), nbytes=64, where="p", span=schedule.stream.span)
    tb.read("x", None, LOADED, "p", schedule.stream.span)
    assert _codes(schedule, tb) == []


def test_wait_with_other_byte_count(schedule):
    tb = TraceBuilder()
    tb.start(dst="x", slot=None, sem=("s",), nbytes=64, tag=LOADED, where="p", span=schedule.stream.span)
    tb.wait(sem=("s",), nbytes=32, where="p", span=schedule.stream.span)
    assert "E-DMA-BYTES" in _codes(schedule, tb)


def test_double_wait_and_exit_in_flight(schedule):
    tb = TraceBuilder()
    tb.start(dst="x", slot=None, sem=("s",), nbytes=64, tag=LOADED, where="p", span=schedule.stream.span)
    tb.wait(sem=("s",), nbytes=64, where="p", span=schedule.stream.span)
    tb.wait(sem=("s",), nbytes=64, where="p", span=schedule.stream.span)
    tb.start(dst="x", slot=None, sem=("t",), nbytes=64, tag=UPDATED, where="p", span=schedule.stream.span)
    codes = _codes(schedule, tb)
    assert "E-DMA-WAIT" in codes and "E-DMA-EXIT" in codes


def test_compute_write_while_store_reads(schedule):
    tb = TraceBuilder()
    tb.write("x", None, LOADED, "p", schedule.stream.span)
    tb.start(dst="", slot=None, sem=("st",), nbytes=64, tag=None, src=("x", None, LOADED),
             where="p", span=schedule.stream.span)
    tb.write("x", None, UPDATED, "q", schedule.stream.span)
    tb.wait(sem=("st",), nbytes=64, where="p", span=schedule.stream.span)
    assert "E-DMA-INFLIGHT" in _codes(schedule, tb)
