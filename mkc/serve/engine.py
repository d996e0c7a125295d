"""Continuous batching of independent requests into a generated module's B kernel rows.

One thread owns the device state and runs decode steps while any row is busy. Each in-flight
request holds one row for its whole life; a waiting request takes a free row before the next
step, and a finished or cancelled one gives its row back as soon as the step it was in ends.
Rows sit at their own positions in one step (the kernel takes a position per row); an idle
row computes on token 0 at position 0, and its output is ignored.

Prefill writes a prompt's KV entries and recurrent and conv states with the module's own
kernels, in the layout the decode step reads. `decode` feeds the prompt through
the decode step, one token a step in the request's row, while the other rows keep decoding.
`verify` runs the module's verify step on the row alone, R prompt tokens a launch (its state
taken out of the batch's, the accepted rows committed and put back), before the next decode
step: a launch per R prompt tokens instead of a step per token (each streams every weight
once), while the other rows wait. `reference` runs the prompt but its last token through the
family's reference under `jit` (`prefiller`, mkc.serve.prefill; interpret mode on one process
only), writes its state into the row in the kernel's layout, and leaves the last token to the
next decode step. `auto`, the default, is `verify` where the module has a verify step of one
sequence (docs/serving.md has the measurements). A row taken over by a new
request has its recurrent and conv states zeroed first (its KV entries need no clearing: the
new request rewrites each position before it attends to it, and positions past its own are
masked).

Speculative decoding (a `drafter`, `--speculative prompt-lookup`) replaces a decode step by
one verify launch when every busy row is greedy (temperature 0) and generating (its prompt
fed), has room for R positions before the context's end, and the busy rows fit one launch:
the whole batch when the verify step takes B sequences (`verify R sequences 1 to N`, B <= N:
idle rows compute on token 0 at position 0, as in a decode step), else the busy rows alone,
their states taken out of the batch's and put back. Each row's launch holds its anchor (its
last token, not yet fed) and up to R - 1 drafts; it keeps the drafts that equal its own
greedy choices and the choice after them (`commit`), so its text is plain greedy decoding's.
Otherwise (a sampled or prefilling row, more busy rows than a launch takes, or no row has a
draft) the engine runs a decode step over all rows, greedy ones included.

Every device launch (a decode step, a verify launch, a row reset) is a `Launch` run by
`mkc.serve.device.Device`; under jax.distributed (`lockstep`, mkc.serve.multihost) each is
first sent to the other processes, which run the same launches in the same order, and a
process that falls out of step (or dies) stops the engine: every request gets an error and
`on_failure` is called.

What each iteration launches, and what the results mean for each request, is decided by
`mkc.serve.scheduler.Scheduler`; this module runs its work (each launch on this process, or on
every process in lockstep) and owns the thread, the failure handling and warm-up. Events go back
to the request's asyncio loop through `call_soon_threadsafe`.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Protocol

import numpy as np

from mkc.serve.device import Device, Kind, Launch
from mkc.serve.scheduler import (Drafter, EngineStats, Event, Policy, QueueFull, ReferencePrefill,
                                 Request, Scheduler, Speculation, Unfit, Work, check_fits)

__all__ = ["Engine", "EngineStats", "Event", "Lockstep", "LockstepFailure", "QueueFull", "Request",
           "Speculation", "Stopped", "Unfit", "check_fits"]

log = logging.getLogger("mkc.serve")


class Stopped(Exception):
    """The engine stopped serving (another process fell out of step): no request is taken."""


class LockstepFailure(Exception):
    """Another process did not confirm a launch in time (it died or hangs), or confirmed other
    results: the processes can no longer serve together."""


class Lockstep(Protocol):
    """What the engine needs of multi-process serving (mkc.serve.multihost.Leader): `run` a
    launch here and on every other process; `sync_due`: seconds until an idle engine should
    confirm the processes are in step (a SYNC launch; 0 or less: now); `stop` the other
    processes. Each raises LockstepFailure when the processes are out of step."""

    def run(self, device: Device, launch: Launch) -> Any: ...

    def sync_due(self) -> float: ...

    def stop(self, device: Device) -> None: ...


class Engine:
    """Serves one generated module on `mesh` at B rows.

    `gen`: the generated module; `weights`: its placed weights; `interpret`: None on TPU, or
    Pallas' InterpretParams on CPU; `max_queue`: requests that may wait for a row before
    `submit` refuses more (QueueFull); `prefill`: "decode", "verify", "reference" or "auto"
    (verify where the module has a verify step of one sequence, else decode; module docstring);
    `prefiller`: with "reference", prompt tokens -> the kernel's state of one sequence after
    them (mkc.serve.prefill.ReferencePrefill); `drafter`: None, or speculative decoding's
    drafter, (context, n) -> up to n draft tokens (module docstring); `lockstep`: None on one
    process, else what runs each launch on every process; `on_failure(message)`: called once
    when the engine stops serving because `lockstep` failed; `steps`: the Device's step
    provider (None: the kernel's; mkc.serve.emulation.EmulationSteps, which has no verify
    step, so prompts go through the decode step)."""

    def __init__(self, gen: Any, weights: dict, mesh: Any, batch: int, interpret: Any = None,
                 max_queue: int = 64, eos_token_ids: frozenset[int] = frozenset(),
                 prefill: str = "auto", drafter: Drafter | None = None,
                 prefiller: Callable[[list[int]], dict] | None = None,
                 lockstep: Lockstep | None = None, on_failure: Callable[[str], None] | None = None,
                 steps: Any = None):
        low, high = gen.BATCH_RANGE
        if not low <= batch <= high:
            raise ValueError(f"--batch {batch}: the module is built for batches {low} to {high}")
        self.gen, self.weights, self.mesh, self.batch = gen, weights, mesh, batch
        self.interpret = interpret
        self.context: int = gen.CONTEXT
        self.vocab: int = gen.DIMS.vocab_size
        self.max_queue = max_queue
        self.eos_token_ids = eos_token_ids
        self.device = Device(gen, weights, mesh, batch, interpret, steps)
        self.backend: str = self.device.backend
        self.lockstep, self.on_failure = lockstep, on_failure
        self.failure: str | None = None
        self.prefill = _prefill_policy(gen, self.device, prefill, drafter, prefiller, lockstep)
        self.drafter, self.prefiller = drafter, prefiller
        verifies = self.prefill == "verify" or drafter is not None
        if verifies:
            self.verify_rows: int = gen.VERIFY_ROWS
            self.verify_sequences: tuple[int, int] = tuple(gen.VERIFY_SEQUENCES)
        self._wake = threading.Condition()
        policy = Policy(batch, self.context, self.vocab, max_queue, self.prefill,
                        gen.VERIFY_ROWS if verifies else 0,
                        tuple(gen.VERIFY_SEQUENCES) if verifies else (0, 0))
        self.scheduler = Scheduler(policy, drafter, lock=self._wake)
        self._stopping = False
        self._thread: threading.Thread | None = None

    @property
    def stats(self) -> EngineStats:
        return self.scheduler.stats

    # ---- the request side (any thread) ---------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request for the next free row; Unfit when its settings or tokens do not fit
        a launch, QueueFull past B busy rows and `max_queue` waiting ones, Stopped once the
        engine stopped serving."""
        self.scheduler.check(request)
        with self._wake:
            if self.failure is not None:
                raise Stopped(self.failure)
            self.scheduler.enqueue(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Stop a request: its row is freed before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def busy_rows(self) -> int:
        with self._wake:
            return self.batch - self.scheduler.free_rows()

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="mkc-serve-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the engine's thread (after the launch it is in), then the other processes."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()
        if self.lockstep is not None and self.failure is None:
            try:
                self.lockstep.stop(self.device)
            except LockstepFailure as e:
                self._fail(str(e))

    def warm_up(self) -> float:
        """Compile and run one step on idle rows (so the first request does not wait for the
        compile), and the verify launches prefill and speculation use; with other processes,
        confirm they did the same. Its seconds."""
        t0 = time.perf_counter()
        self._execute(self.scheduler.step())
        R = self.verify_rows if self.prefill == "verify" or self.drafter else 0
        if self.prefill == "verify":
            self._launch(self.scheduler.prefill_launch(0, [0], 0))
        if self.prefill == "reference":
            self.prefiller([0])                 # compiles the reference's step
        if self.drafter is not None:
            sequences = {self.scheduler.speculative_sequences(n) for n in range(1, self.batch + 1)}
            for S in sequences - {None} - set(self.device.verifiers):
                self._launch(Launch(Kind.SPECULATE, np.zeros((S, R), np.int32), np.zeros(S, np.int32),
                                    np.arange(S, dtype=np.int32), np.zeros(S, np.int32)))
        if R:
            self._launch(Launch(Kind.RESET))
        if self.lockstep is not None:
            self._launch(Launch(Kind.SYNC))
        return time.perf_counter() - t0

    # ---- the engine thread ---------------------------------------------------------------
    def _launch(self, launch: Launch) -> Any:
        """Run a launch here (and, with other processes, on every one of them)."""
        if self.lockstep is None:
            return self.device.run(launch)
        return self.lockstep.run(self.device, launch)

    def _execute(self, work: Work) -> None:
        """Run one piece of the scheduler's work and hand it the result."""
        t0 = time.perf_counter()
        if isinstance(work, ReferencePrefill):
            try:
                state = self.prefiller(work.tokens)
            except Exception as e:          # noqa: BLE001 - its own prompt's: it fails alone
                self.scheduler.fail_request(work.request, "the reference's prefill", e)
                return
            self.device.put_row_state(work.request.row, state)
            result = None
        else:
            result = self._launch(work.launch)
        self.scheduler.update(work, result, time.perf_counter() - t0)

    def _next_iteration(self) -> str | None:
        """Wait until there is work (or, idle with other processes, a sync is due), then begin
        an iteration: "stop" (the engine stops), "sync" (a SYNC launch is due) or "run" (the
        scheduler admitted and planned an iteration, which may have nothing to run)."""
        with self._wake:
            while not self._stopping and self.scheduler.idle():
                # idle: with other processes, confirm now and then that they are in step
                due = self.lockstep.sync_due() if self.lockstep is not None else None
                if due is not None and due <= 0:
                    return "stop" if self._stopping else "sync"
                self._wake.wait(due)
            if self._stopping:
                return "stop"
            self.scheduler.admit()
            return "run"

    def _run(self) -> None:
        while (begun := self._next_iteration()) != "stop":
            try:
                if begun == "sync":
                    self._launch(Launch(Kind.SYNC))
                    continue
                while (work := self.scheduler.next()) is not None:
                    self._execute(work)
            except Exception as e:          # noqa: BLE001 - every request must hear of it
                if not isinstance(e, LockstepFailure):
                    log.exception("decode step failed")
                    self.scheduler.abort(f"decode step failed: {e}")
                    try:
                        self._launch(Launch(Kind.RESET))    # the failed step may have consumed it
                        continue
                    except LockstepFailure as lost:
                        e = lost
                self._fail(str(e))
                return

    def _fail(self, message: str) -> None:
        """Stop serving for good (the processes are out of step): every request, running or
        waiting, ends with the error, later ones are refused, and `on_failure` is told."""
        with self._wake:
            self.failure = message
            self._stopping = True
            self.scheduler.fail_all(f"the server stopped: {message}")
        if self.on_failure is not None:
            self.on_failure(message)


def _prefill_policy(gen: Any, device: Device, prefill: str, drafter: Drafter | None,
                    prefiller: Callable | None, lockstep: Lockstep | None) -> str:
    """The prefill policy `prefill` asks for ("auto" resolved), or the ValueError of why the
    module, backend or processes cannot serve it (or speculative decoding)."""
    # a module's verify step the backend cannot run (--backend emulation)
    unrun = not device.verify_rows and bool(getattr(gen, "VERIFY_ROWS", 0))
    if prefill == "auto":
        prefill = "verify" if not unrun and _verifies_one_sequence(gen) else "decode"
    if unrun and (prefill == "verify" or drafter is not None):
        what = "--prefill verify" if prefill == "verify" else "speculative decoding"
        raise ValueError(f"{what} runs the spec's verify step, which the {device.backend} "
                         "backend does not have")
    if prefill == "verify" and not _verifies_one_sequence(gen):
        raise ValueError("--prefill verify needs a verify step of one sequence: add "
                         "`verify R sequences 1 to N` to the spec")
    if prefill not in ("verify", "decode", "reference"):
        raise ValueError(f"prefill {prefill!r}: choose auto, decode, verify or reference")
    if prefill == "reference" and prefiller is None:
        raise ValueError("--prefill reference needs the family reference's prefill "
                         "(mkc.serve.prefill.ReferencePrefill)")
    if prefill == "reference" and lockstep is not None:
        # the state it writes is made on process 0's host: not a launch the others can run
        raise ValueError("--prefill reference runs on one process only")
    if drafter is not None and getattr(gen, "VERIFY_ROWS", 0) < 2:
        raise ValueError("speculative decoding needs a verify step of 2 rows or more: add "
                         "`verify R` to the spec")
    return prefill


def _verifies_one_sequence(gen: Any) -> bool:
    return bool(getattr(gen, "VERIFY_ROWS", 0)) and gen.VERIFY_SEQUENCES[0] <= 1
