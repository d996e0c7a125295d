"""`mkc serve` in a child process, for the tests and the load and eval scripts that drive a real
server: started on a free port, waited for until `/health` answers, stopped (SIGINT, then
kill) when the block ends. Standard library only, so a script running in another environment
(lm-eval's) can start the project's server with the project's Python."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator, Sequence

ROOT = Path(__file__).resolve().parents[2]
STARTUP_SECONDS = 600        # a MINI model compiles its step in interpret mode: minutes on a busy host
READY = re.compile(r"ready at (http://\S+) ")     # `mkc serve`'s line once it serves


class ServerError(RuntimeError):
    """The server exited or did not come up; the message holds the tail of its output."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(url: str) -> bool:
    """Whether an mkc serve at `url` answers /health with 200."""
    try:
        with urllib.request.urlopen(url + "/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def running_server(spec: str | Path, model: str, args: Sequence[str] = (), *,
                   env: dict[str, str] | None = None, python: str = sys.executable,
                   startup_seconds: float = STARTUP_SECONDS) -> Iterator[str]:
    """`mkc serve SPEC --model MODEL *args` on a free port of 127.0.0.1 (`--port 0`: the server
    binds one and names it when ready) until the block ends (`env`: the child's environment,
    default this one's); its URL once /health answers. Raises ServerError when it exits first
    or is not up after `startup_seconds`."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen([python, "-m", "mkc", "serve", str(spec), "--model", model,
                             "--port", "0", *args],
                            cwd=ROOT, env=os.environ if env is None else env,
                            stdout=log, stderr=subprocess.STDOUT)

    def output() -> str:
        log.seek(0)
        return log.read()

    def tail() -> str:
        return output()[-3000:]

    def ready_url() -> str | None:
        m = READY.search(output())
        return m and m[1]
    deadline = time.monotonic() + startup_seconds
    try:
        while not ((url := ready_url()) and healthy(url)):
            if proc.poll() is not None:
                raise ServerError(f"mkc serve exited with status {proc.returncode}:\n{tail()}")
            if time.monotonic() > deadline:
                raise ServerError(f"mkc serve did not answer /health within {startup_seconds:.0f} s:"
                                  f"\n{tail()}")
            time.sleep(1)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
