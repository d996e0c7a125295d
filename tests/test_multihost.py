"""The generated host wrapper under jax.distributed: two processes on this machine stand in for
two hosts (the MINI K3 schedule on tpu7x 2x2x2). Each builds the same rank-ordered mesh, packs
and places only its own 8 ranks, and lowers the decode step over the global mesh. Running the
kernel across processes needs TPUs: interpret mode simulates remote DMAs within one process."""
import socket
import subprocess
import sys

import pytest

from tests_support import ROOT


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_place_their_own_ranks_and_lower_the_step():
    port = _free_port()
    procs = [subprocess.Popen([sys.executable, "tests/multihost_worker.py", str(i), str(port)],
                              cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for i, (p, (out, err)) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, err[-3000:]
        assert f"process {i}: ranks {8 * i}..{8 * i + 7} placed, decode step lowered" in out
