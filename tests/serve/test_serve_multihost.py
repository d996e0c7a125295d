"""`mkc serve` on two jax.distributed processes of this machine (mkc.serve.multihost): process
0 serves HTTP and sends each launch to process 1, which runs it too; process 0 confirms they
stay in step.

The slow tier runs the real command line, jax.distributed, launch descriptors, confirmations,
HTTP and signals with the serving tests' stand-in module in place of the kernel
(multihost_fake_worker.py): seconds a run. The extended tier runs the MINI Qwen kernel in
interpret mode on each process. On CPU each process runs its own replica of the kernel on its
own virtual devices: interpret mode cannot run one kernel across processes, so one SPMD launch
over a mesh spanning processes (what a TPU slice runs) is not exercised here."""
from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from mkc.serve.device import Codec, Kind, Launch
from mkc.serve.launch import free_port, healthy
from mkc.serve.sampling import SamplingParams, row_arrays

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"


# ---- the descriptor (quick tier) ---------------------------------------------------------
def _same(a: Launch, b: Launch) -> bool:
    arrays = ("tokens", "positions", "rows", "counts")
    return (a.kind == b.kind and a.width == b.width and a.sample == b.sample
            and all(np.array_equal(getattr(a, f), getattr(b, f)) and np.shape(getattr(a, f)) ==
                    np.shape(getattr(b, f)) for f in arrays)
            and len(a.sampling) == len(b.sampling)
            and all(x.dtype == y.dtype and x.tobytes() == y.tobytes()
                    for x, y in zip(a.sampling, b.sampling)))


def test_every_launch_survives_its_fixed_shape_descriptor():
    B, R = 4, 8
    codec = Codec(B, R)
    params = [SamplingParams(3, temperature=0.7, top_k=5, top_p=0.9, seed=2**31 - 1), None,
              SamplingParams(1, temperature=0.0), SamplingParams(2, temperature=1e-7, seed=5)]
    rng = np.random.default_rng(0)
    launches = [
        Launch(Kind.DECODE, rng.integers(0, 2048, B).astype(np.int32), np.arange(B, dtype=np.int32),
               sampling=row_arrays(params, [0, 1, 2, 3]), width=5),
        Launch(Kind.PREFILL, rng.integers(0, 2048, (1, R)).astype(np.int32), np.array([16], np.int32),
               np.array([3], np.int32), np.array([5], np.int32), sampling=row_arrays(params[:1], [0]),
               width=None, sample=True),
        Launch(Kind.SPECULATE, rng.integers(0, 2048, (B, R)).astype(np.int32), np.arange(B, dtype=np.int32),
               np.arange(B, dtype=np.int32), np.array([7, 0, 3, 1], np.int32), width=20),
        Launch(Kind.CLEAR, rows=np.array([0, 1, 1, 0], np.int32)),
        Launch(Kind.RESET), Launch(Kind.SYNC), Launch(Kind.STOP),
    ]
    for launch in launches:
        words = codec.encode(launch)
        assert words.shape == (codec.size,) and words.dtype == np.int32
        assert _same(codec.decode(words), launch), launch.kind
    # floats travel as their bits: a temperature of 1e-7 stays 1e-7
    assert codec.decode(codec.encode(launches[0])).sampling[0][3] == np.float32(1e-7)
    with pytest.raises(ValueError, match="descriptor holds"):
        Codec(1, 2).encode(launches[2])
    # the largest launch at batch 1: a prefill chunk scoring the prompt (the token after it in
    # `counts`) that also samples the first token
    scored = Launch(Kind.PREFILL, np.array([[4, 5]], np.int32), np.array([3], np.int32),
                    np.array([0], np.int32), np.array([2, 9], np.int32),
                    sampling=row_arrays(params[:1], [0]), width=5, sample=True)
    assert _same(Codec(1, 2).decode(Codec(1, 2).encode(scored)), scored)
    with pytest.raises(ValueError, match="expected"):
        codec.decode(np.zeros(codec.size + 1, np.int32))


# ---- the engine's launches, replayed (quick tier) ---------------------------------------
class Recording:
    """A Lockstep that runs each launch here and keeps its descriptor, as process 0 sends it."""

    processes = 2

    def __init__(self, fail_at: int | None = None):
        self.sent: list[np.ndarray] = []
        self.results: list[bytes] = []
        self.fail_at = fail_at

    def run(self, device, launch):
        from mkc.serve.device import result_bytes
        from mkc.serve.engine import LockstepFailure
        self.sent.append(device.codec.encode(launch))
        if self.fail_at is not None and len(self.sent) > self.fail_at:
            raise LockstepFailure("process 1 did not confirm launch 9")
        result = device.run(launch)
        self.results.append(result_bytes(result))
        return result

    def sync_due(self) -> float:
        return 3600.0

    def stop(self, device) -> None:
        self.run(device, Launch(Kind.STOP))


