import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from mkc.files import process_folder

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"

# Compiled measures of unshipped kernels go to a cache of this test session's own, so what a
# test prices does not depend on what the machine's user cache holds.
os.environ["MKC_BUNDLE_CACHE"] = str(process_folder("mkc-bundles-"))
# Op measures likewise; and no op is compiled alone unless a test asks (MKC_OP_COMPILE=1): an
# unshipped op is then counted, so a test's price does not wait on libtpu.
os.environ["MKC_OP_CACHE"] = str(process_folder("mkc-ops-"))
os.environ.setdefault("MKC_OP_COMPILE", "0")


def pytest_configure(config: pytest.Config) -> None:
    """The xdist controller names the run itself, so it knows the session folder its workers
    share (`tests_support.session_dir`) and removes it at the end."""
    if not hasattr(config, "workerinput") and hasattr(config.option, "testrunuid") \
            and config.option.testrunuid is None:
        config.option.testrunuid = uuid.uuid4().hex


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests_support import session_dir
    uid = getattr(config.option, "testrunuid", None)
    if uid and not hasattr(config, "workerinput"):
        shutil.rmtree(session_dir(uid), ignore_errors=True)


def run_python(args: list[str], timeout: float, python: str = sys.executable,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run a Python script in a fresh interpreter (own XLA device count, own libtpu state), by
    default this environment's, with `env` added to this process's environment."""
    env = dict(os.environ, JAX_PLATFORMS="cpu", ALLOW_MULTIPLE_LIBTPU_LOAD="1", **(env or {}))
    return subprocess.run([python, *args], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture
def spec_text() -> str:
    return SPEC.read_text()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under xdist, each worker's first share of the run begins with its round-robin part of
    the `slow` tests (interpret runs, full-size compiles: a minute or more each), so none is
    left to start last and run alone. The work-stealing scheduler hands out the collection in
    contiguous shares, `len(pending) // workers left` each, and steals from a share's end."""
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    if workers < 2:
        return
    slow = [item for item in items if item.get_closest_marker("slow")]
    fast = [item for item in items if not item.get_closest_marker("slow")]
    ordered: list[pytest.Item] = []
    left = len(items)
    for w in range(workers):
        size = left // (workers - w)
        head = slow[w::workers]
        take = max(0, size - len(head))
        ordered += head + fast[:take]
        fast = fast[take:]
        left -= len(head) + take
    items[:] = ordered + fast
