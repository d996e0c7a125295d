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

Events go back to the request's asyncio loop through `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import numpy as np

from mkc.serve.device import Device, Kind, Launch
from mkc.serve.sampling import Sampled, SamplingParams, logprob_width, row_arrays, row_logprobs

log = logging.getLogger("mkc.serve")


class QueueFull(Exception):
    """Every row is busy and the waiting queue is at its bound."""


class Unfit(ValueError):
    """A request whose settings do not fit what a launch packs them into (an int32 top_k, seed
    or token): refused at `submit`, so that it never fails a step the other rows share.
    `field`: the request field it names."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


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


@dataclass(frozen=True)
class Event:
    """What the engine tells a request: a token (`token` set, with its `logprob` and `top`
    most likely (token, logprob) when the request asked for logprobs; `prompt`: a prompt
    token's, from the second on, when it asked for the prompt's logprobs), or the end
    (`finish_reason`: "stop", "length", or "error" with `error` saying why)."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None
    prompt: bool = False


@dataclass
class Speculation:
    """A request's speculative decoding: draft tokens proposed to verify launches, drafts
    accepted, and the verify launches it took part in."""

    drafted: int = 0
    accepted: int = 0
    launches: int = 0


@dataclass(eq=False)
class Request:
    """One generation: its prompt's token ids, its sampling, and where its events go."""

    prompt: list[int]
    sampling: SamplingParams
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    generated: list[int] = field(default_factory=list)
    fed: int = 0                     # tokens fed to the kernel so far (prompt, then generated)
    row: int | None = None
    cancelled: bool = False
    finished: bool = False
    arrived: float = field(default_factory=time.monotonic)
    speculation: Speculation = field(default_factory=Speculation)

    def emit(self, event: Event) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, event)