def test_another_device_running_the_sent_descriptors_computes_the_same():
    # what a follower does: decode each descriptor and run it on its own Device; its results
    # and final state equal process 0's, through prefill, speculative and decode launches
    from serve_fakes import fake_greedy, fake_mesh, fake_module
    from test_serve_engine import generate, run

    from mkc.serve.device import Device, result_bytes
    from mkc.serve.engine import Engine
    lockstep = Recording()
    engine = Engine(fake_module(), {}, fake_mesh(), 2, None, prefill="verify", drafter=fake_greedy,
                    lockstep=lockstep)
    engine.warm_up()
    prompts = [([3, 5, 7], 6), ([11], 5), ([2, 2], 4)]
    out = run(engine, *(generate(engine, p, n, delay=0.01 * i) for i, (p, n) in enumerate(prompts)),
              generate(engine, [9], 4, temperature=1.5, seed=3, delay=0.05))
    for (prompt, n), (req, _) in zip(prompts, out):
        assert req.generated == fake_greedy(prompt, n)
    kinds = [Kind(int(w[0])) for w in lockstep.sent]
    assert {Kind.DECODE, Kind.PREFILL, Kind.SPECULATE, Kind.CLEAR, Kind.RESET, Kind.SYNC} <= set(kinds)
    assert kinds[-1] == Kind.STOP
    follower = Device(fake_module(), {}, fake_mesh(), 2)
    replayed = [result_bytes(follower.run(follower.codec.decode(w))) for w in lockstep.sent]
    assert replayed == lockstep.results
    for name, a in engine.device.state.items():
        np.testing.assert_array_equal(np.asarray(follower.state[name]), np.asarray(a))


def test_a_lockstep_failure_stops_the_engine_for_good():
    import asyncio

    from serve_fakes import fake_mesh, fake_module
    from test_serve_engine import generate, run

    from mkc.serve.engine import Engine, Request, Stopped
    from mkc.serve.sampling import SamplingParams
    told = []
    engine = Engine(fake_module(), {}, fake_mesh(), 1, None, prefill="decode",
                    lockstep=Recording(fail_at=3), on_failure=told.append)
    (first, why), (second, why2) = run(engine, generate(engine, [1, 2], 10),
                                       generate(engine, [3], 2, delay=0.01))
    assert why == why2 == "error" and first.row == 0 and second.row is None
    assert told == ["process 1 did not confirm launch 9"] and engine.failure == told[0]
    with pytest.raises(Stopped, match="did not confirm"):
        engine.submit(Request(prompt=[1], sampling=SamplingParams(1), loop=asyncio.new_event_loop()))


