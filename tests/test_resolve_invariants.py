"""The resolve state verified between passes (`mkc.resolve.invariants`): every shipped spec
resolves with the verifier on after each pass, and a state a pass corrupts is refused after
that pass, naming it and what broke."""
import dataclasses

import pytest

from mkc.lang.parser import parse_file
from mkc.resolve import driver
from mkc.resolve.driver import PASS_NAMES, PASSES, run
from mkc.resolve.invariants import INVARIANTS, ResolveInvariantError
from tests_support import ROOT, SPEC

SHIPPED = sorted((ROOT / "schedules").glob("*.sched"))


@pytest.mark.parametrize("spec", SHIPPED, ids=lambda p: p.stem)
def test_every_shipped_spec_resolves_with_the_state_verified_after_each_pass(spec, monkeypatch):
    verified = []
    real = driver.verify_state
    monkeypatch.setattr(driver, "verify_state", lambda s, after: (verified.append(after), real(s, after)))
    sched, _ = parse_file(spec)
    assert run(sched).schedule_ir is not None
    assert verified == list(PASS_NAMES)


def test_every_invariant_is_established_by_a_pass_in_order():
    order = [PASS_NAMES.index(inv.established_by) for inv in INVARIANTS]
    assert order == sorted(order)


def _corrupted_after(monkeypatch, name: str, corrupt) -> str:
    """Resolve the Qwen spec with pass `name`'s output corrupted; the verifier's message."""
    passes = tuple(dataclasses.replace(p, run=lambda s, p=p: corrupt(p.run(s))) if p.name == name
                   else p for p in PASSES)
    monkeypatch.setattr(driver, "PASSES", passes)
    sched, _ = parse_file(SPEC)
    with pytest.raises(ResolveInvariantError) as e:
        run(sched)
    return str(e.value)


def _drop_first_ring_entry(s):
    kname = next(k for k, fams in sorted(s.stream.families.items()) if fams)
    families = {**s.stream.families, kname: s.stream.families[kname][1:]}
    return dataclasses.replace(s, stream=dataclasses.replace(s.stream, families=families))


def test_a_matmul_without_its_stream_entry_is_named_after_the_pass_that_dropped_it(monkeypatch):
    message = _corrupted_after(monkeypatch, "stream", _drop_first_ring_entry)
    assert "after resolve pass 'stream'" in message
    assert "every matmul has its stream entry (ring or pool) (established by pass 'stream')" in message
    assert "gdn.in_proj multiplies by in_proj, which has no stream entry (ring or pool)" in message
    assert "a bug in mkc" in message


@pytest.mark.parametrize("after, field", [("phases", "phase_schedules"), ("kinds", "kinds")])
def test_a_step_point_out_of_range_is_refused(monkeypatch, after, field):
    """In a layer kind's schedule as its phase writes it, and as assembled."""
    def late_wait(s):
        schedules = getattr(s, field)
        kname = next(k for k, ks in sorted(schedules.items()) if ks.transfers)
        k = schedules[kname]
        t = dataclasses.replace(k.transfers[0], waits=(len(k.ops) + 3,))
        changed = {**schedules, kname: dataclasses.replace(k, transfers=[t, *k.transfers[1:]])}
        return dataclasses.replace(s, **{field: changed})
    message = _corrupted_after(monkeypatch, after, late_wait)
    assert f"after resolve pass {after!r}" in message and "outside 0.." in message


def test_a_collective_after_an_op_the_kind_lacks_is_refused(monkeypatch):
    def misplaced(s):
        kname = next(k for k, ks in sorted(s.kinds.items()) if ks.allreduces)
        k = s.kinds[kname]
        reduce = dataclasses.replace(k.allreduces[0], after_op="no_such_op")
        kinds = {**s.kinds, kname: dataclasses.replace(k, allreduces=[reduce, *k.allreduces[1:]])}
        return dataclasses.replace(s, kinds=kinds)
    message = _corrupted_after(monkeypatch, "kinds", misplaced)
    assert "after resolve pass 'kinds'" in message and "after no_such_op, which is no op" in message


def test_a_buffer_named_twice_or_missing_is_refused(monkeypatch):
    twice = _corrupted_after(monkeypatch, "buffers", lambda s: dataclasses.replace(
        s, buffers=[*s.buffers, s.buffers[0]]))
    assert "after resolve pass 'buffers'" in twice and "is declared twice" in twice
    missing = _corrupted_after(monkeypatch, "buffers", lambda s: dataclasses.replace(
        s, buffers=[b for b in s.buffers if b.cls != "state"]))
    assert "after resolve pass 'buffers'" in missing and "which is not among the kernel's buffers" in missing