@dataclass
class EngineStats:
    steps: int = 0
    step_seconds: float = 0.0
    busy_row_steps: int = 0
    requests_done: int = 0
    prefill_launches: int = 0          # verify-step launches of prefill (--prefill verify)
    prefill_seconds: float = 0.0
    verify_launches: int = 0           # speculative decoding's launches (--speculative)
    verify_seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0


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
                 prefill: str = "auto", drafter: Callable[[list[int], int], list[int]] | None = None,
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
        self.stats = EngineStats()
        self.device = Device(gen, weights, mesh, batch, interpret, steps)
        self.backend: str = self.device.backend
        self.lockstep, self.on_failure = lockstep, on_failure
        self.failure: str | None = None
        # a module's verify step the backend cannot run (--backend emulation)
        unrun = not self.device.verify_rows and bool(getattr(gen, "VERIFY_ROWS", 0))
        if prefill == "auto":
            prefill = "verify" if not unrun and _verifies_one_sequence(gen) else "decode"
        if unrun and (prefill == "verify" or drafter is not None):
            what = "--prefill verify" if prefill == "verify" else "speculative decoding"
            raise ValueError(f"{what} runs the spec's verify step, which the {self.backend} "
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
        self.prefill, self.drafter, self.prefiller = prefill, drafter, prefiller
        if prefill == "verify" or drafter is not None:
            self.verify_rows: int = gen.VERIFY_ROWS
            self.verify_sequences: tuple[int, int] = tuple(gen.VERIFY_SEQUENCES)
        self._rows: list[Request | None] = [None] * batch
        self._waiting: deque[Request] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the request side (any thread) ---------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request for the next free row; Unfit when its settings or tokens do not fit
        a launch, QueueFull past B busy rows and `max_queue` waiting ones."""
        check_fits(request.sampling)
        if not all(0 <= t < self.vocab for t in request.prompt):
            raise Unfit(f"the prompt has token ids outside the vocabulary (0 to {self.vocab - 1})",
                        "prompt")
        with self._wake:
            if self.failure is not None:
                raise Stopped(self.failure)
            free = self._free_rows()
            if len(self._waiting) >= self.max_queue + free:
                busy = ("all" if free == 0 else f"{self.batch - free} of") + f" {self.batch} rows are busy"
                raise QueueFull(f"{busy} and {len(self._waiting)} requests wait for a row (the "
                                f"queue holds {self.max_queue})")
            self._waiting.append(request)
            self._wake.notify()

    def cancel(self, request: Request) -> None:
        """Stop a request: its row is freed before the next step."""
        with self._wake:
            request.cancelled = True
            self._wake.notify()

    def busy_rows(self) -> int:
        with self._wake:
            return self.batch - self._free_rows()

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
        self._run_step()
        R = self.verify_rows if self.prefill == "verify" or self.drafter else 0
        if self.prefill == "verify":
            self._launch(self._prefill_launch(0, [0], 0))
        if self.prefill == "reference":
            self.prefiller([0])                 # compiles the reference's step
        if self.drafter is not None:
            for S in {self._speculative_sequences(n) for n in range(1, self.batch + 1)} - {None}:
                if S not in self.device.verifiers:
                    self._launch(Launch(Kind.SPECULATE, np.zeros((S, R), np.int32), np.zeros(S, np.int32),
                                        np.arange(S, dtype=np.int32), np.zeros(S, np.int32)))
        if R:
            self._launch(Launch(Kind.RESET))
        if self.lockstep is not None:
            self._launch(Launch(Kind.SYNC))
        return time.perf_counter() - t0

    # ---- the engine thread ---------------------------------------------------------------
    def _free_rows(self) -> int:
        return sum(r is None for r in self._rows)

    def _launch(self, launch: Launch) -> Any:
        """Run a launch here (and, with other processes, on every one of them)."""
        if self.lockstep is None:
            return self.device.run(launch)
        return self.lockstep.run(self.device, launch)

    def _admit(self) -> list[int]:
        """Under the lock: free the rows of cancelled requests, drop cancelled waiters, give
        free rows to waiters in arrival order; the rows taken over."""
        for b, req in enumerate(self._rows):
            if req is not None and req.cancelled:
                self._finish(req, Event(finish_reason="cancelled"))
        self._waiting = deque(r for r in self._waiting if not r.cancelled)
        taken = []
        for b in range(self.batch):
            if self._rows[b] is None and self._waiting:
                req = self._waiting.popleft()
                req.row = b
                self._rows[b] = req
                taken.append(b)
                if _scored(req):            # nothing to compute (a one-token prompt's logprobs)
                    self._finish(req, Event(finish_reason="length"))
        return taken

    def _finish(self, req: Request, event: Event) -> None:
        req.finished = True
        if req.row is not None and self._rows[req.row] is req:
            self._rows[req.row] = None
        self.stats.requests_done += 1
        req.emit(event)

    def _run(self) -> None:
        while True:
            sync = False
            with self._wake:
                while not self._stopping and not self._waiting and all(r is None for r in self._rows):
                    # idle: with other processes, confirm now and then that they are in step
                    due = self.lockstep.sync_due() if self.lockstep is not None else None
                    if due is not None and due <= 0:
                        sync = True
                        break
                    self._wake.wait(due)
                if self._stopping:
                    return
                if not sync:
                    taken = self._admit()
                    if all(r is None for r in self._rows):
                        continue
            try:
                if sync:
                    self._launch(Launch(Kind.SYNC))
                    continue
                if taken:
                    mask = np.zeros(self.batch, np.int32)
                    mask[taken] = 1
                    self._launch(Launch(Kind.CLEAR, rows=mask))
                fresh = [r for r in map(self._rows.__getitem__, taken) if r is not None]
                if self.prefill == "verify":
                    for req in fresh:
                        self._prefill_verify(req)
                elif self.prefill == "reference":
                    # a request for its prompt's logprobs is prefilled by decode steps, whose
                    # logits at each prompt position give them (the reference's are not kept)
                    for req in fresh:
                        if not req.sampling.prompt_logprobs:
                            self._prefill_reference(req)
                if any(r is not None for r in self._rows):
                    drafts = self._drafts()
                    if drafts is not None:
                        self._run_speculative(drafts)
                    else:
                        self._run_step()
            except Exception as e:          # noqa: BLE001 - every request must hear of it
                if not isinstance(e, LockstepFailure):
                    log.exception("decode step failed")
                    with self._wake:
                        for req in self._rows:
                            if req is not None:
                                self._finish(req, Event(finish_reason="error",
                                                        error=f"decode step failed: {e}"))
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
            for req in [r for r in self._rows if r is not None] + list(self._waiting):
                self._finish(req, Event(finish_reason="error", error=f"the server stopped: {message}"))
            self._waiting.clear()
        if self.on_failure is not None:
            self.on_failure(message)

    def _run_step(self) -> None:
        """One decode step over all rows, then one on-device sample of every row (and one
        transfer of the tokens, with logprobs where a row asked for them)."""
        rows = list(self._rows)
        tokens = np.zeros(self.batch, np.int32)
        positions = np.zeros(self.batch, np.int32)
        forced = [-1] * self.batch            # the next prompt token, where its logprob is asked
        for b, req in enumerate(rows):
            if req is None:
                continue
            history = req.prompt + req.generated
            tokens[b], positions[b] = history[req.fed], req.fed
            if req.sampling.prompt_logprobs and req.fed + 1 < len(req.prompt):
                forced[b] = req.prompt[req.fed + 1]
        params = [req.sampling if req is not None else None for req in rows]
        sampling = row_arrays(params, [len(req.generated) if req is not None else 0 for req in rows],
                              forced)
        t0 = time.perf_counter()
        sampled = self._launch(Launch(Kind.DECODE, tokens, positions, sampling=sampling,
                                      width=logprob_width(params)))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self.stats.busy_row_steps += sum(req is not None for req in rows)
        with self._wake:
            for b, req in enumerate(rows):
                if req is None or req.finished:
                    continue
                req.fed += 1
                if req.fed >= len(req.prompt):
                    self._accept(req, sampled, b)
                else:               # still prefilling: the output is a prompt token's logprob
                    if forced[b] >= 0:
                        logprob, top = row_logprobs(sampled, b, req.sampling)
                        req.emit(Event(token=forced[b], logprob=logprob, top=top, prompt=True))
                    if _scored(req):
                        self._finish(req, Event(finish_reason="length"))

    def _accept(self, req: Request, sampled: Sampled, row: int) -> None:
        """Under the lock: a request's next token (row `row` of `sampled`, on the host), and
        its end if that was its last."""
        token = int(sampled.tokens[row])
        logprob, top = row_logprobs(sampled, row, req.sampling)
        req.generated.append(token)
        req.emit(Event(token=token, logprob=logprob, top=top))
        if token in req.sampling.stop_token_ids:
            self._finish(req, Event(finish_reason="stop"))
        elif (len(req.generated) >= req.sampling.max_tokens
              or len(req.prompt) + len(req.generated) > self.context):
            self._finish(req, Event(finish_reason="length"))

    # ---- verify launches: prefill and speculative decoding --------------------------------
    def _prefill_launch(self, row: int, chunk: list[int], start: int,
                        sampling: SamplingParams | None = None, sample: bool = True,
                        after: int | None = None) -> Launch:
        """A verify launch of `chunk` (up to R prompt tokens at positions start...) on row
        `row` alone, all committed; with `sampling` and `sample`, the first token sampled from
        the last chunk token's logits; with `after` (the prompt token after the chunk, or -1),
        each chunk token's logits score the token after it (the prompt's logprobs)."""
        R = self.verify_rows
        tokens = np.array([chunk + [chunk[-1]] * (R - len(chunk))], np.int32)
        counts = [len(chunk)] if after is None else [len(chunk), after]
        return Launch(Kind.PREFILL, tokens, np.array([start], np.int32), np.array([row], np.int32),
                      np.array(counts, np.int32),
                      sampling=row_arrays([sampling], [0]) if sampling is not None and sample else (),
                      width=logprob_width([sampling]) if sampling is not None else None,
                      sample=sampling is not None and sample)

    def _prefill_verify(self, req: Request) -> None:
        """A newly admitted request's prompt through the verify step, R tokens a launch (the
        tail that would pass the context, if any, is left to decode steps); its first token
        sampled from the last prompt token's logits."""
        t0 = time.perf_counter()
        scored = req.sampling.prompt_logprobs
        while (len(req.prompt) - req.fed > 0 and req.fed + self.verify_rows <= self.context
               and not req.finished):
            start = req.fed
            chunk = req.prompt[start:start + self.verify_rows]
            end = start + len(chunk)
            last = end == len(req.prompt)
            after = (req.prompt[end] if not last else -1) if scored else None
            result = self._launch(self._prefill_launch(
                req.row, chunk, start, req.sampling if last or scored else None,
                sample=last and req.sampling.max_tokens > 0, after=after))
            sampled, prompt = result if scored else (result, None)
            req.fed = end
            self.stats.prefill_launches += 1
            with self._wake:
                for j in range(len(chunk) if prompt is not None else 0):
                    if start + j + 1 < len(req.prompt):       # a prompt token's logprob
                        logprob, top = row_logprobs(prompt, j, req.sampling)
                        req.emit(Event(token=req.prompt[start + j + 1], logprob=logprob, top=top,
                                       prompt=True))
                if _scored(req) and not req.finished:
                    self._finish(req, Event(finish_reason="length"))
                if sampled is not None and not req.finished:
                    self._accept(req, sampled, 0)
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _prefill_reference(self, req: Request) -> None:
        """A newly admitted request's prompt but its last token through the family reference
        (`prefiller`), its state written into the request's row; the next decode step feeds
        the last token and gives the first."""
        if len(req.prompt) < 2:
            return
        t0 = time.perf_counter()
        try:
            state = self.prefiller(req.prompt[:-1])
        except Exception as e:          # noqa: BLE001 - its own prompt's: it fails alone
            self._fail_request(req, "the reference's prefill", e)
            return
        self.device.put_row_state(req.row, state)
        req.fed = len(req.prompt) - 1
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _speculative_sequences(self, busy: int) -> int | None:
        """The sequences of a verify launch for `busy` rows: the whole batch when the verify
        step takes B sequences, else the busy rows alone, or None when it takes neither."""
        low, high = self.verify_sequences
        if low <= self.batch <= high:
            return self.batch
        return busy if low <= busy <= high else None

    def _drafts(self) -> dict[int, list[int]] | None:
        """Speculative decoding's drafts for the next launch, by row, or None for a decode step:
        when there is no drafter, a busy row samples (temperature > 0), is still prefilling or
        is too near the context's end for R rows, the busy rows do not fit one verify launch,
        or no row has a draft."""
        if self.drafter is None:
            return None
        busy = [(b, req) for b, req in enumerate(self._rows) if req is not None]
        if self._speculative_sequences(len(busy)) is None:
            return None
        R = self.verify_rows
        drafts = {}
        for b, req in busy:
            history = req.prompt + req.generated
            if (req.sampling.temperature > 0 or not req.generated or req.fed != len(history) - 1
                    or req.fed + R > self.context):
                return None
            try:
                drafts[b] = list(self.drafter(history, R - 1))[:R - 1]
            except Exception as e:      # noqa: BLE001 - its own history's: it fails alone
                self._fail_request(req, "drafting", e)
                return None             # the other rows take a decode step
        return drafts if any(drafts.values()) else None

    def _fail_request(self, req: Request, stage: str, error: Exception) -> None:
        """End one request with an error from work on its own tokens (not a launch the rows
        share): its row is freed, the other rows go on."""
        log.exception("%s failed for one request", stage)
        with self._wake:
            self._finish(req, Event(finish_reason="error", error=f"{stage} failed: {error}"))

    def _run_speculative(self, drafts: dict[int, list[int]]) -> None:
        """One verify launch over the busy rows (every one greedy), each row's anchor (its last
        token) and drafts; each keeps the drafts its own greedy choices match and the choice
        after them (one transfer of the launch's choices and logprobs)."""
        R = self.verify_rows
        rows = list(range(self.batch)) if self._speculative_sequences(len(drafts)) == self.batch \
            else sorted(drafts)
        S = len(rows)
        tokens = np.zeros((S, R), np.int32)           # an idle row: token 0 at position 0
        starts = np.zeros(S, np.int32)
        reqs = [self._rows[b] for b in rows]
        for i, (b, req) in enumerate(zip(rows, reqs)):
            if req is not None:
                row = [req.generated[-1]] + drafts[b]
                tokens[i] = row + [row[-1]] * (R - len(row))
                starts[i] = req.fed
        width = logprob_width([req.sampling if req is not None else None for req in reqs])
        t0 = time.perf_counter()
        sampled, counts = self._launch(Launch(
            Kind.SPECULATE, tokens, starts, np.asarray(rows, np.int32),
            np.array([len(drafts.get(b, [])) for b in rows], np.int32), width=width))
        self.stats.verify_launches += 1
        self.stats.verify_seconds += time.perf_counter() - t0
        with self._wake:
            for i, (b, req) in enumerate(zip(rows, reqs)):
                if req is None or req.finished:
                    continue
                n = int(counts[i])
                for spec in (req.speculation, self.stats):
                    spec.drafted += len(drafts[b])
                    spec.accepted += n - 1
                req.speculation.launches += 1
                req.fed += n
                for j in range(n):                    # the accepted drafts, then the next token
                    if req.finished:
                        break
                    self._accept(req, sampled, i * R + j)


def check_fits(sampling: SamplingParams) -> None:
    """Raise Unfit, naming the field, when a request's sampling does not pack into a step's
    per-row arrays (`row_arrays`, which every launch that samples uses, at any token count the
    request may reach)."""
    try:
        row_arrays([sampling], [min(sampling.max_tokens, np.iinfo(np.int32).max)])
    except (OverflowError, ValueError, TypeError) as e:
        fields = [name for name, value in (("top_k", sampling.top_k), ("seed", sampling.seed))
                  if not isinstance(value, int) or not -2**31 <= value < 2**31]
        raise Unfit(f"{fields[0] if fields else 'the sampling'} does not fit the sampler's "
                    f"arrays ({e})", fields[0] if fields else None) from None


def _scored(req: Request) -> bool:
    """Whether a request that generates nothing (`max_tokens` 0: at most its prompt's
    logprobs) has all it asked for: every prompt token past the first has its logprob."""
    return req.sampling.max_tokens == 0 and (not req.sampling.prompt_logprobs
                                             or req.fed >= len(req.prompt) - 1)


def _verifies_one_sequence(gen: Any) -> bool:
    return bool(getattr(gen, "VERIFY_ROWS", 0)) and gen.VERIFY_SEQUENCES[0] <= 1