# ---- two processes -----------------------------------------------------------------------
class Process:
    def __init__(self, argv: list[str]):
        self.log = tempfile.TemporaryFile(mode="w+")
        env = {"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT)

    def output(self) -> str:
        if self.log.closed:
            return self.text
        self.log.seek(0)
        return self.log.read()

    def wait(self, seconds: float) -> int:
        try:
            return self.proc.wait(seconds)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running after {seconds:.0f} s:\n{self.output()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.text = self.output()
        self.log.close()


@contextlib.contextmanager
def two_processes(command: list[str], leader: list[str] = (), follower: list[str] = (), *,
                  ready: bool = True, startup: float = 600) -> Iterator[tuple[str, Process, Process]]:
    """`command` (a `mkc serve SPEC --model ...` line) as processes 0 and 1 of a jax.distributed
    run on this machine, each with its own extra arguments; (process 0's URL, the two) once
    /health answers (or at once, `ready=False`). Both are killed when the block ends."""
    port, http = free_port(), free_port()
    joined = ["--coordinator", f"127.0.0.1:{port}", "--num-processes", "2"]
    procs = [Process([*command, *joined, "--process-id", "0", "--port", str(http), *leader]),
             Process([*command, *joined, "--process-id", "1", *follower])]
    url = f"http://127.0.0.1:{http}"
    try:
        deadline = time.monotonic() + startup
        while ready and not healthy(url):
            for i, p in enumerate(procs):
                if p.proc.poll() is not None:
                    pytest.fail(f"process {i} exited with {p.proc.returncode}:\n{p.output()[-3000:]}")
            assert time.monotonic() < deadline, procs[0].output()[-3000:]
            time.sleep(0.5)
        yield url, procs[0], procs[1]
    finally:
        for p in procs:
            p.stop()


FAKE = [sys.executable, str(HERE / "multihost_fake_worker.py"), str(SPEC), "--model", "fake_mini"]


def _client(url: str):
    import openai
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.mark.slow
def test_two_processes_serve_in_step_and_stop_together_on_sigterm():
    from serve_fakes import fake_greedy
    from serve_process import token_ids
    import httpx
    with two_processes(FAKE, ["--batch", "2", "--speculative", "prompt-lookup", "--lockstep-every", "2"]
                       ) as (url, leader, follower):
        client = _client(url)
        # three requests on two rows (one reusing a freed row), through prefill launches,
        # speculative verify launches and decode steps, every one run by process 1 too
        import concurrent.futures
        prompts = [([3, 5, 7], 6), ([11], 5), ([2, 2], 4)]

        def complete(i):
            time.sleep(0.2 * i)
            prompt, n = prompts[i]
            return client.completions.create(model="fake_mini", prompt=prompt, max_tokens=n, temperature=0)
        with concurrent.futures.ThreadPoolExecutor(3) as pool:
            results = list(pool.map(complete, range(3)))
        for (prompt, n), r in zip(prompts, results):
            assert token_ids(r.choices[0]) == fake_greedy(prompt, n), prompt
        sampled = client.completions.create(model="fake_mini", prompt=[9], max_tokens=4, temperature=1.5,
                                            seed=7, logprobs=2)
        assert len(token_ids(sampled.choices[0])) == 4
        # a stream closed after its first token frees its row
        stream = client.completions.create(model="fake_mini", prompt=[4, 1], max_tokens=20,
                                           temperature=0.5, seed=1, stream=True)
        assert token_ids(next(iter(stream)).choices[0])
        stream.close()
        assert token_ids(client.completions.create(model="fake_mini", prompt=[6], max_tokens=3,
                                                   temperature=0).choices[0]) == fake_greedy([6], 3)
        stats = httpx.get(url + "/stats").json()
        assert stats["processes"] == 2 and stats["verify_launches"] > 0 and stats["prefill_launches"] > 0
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.wait(60) == 0, leader.output()[-3000:]
        assert follower.wait(30) == 0, follower.output()[-3000:]
    assert "Traceback" not in leader.output() + follower.output()
    assert "process 1 of 2: stopped by process 0 after" in follower.output()


@pytest.mark.slow
def test_a_follower_that_dies_stops_the_leader_loudly():
    with two_processes(FAKE, ["--batch", "1", "--lockstep-timeout", "3", "--lockstep-every", "4"],
                       ["--batch", "1"]) as (url, leader, follower):
        client = _client(url)
        stream = client.completions.create(model="fake_mini", prompt=[1, 2], max_tokens=28,
                                           temperature=0, stream=True)
        chunks = iter(stream)
        next(chunks)
        follower.proc.kill()
        t0 = time.monotonic()
        import openai
        with pytest.raises(openai.APIError, match="process 1 did not confirm launch"):
            for _ in chunks:
                pass
        assert leader.wait(60) == 1
        assert time.monotonic() - t0 < 30
    out = leader.output()
    assert "mkc serve: stopped serving: process 1 did not confirm launch" in out
    assert "within 3 s: it died, hangs or runs far behind" in out


@pytest.mark.slow
def test_processes_out_of_step_or_started_otherwise_refuse():
    # process 1's stand-in gives other tokens: the first confirmation (end of warm-up) fails
    with two_processes(FAKE, follower=["--skew"], ready=False) as (_, leader, follower):
        assert leader.wait(120) == 1 and follower.wait(60) == 1
    assert "error[E-SERVE]: warming up: process 1 is out of step at launch" in leader.output()
    assert "process 1 of 2: stopped: process 0 failed after" in follower.output()
    # process 1 started with another batch: refused before any launch
    with two_processes(FAKE, ["--batch", "2"], ["--batch", "1"], ready=False) as (_, leader, follower):
        assert leader.wait(120) == 1 and follower.wait(60) == 1
    assert ("error[E-SERVE]: process 1: started with other settings than process 0: batch 1 here, "
            "2 on process 0") in leader.output()
    assert "Traceback" not in leader.output() + follower.output()


@pytest.mark.extended
def test_the_mini_kernel_served_from_two_processes_equals_greedy_decoding():
    """The MINI Qwen module in interpret mode on each process (a replica each), process 0
    serving: greedy completions equal the reference's token for token (as one process's do,
    tests/serve/test_serve_server.py), a cancelled stream frees its row, SIGINT stops both."""
    from mkc.numerics import pin_cpu_isa
    pin_cpu_isa()
    from serve_process import reference_greedy, token_ids
    greedy = reference_greedy()
    command = [sys.executable, "-m", "mkc", "serve", str(SPEC), "--model", "qwen3_8_mini"]
    with two_processes(command, ["--batch", "2", "--lockstep-every", "4"], ["--batch", "2"]
                       ) as (url, leader, follower):
        client = _client(url)
        import concurrent.futures
        prompts = [([5, 17, 99], 3), ([1000], 3)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda p: client.completions.create(
                model="qwen3_8_mini", prompt=p[0], max_tokens=p[1], temperature=0), prompts))
        for (prompt, n), r in zip(prompts, results):
            assert token_ids(r.choices[0]) == greedy(prompt, n)[0], prompt
        stream = client.completions.create(model="qwen3_8_mini", prompt=[3, 4], max_tokens=40,
                                           temperature=0.8, seed=3, stream=True)
        assert token_ids(next(iter(stream)).choices[0])
        stream.close()
        r = client.completions.create(model="qwen3_8_mini", prompt=[42], max_tokens=2, temperature=0)
        assert token_ids(r.choices[0]) == greedy([42], 2)[0]
        leader.proc.send_signal(signal.SIGINT)
        assert leader.wait(120) == 0, leader.output()[-3000:]
        assert follower.wait(60) == 0, follower.output()[-3000:]
    assert "each process runs its own replica of the kernel" in follower.output()
