"""The resolve passes' declarations (`mkc.resolve.driver.Pass`): the list is refused when a pass
reads what no earlier pass writes or a field has a second writer; a run is refused when a pass
changes a field it does not declare or leaves one it declares unset; and what each pass reads,
on every shipped and broken spec (error paths too), is among what it declares."""
import dataclasses
import sys

import pytest

from mkc.diagnostics import MkcError
from mkc.lang.parser import parse_file
from mkc.resolve import driver
from mkc.resolve.driver import PASSES, PassOrderError, checked, run
from mkc.resolve.invariants import ResolveInvariantError
from mkc.resolve.state import ResolveState
from tests_support import ROOT, SPEC

FIELDS = {f.name for f in dataclasses.fields(ResolveState)}


def _with(name: str, **changes) -> tuple[driver.Pass, ...]:
    return tuple(dataclasses.replace(p, **changes) if p.name == name else p for p in PASSES)


def test_every_field_of_the_state_has_one_writer_among_the_passes():
    writers = [f for p in PASSES for f in p.writes]
    assert sorted(writers) == sorted(FIELDS - set(driver.DRIVER_FIELDS))
    assert checked(PASSES) is PASSES


def test_a_pass_placed_before_the_writer_of_what_it_reads_is_refused():
    order = [p.name for p in PASSES]
    i, j = order.index("formats"), order.index("graph")
    swapped = list(PASSES)
    swapped[i], swapped[j] = swapped[j], swapped[i]
    with pytest.raises(PassOrderError) as e:
        checked(tuple(swapped))
    assert str(e.value) == ("resolve pass 'graph' reads formats, which no pass before it writes "
                            "(pass 'formats' writes it, and runs after it)")


def test_a_second_writer_of_a_field_is_refused():
    kv_ring = next(p for p in PASSES if p.name == "kv_ring")
    with pytest.raises(PassOrderError) as e:
        checked(_with("kv_ring", writes=(*kv_ring.writes, "kinds")))
    assert str(e.value) == ("kinds is written by resolve pass 'kv_ring' and by resolve pass "
                            "'kinds': each field of the state has one writer")
    with pytest.raises(PassOrderError, match="sched is written by the driver and by resolve pass 'model'"):
        checked(_with("model", writes=("sched", "model_config", "dims", "family", "checkpoint")))


def test_a_pass_reading_its_own_field_an_unknown_field_or_a_field_nobody_writes_is_refused():
    own = r"'kinds' reads kinds, which no pass before it writes \(it writes it itself\)$"
    with pytest.raises(PassOrderError, match=own):
        checked(_with("kinds", reads=("kinds",)))
    with pytest.raises(PassOrderError, match="'hbm' declares 'kv', which is no field"):
        checked(_with("hbm", reads=("kv",)))
    ir_pass = next(p for p in PASSES if p.name == "ir")
    without_expect = tuple(dataclasses.replace(p, reads=tuple(r for r in p.reads if r != "expectations"))
                           if p is ir_pass else p for p in PASSES if p.name != "expect")
    with pytest.raises(PassOrderError, match="^no resolve pass writes expectations$"):
        checked(without_expect)


def test_a_pass_changing_an_undeclared_field_is_refused_at_run_time(monkeypatch):
    hbm = next(p for p in PASSES if p.name == "hbm")
    monkeypatch.setattr(driver, "PASSES", _with("hbm", run=lambda s: dataclasses.replace(
        hbm.run(s), stream=dataclasses.replace(s.stream))))
    with pytest.raises(ResolveInvariantError) as e:
        run(parse_file(SPEC)[0])
    assert "resolve pass 'hbm' changed stream, which it does not declare" in str(e.value)


def test_a_pass_leaving_a_declared_field_unset_is_refused_at_run_time(monkeypatch):
    monkeypatch.setattr(driver, "PASSES", _with("expect", run=lambda s: s))
    with pytest.raises(ResolveInvariantError, match="'expect' left expectations unset"):
        run(parse_file(SPEC)[0])


_read: set[str] = set()


class _RecordingState(ResolveState):
    """A state that notes each field read outside `dataclasses` (whose `replace` copies all)."""

    def __getattribute__(self, name):
        if name in FIELDS and not sys._getframe(1).f_code.co_filename.endswith("dataclasses.py"):
            _read.add(name)
        return object.__getattribute__(self, name)


SPECS = [*sorted((ROOT / "schedules").glob("*.sched")),
         *sorted((ROOT / "tests" / "broken_specs").glob("*.sched"))]


def test_each_pass_reads_only_what_it_declares_on_every_shipped_and_broken_spec():
    """A broken spec's failing pass reads on its error path too: what a diagnostic names."""
    undeclared: dict[str, set[str]] = {}
    for spec in SPECS:
        try:
            sched, _ = parse_file(spec)
        except MkcError:
            continue
        state = _RecordingState(sched)
        for p in PASSES:
            _read.clear()
            try:
                state = p.run(state)
            except MkcError:
                break
            finally:
                if _read - set(p.reads):
                    undeclared.setdefault(p.name, set()).update(_read - set(p.reads))
    assert undeclared == {}
