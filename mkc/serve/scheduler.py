"""What the serving engine launches each iteration, and what the launches' results mean.

The engine's thread runs iterations: `admit` (cancelled requests leave their rows, waiting ones
take the free rows), then `next` until it gives None, running each piece of `Work` it gives and
handing the result back to `update`. An iteration's work, in order: a CLEAR of the rows taken
over (their recurrent and conv states zeroed), the new requests' prefill by the engine's
prefill policy (`verify`: their prompts' chunks, R tokens a launch on the row alone, each
decided after the one before, which may have ended the request; `reference`: the prompt but its
last token through the family reference on the host), then one launch over every busy row: a
speculative verify launch when every busy row can take one and some row has a draft, else a
decode step. Results become each request's tokens, logprobs and end (`stops.token_finish`).

The scheduler holds no thread and runs no device: the launches it makes are `Launch`es
(mkc.serve.device) and the results it takes are host values, so it is tested with plain
arrays. It guards its rows and queue with `lock` (the engine's condition; none by default),
since the HTTP side submits and cancels from other threads. This is where chunked prefill
beside decoding will go: an iteration whose launch mixes prompt chunks and decoding rows.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Union

import numpy as np

from mkc.serve.device import Kind, Launch
from mkc.serve.sampling import Sampled, SamplingParams, logprob_width, row_arrays, row_logprobs
from mkc.serve.stops import token_finish

log = logging.getLogger("mkc.serve")

Drafter = Callable[[list[int], int], list[int]]


class QueueFull(Exception):
    """Every row is busy and the waiting queue is at its bound."""


class Unfit(ValueError):
    """A request whose settings do not fit what a launch packs them into (an int32 top_k, seed
    or token): refused at `submit`, so that it never fails a step the other rows share.
    `field`: the request field it names."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


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


@dataclass(frozen=True)
class Policy:
    """What the scheduler may launch: `batch` rows of a `context`-token kernel over `vocab`
    tokens; `max_queue` requests may wait for a row; `prefill`: "decode", "verify" or
    "reference" (mkc.serve.engine's docstring); the verify step's `verify_rows` R and the
    sequences (low, high) one launch takes (0 and (0, 0) without one)."""

    batch: int
    context: int
    vocab: int
    max_queue: int = 64
    prefill: str = "decode"
    verify_rows: int = 0
    verify_sequences: tuple[int, int] = (0, 0)


# ---- the work of an iteration: what to run, and what the scheduler needs to read its result
@dataclass(frozen=True, eq=False)
class Clear:
    """Zero the states of the rows new requests took over."""

    launch: Launch


@dataclass(frozen=True, eq=False)
class Step:
    """A decode step over every row; `requests` by row (None: idle), `forced` the prompt token
    after each row's fed one where its logprob is asked (else -1)."""

    launch: Launch
    requests: tuple[Request | None, ...]
    forced: tuple[int, ...]


@dataclass(frozen=True, eq=False)
class PrefillChunk:
    """A verify launch of `request`'s prompt tokens start..end on its row alone; `scored`: the
    launch also scores each token's successor (the prompt's logprobs)."""

    launch: Launch
    request: Request
    start: int
    end: int
    scored: bool


@dataclass(frozen=True, eq=False)
class ReferencePrefill:
    """Not a launch: the family reference's state after `tokens` (the prompt but its last token),
    made on the host and written into `request`'s row."""

    request: Request
    tokens: list[int]
    launch: None = None


@dataclass(frozen=True, eq=False)
class Speculate:
    """A verify launch of anchors and drafts; `requests` and `drafts` (each one's count) by the
    launch's sequence (None: an idle row in a whole-batch launch)."""

    launch: Launch
    requests: tuple[Request | None, ...]
    drafts: tuple[int, ...]


Work = Union[Clear, Step, PrefillChunk, ReferencePrefill, Speculate]


