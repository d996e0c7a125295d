"""`expect vmem|hbm headroom at least N`: holds at exactly the headroom the capacity model
measures and fails one KiB (or GiB) above it."""
from __future__ import annotations

import re

import pytest

from mkc.checks import vmem_budget
from mkc.checks.capacity import Kernel, kernels, vmem_budget_bytes
from mkc.checks.expect import hbm_headroom, vmem_headroom
from mkc.compiler import check_source, check_spec
from mkc.diagnostics import MkcError
from tests_support import SPEC


@pytest.fixture(scope="module")
def checked():
    return check_spec(str(SPEC))


def _with(line: str) -> str:
    text = re.sub(r"^  expect .*\n", "", SPEC.read_text(), flags=re.M)
    return re.sub(r"^(  vmem .*\n)", rf"\1  {line}\n", text, count=1, flags=re.M)


def _errors(text: str) -> list:
    try:
        check_source(text, "t.sched")
    except MkcError as e:
        return e.diagnostics
    return []


def test_vmem_headroom_is_the_budget_less_the_peak_in_every_kernel_the_verdict_judges(checked):
    """The kernels the VMEM verdict judges, the verify step of 8 rows (no wider than the
    largest batch, so no row count names it) among them."""
    s, events = checked.ir, checked.events
    left = vmem_headroom(s, events)
    assert list(left) == kernels(s)
    assert Kernel(8, 1, verify=True) in left and s.batch_max == 8
    for k, h in left.items():
        assert h == vmem_budget_bytes(s) - vmem_budget(s, events, k)[0]


def test_vmem_expectation_holds_at_the_headroom_and_fails_above_it(checked):
    least_kib = min(vmem_headroom(checked.ir, checked.events).values()) // 1024
    assert _errors(_with(f"expect vmem headroom at least {least_kib} KiB")) == []
    line = f"expect vmem headroom at least {least_kib + 1} KiB"
    text = _with(line)
    [d] = _errors(text)
    assert d.code == "E-EXPECT" and "VMEM" in d.message
    assert d.span.line == text.splitlines().index(f"  {line}") + 1
    least = min(vmem_headroom(checked.ir, checked.events).items(), key=lambda kv: kv[1])[0]
    assert d.message.startswith(f"the {least} leaves ")
    assert "verify step, 8 rows (1 sequence of 8) " in d.notes[0]


def test_hbm_expectation_holds_at_the_headroom_and_fails_above_it(checked):
    left_gib = hbm_headroom(checked.ir) // 2**30
    assert left_gib > 0
    assert _errors(_with(f"expect hbm headroom at least {left_gib} GiB")) == []
    [d] = _errors(_with(f"expect hbm headroom at least {left_gib + 1} GiB"))
    assert d.code == "E-EXPECT" and "HBM" in d.message
