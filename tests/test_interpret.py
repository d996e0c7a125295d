"""`mkc.interpret.lean_interpreter`: the runners' lean host side of TPU interpret mode computes
what JAX's own does, byte for byte, and the race detector still fires under it."""
import pytest

from conftest import run_python
from runtime.test_collectives import _run


@pytest.mark.extended
def test_a_multi_device_kernel_gives_the_same_bytes_lean_and_not():
    """The collectives kernel (16 devices: remote DMAs, semaphores, barriers) both ways (its
    other modes run lean in tests/runtime/test_collectives.py)."""
    lean, own = _run("on_wait", lean=True), _run("on_wait", lean=False)
    assert lean["lean"] == ["jax._src.callback.io_callback_impl", "GenericSharedMemory.check_failed"]
    assert own["lean"] == []
    assert all(lean["ok"].values()) and lean["digest"] == own["digest"]
    assert lean["races_found"] is own["races_found"] is False


def test_the_race_detector_flags_a_known_race_under_it():
    r = run_python(["tests/race_detector_canary.py", "lean"], timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "RACES=True" in r.stdout