class Scheduler:
    """The rows, the waiting queue and the decisions of each iteration (module docstring).
    `drafter`: None, or speculative decoding's, (context, n) -> up to n draft tokens."""

    def __init__(self, policy: Policy, drafter: Drafter | None = None,
                 lock: ContextManager[Any] | None = None):
        self.policy, self.drafter = policy, drafter
        self.lock = lock if lock is not None else contextlib.nullcontext()
        self.stats = EngineStats()
        self.rows: list[Request | None] = [None] * policy.batch
        self.waiting: deque[Request] = deque()
        self._clear: list[int] = []               # this iteration's plan, as `next` goes on
        self._fresh: deque[Request] = deque()
        self._step_due = False

    # ---- the request side (any thread) ---------------------------------------------------
    def submit(self, request: Request) -> None:
        """`check` a request, then `enqueue` it."""
        self.check(request)
        self.enqueue(request)

    def check(self, request: Request) -> None:
        """Unfit when a request's settings or tokens do not fit a launch."""
        check_fits(request.sampling)
        vocab = self.policy.vocab
        if not all(0 <= t < vocab for t in request.prompt):
            raise Unfit(f"the prompt has token ids outside the vocabulary (0 to {vocab - 1})", "prompt")

    def enqueue(self, request: Request) -> None:
        """Queue a request for the next free row; QueueFull past B busy rows and `max_queue`
        waiting ones."""
        with self.lock:
            free, batch = self.free_rows(), self.policy.batch
            if len(self.waiting) >= self.policy.max_queue + free:
                busy = ("all" if free == 0 else f"{batch - free} of") + f" {batch} rows are busy"
                raise QueueFull(f"{busy} and {len(self.waiting)} requests wait for a row (the "
                                f"queue holds {self.policy.max_queue})")
            self.waiting.append(request)

    def free_rows(self) -> int:
        return sum(r is None for r in self.rows)

    def idle(self) -> bool:
        """Nothing to run: no request waits and no row is busy."""
        return not self.waiting and all(r is None for r in self.rows)

    # ---- an iteration ----------------------------------------------------------------------
    def admit(self) -> None:
        """Begin an iteration: free the rows of cancelled requests, drop cancelled waiters, give
        free rows to waiters in arrival order, and plan the iteration's work (`next`)."""
        with self.lock:
            for req in self.rows:
                if req is not None and req.cancelled:
                    self._finish(req, Event(finish_reason="cancelled"))
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
            taken = []
            for b in range(self.policy.batch):
                if self.rows[b] is None and self.waiting:
                    req = self.waiting.popleft()
                    req.row = b
                    self.rows[b] = req
                    taken.append(b)
                    if _scored(req):        # nothing to compute (a one-token prompt's logprobs)
                        self._finish(req, Event(finish_reason="length"))
            busy = any(r is not None for r in self.rows)
            self._clear = taken if busy else []
            fresh = [r for r in map(self.rows.__getitem__, taken) if r is not None]
            self._fresh = deque(fresh if busy and self.policy.prefill != "decode" else ())
            self._step_due = busy

    def next(self) -> Work | None:
        """The iteration's next work, or None when it is done. Runs the drafter (for the last
        launch), so it is called on the engine's thread without the lock."""
        if self._clear:
            mask = np.zeros(self.policy.batch, np.int32)
            mask[self._clear] = 1
            self._clear = []
            return Clear(Launch(Kind.CLEAR, rows=mask))
        while self._fresh:
            work = self._prefill_work(self._fresh[0])
            if work is not None:
                return work
            self._fresh.popleft()
        if self._step_due:
            self._step_due = False
            if any(r is not None for r in self.rows):
                drafts = self._drafts()
                return self.speculate(drafts) if drafts is not None else self.step()
        return None

    def update(self, work: Work, result: Any, seconds: float) -> None:
        """Take the result of `work` (what `Device.run` gives for its launch; None for a
        reference prefill) that took `seconds`."""
        if isinstance(work, Step):
            self._stepped(work, result, seconds)
        elif isinstance(work, PrefillChunk):
            self._prefilled(work, result, seconds)
        elif isinstance(work, ReferencePrefill):
            work.request.fed = len(work.request.prompt) - 1
            self.stats.prefill_seconds += seconds
        elif isinstance(work, Speculate):
            self._speculated(work, result, seconds)

    def fail_request(self, req: Request, stage: str, error: Exception) -> None:
        """End one request with an error from work on its own tokens (not a launch the rows
        share): its row is freed, the other rows go on."""
        log.error("%s failed for one request", stage, exc_info=error)
        with self.lock:
            self._finish(req, Event(finish_reason="error", error=f"{stage} failed: {error}"))

    def abort(self, message: str) -> None:
        """A launch the rows share failed: every busy row's request ends with `message`, and the
        rest of the iteration is dropped (the waiting requests stay)."""
        with self.lock:
            for req in self.rows:
                if req is not None:
                    self._finish(req, Event(finish_reason="error", error=message))
            self._drop_plan()

    def fail_all(self, message: str) -> None:
        """Serving stopped for good: every request, running or waiting, ends with `message`."""
        with self.lock:
            for req in [r for r in self.rows if r is not None] + list(self.waiting):
                self._finish(req, Event(finish_reason="error", error=message))
            self.waiting.clear()
            self._drop_plan()

    def _drop_plan(self) -> None:
        self._clear, self._fresh, self._step_due = [], deque(), False

    def _finish(self, req: Request, event: Event) -> None:
        req.finished = True
        if req.row is not None and self.rows[req.row] is req:
            self.rows[req.row] = None
        self.stats.requests_done += 1
        req.emit(event)

    def _accept(self, req: Request, sampled: Sampled, row: int) -> None:
        """Under the lock: a request's next token (row `row` of `sampled`, on the host), and
        its end if that was its last."""
        token = int(sampled.tokens[row])
        logprob, top = row_logprobs(sampled, row, req.sampling)
        req.generated.append(token)
        req.emit(Event(token=token, logprob=logprob, top=top))
        finish = token_finish(req.sampling, req.generated, len(req.prompt), self.policy.context)
        if finish is not None:
            self._finish(req, Event(finish_reason=finish))

    # ---- decode steps ------------------------------------------------------------------------
    def step(self) -> Step:
        """A decode step over all rows (idle rows compute on token 0 at position 0), then one
        on-device sample of every row (with logprobs where a row asked for them)."""
        B = self.policy.batch
        rows = tuple(self.rows)
        tokens, positions = np.zeros(B, np.int32), np.zeros(B, np.int32)
        forced = [-1] * B                     # the next prompt token, where its logprob is asked
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
        launch = Launch(Kind.DECODE, tokens, positions, sampling=sampling, width=logprob_width(params))
        return Step(launch, rows, tuple(forced))

    def _stepped(self, work: Step, sampled: Sampled, seconds: float) -> None:
        self.stats.steps += 1
        self.stats.step_seconds += seconds
        self.stats.busy_row_steps += sum(req is not None for req in work.requests)
        with self.lock:
            for b, req in enumerate(work.requests):
                if req is None or req.finished:
                    continue
                req.fed += 1
                if req.fed >= len(req.prompt):
                    self._accept(req, sampled, b)
                    continue
                forced = work.forced[b]       # still prefilling: a prompt token's logprob
                if forced >= 0:
                    logprob, top = row_logprobs(sampled, b, req.sampling)
                    req.emit(Event(token=forced, logprob=logprob, top=top, prompt=True))
                if _scored(req):
                    self._finish(req, Event(finish_reason="length"))

    # ---- prefill -------------------------------------------------------------------------------
    def _prefill_work(self, req: Request) -> Work | None:
        """A new request's next prefill work by the policy, or None when it has none left."""
        if req.finished:
            return None
        if self.policy.prefill == "reference":
            # a request for its prompt's logprobs is prefilled by decode steps, whose logits at
            # each prompt position give them (the reference's are not kept)
            if req.sampling.prompt_logprobs or req.fed >= len(req.prompt) - 1:
                return None
            return ReferencePrefill(req, req.prompt[:-1])
        R = self.policy.verify_rows
        if len(req.prompt) - req.fed <= 0 or req.fed + R > self.policy.context:
            return None             # the tail that would pass the context is left to decode steps
        start = req.fed
        chunk = req.prompt[start:start + R]
        end = start + len(chunk)
        last, scored = end == len(req.prompt), req.sampling.prompt_logprobs
        after = (req.prompt[end] if not last else -1) if scored else None
        launch = self.prefill_launch(req.row, chunk, start, req.sampling if last or scored else None,
                                     sample=last and req.sampling.max_tokens > 0, after=after)
        return PrefillChunk(launch, req, start, end, scored)

    def prefill_launch(self, row: int, chunk: list[int], start: int,
                       sampling: SamplingParams | None = None, sample: bool = True,
                       after: int | None = None) -> Launch:
        """A verify launch of `chunk` (up to R prompt tokens at positions start...) on row
        `row` alone, all committed; with `sampling` and `sample`, the first token sampled from
        the last chunk token's logits; with `after` (the prompt token after the chunk, or -1),
        each chunk token's logits score the token after it (the prompt's logprobs)."""
        R = self.policy.verify_rows
        tokens = np.array([chunk + [chunk[-1]] * (R - len(chunk))], np.int32)
        counts = [len(chunk)] if after is None else [len(chunk), after]
        return Launch(Kind.PREFILL, tokens, np.array([start], np.int32), np.array([row], np.int32),
                      np.array(counts, np.int32),
                      sampling=row_arrays([sampling], [0]) if sampling is not None and sample else (),
                      width=logprob_width([sampling]) if sampling is not None else None,
                      sample=sampling is not None and sample)

    def _prefilled(self, work: PrefillChunk, result: Any, seconds: float) -> None:
        req, start = work.request, work.start
        sampled, prompt = result if work.scored else (result, None)
        req.fed = work.end
        self.stats.prefill_launches += 1
        self.stats.prefill_seconds += seconds
        with self.lock:
            for j in range(work.end - start if prompt is not None else 0):
                if start + j + 1 < len(req.prompt):       # a prompt token's logprob
                    logprob, top = row_logprobs(prompt, j, req.sampling)
                    req.emit(Event(token=req.prompt[start + j + 1], logprob=logprob, top=top,
                                   prompt=True))
            if _scored(req) and not req.finished:
                self._finish(req, Event(finish_reason="length"))
            if sampled is not None and not req.finished:
                self._accept(req, sampled, 0)

    # ---- speculative decoding ------------------------------------------------------------------
    def speculative_sequences(self, busy: int) -> int | None:
        """The sequences of a verify launch for `busy` rows: the whole batch when the verify
        step takes B sequences, else the busy rows alone, or None when it takes neither."""
        low, high = self.policy.verify_sequences
        if low <= self.policy.batch <= high:
            return self.policy.batch
        return busy if low <= busy <= high else None

    def _drafts(self) -> dict[int, list[int]] | None:
        """Speculative decoding's drafts for the next launch, by row, or None for a decode step:
        when there is no drafter, a busy row samples (temperature > 0), is still prefilling or
        is too near the context's end for R rows, the busy rows do not fit one verify launch,
        or no row has a draft."""
        if self.drafter is None:
            return None
        busy = [(b, req) for b, req in enumerate(self.rows) if req is not None]
        if self.speculative_sequences(len(busy)) is None:
            return None
        R = self.policy.verify_rows
        drafts = {}
        for b, req in busy:
            history = req.prompt + req.generated
            if (req.sampling.temperature > 0 or not req.generated or req.fed != len(history) - 1
                    or req.fed + R > self.policy.context):
                return None
            try:
                drafts[b] = list(self.drafter(history, R - 1))[:R - 1]
            except Exception as e:      # noqa: BLE001 - its own history's: it fails alone
                self.fail_request(req, "drafting", e)
                return None             # the other rows take a decode step
        return drafts if any(drafts.values()) else None

    def speculate(self, drafts: dict[int, list[int]]) -> Speculate:
        """One verify launch over the busy rows (every one greedy), each row's anchor (its last
        token) and drafts (`drafts` by row)."""
        R = self.policy.verify_rows
        whole = self.speculative_sequences(len(drafts)) == self.policy.batch
        rows = list(range(self.policy.batch)) if whole else sorted(drafts)
        tokens = np.zeros((len(rows), R), np.int32)       # an idle row: token 0 at position 0
        starts = np.zeros(len(rows), np.int32)
        reqs = tuple(self.rows[b] for b in rows)
        for i, (b, req) in enumerate(zip(rows, reqs)):
            if req is not None:
                row = [req.generated[-1]] + drafts[b]
                tokens[i] = row + [row[-1]] * (R - len(row))
                starts[i] = req.fed
        counts = tuple(len(drafts.get(b, [])) for b in rows)
        width = logprob_width([req.sampling if req is not None else None for req in reqs])
        launch = Launch(Kind.SPECULATE, tokens, starts, np.asarray(rows, np.int32),
                        np.array(counts, np.int32), width=width)
        return Speculate(launch, reqs, counts)

    def _speculated(self, work: Speculate, result: tuple[Sampled, np.ndarray], seconds: float) -> None:
        """Each row keeps the drafts its own greedy choices match and the choice after them."""
        sampled, counts = result
        R = self.policy.verify_rows
        self.stats.verify_launches += 1
        self.stats.verify_seconds += seconds
        with self.lock:
            for i, req in enumerate(work.requests):
                if req is None or req.finished:
                    continue
                n = int(counts[i])
                for spec in (req.speculation, self.stats):
                    spec.drafted += work.drafts[i]
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
