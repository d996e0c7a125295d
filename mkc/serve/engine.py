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
family's reference under `jit` (`prefiller`, mkc.serve.prefill; interpret mode only), writes
its state into the row in the kernel's layout, and leaves the last token to the next decode
step. `auto`, the default, is `verify` where the module has a verify step of one sequence
(docs/serving.md has the measurements). A row taken over by a new
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

Events go back to the request's asyncio loop through `call_soon_threadsafe`.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mkc.serve.sampling import (Sampled, SamplingParams, greedy_rows, logprob_width, row_arrays,
                                row_logprobs, sample_rows)

log = logging.getLogger("mkc.serve")


class QueueFull(Exception):
    """Every row is busy and the waiting queue is at its bound."""


@dataclass(frozen=True)
class Event:
    """What the engine tells a request: a token (`token` set, with its `logprob` and `top`
    most likely (token, logprob) when the request asked for logprobs), or the end
    (`finish_reason`: "stop", "length", or "error" with `error` saying why)."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None
    logprob: float | None = None
    top: tuple[tuple[int, float], ...] | None = None


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
    drafter, (context, n) -> up to n draft tokens (module docstring)."""

    def __init__(self, gen: Any, weights: dict, mesh: Any, batch: int, interpret: Any = None,
                 max_queue: int = 64, eos_token_ids: frozenset[int] = frozenset(),
                 prefill: str = "auto", drafter: Callable[[list[int], int], list[int]] | None = None,
                 prefiller: Callable[[list[int]], dict] | None = None):
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
        self._step = gen.make_decode_step(mesh, batch, interpret)
        self._ranked = NamedSharding(mesh, P(gen.AXIS))
        self._state = self._zero_state()
        self._row_states = tuple(dict(gen.ROW_STATES).items())
        if prefill == "auto":
            prefill = "verify" if _verifies_one_sequence(gen) else "decode"
        if prefill == "verify" and not _verifies_one_sequence(gen):
            raise ValueError("--prefill verify needs a verify step of one sequence: add "
                             "`verify R sequences 1 to N` to the spec")
        if prefill not in ("verify", "decode", "reference"):
            raise ValueError(f"prefill {prefill!r}: choose auto, decode, verify or reference")
        if prefill == "reference" and prefiller is None:
            raise ValueError("--prefill reference needs the family reference's prefill "
                             "(mkc.serve.prefill.ReferencePrefill)")
        if drafter is not None and getattr(gen, "VERIFY_ROWS", 0) < 2:
            raise ValueError("speculative decoding needs a verify step of 2 rows or more: add "
                             "`verify R` to the spec")
        self.prefill, self.drafter, self.prefiller = prefill, drafter, prefiller
        self._verifiers: dict[int, Any] = {}
        if prefill == "verify" or drafter is not None:
            self.verify_rows: int = gen.VERIFY_ROWS
            self.verify_sequences: tuple[int, int] = tuple(gen.VERIFY_SEQUENCES)
        if prefill in ("verify", "reference") or drafter is not None:
            one, two = gen.state_shapes(1), gen.state_shapes(2)
            # each state's sequence (or row) axis, with the rank axis: where 1 and 2 differ
            self._seq_axes = tuple((n, 1 + next(i for i, (x, y) in enumerate(zip(one[n][0], two[n][0]))
                                                if x != y)) for n in one)
        self._rows: list[Request | None] = [None] * batch
        self._waiting: deque[Request] = deque()
        self._wake = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # ---- the request side (any thread) ---------------------------------------------------
    def submit(self, request: Request) -> None:
        """Queue a request for the next free row; QueueFull past B busy rows and `max_queue`
        waiting ones."""
        with self._wake:
            if len(self._waiting) >= self.max_queue + self._free_rows():
                raise QueueFull(f"all {self.batch} rows are busy and {len(self._waiting)} requests "
                                f"wait (the queue holds {self.max_queue})")
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
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if self._thread is not None:
            self._thread.join()

    def warm_up(self) -> float:
        """Compile and run one step on idle rows (so the first request does not wait for the
        compile), and the verify launches prefill and speculation use; its seconds."""
        t0 = time.perf_counter()
        self._run_step()
        R = self.verify_rows if self.prefill == "verify" or self.drafter else 0
        if self.prefill == "verify":
            self._verify_chunk(0, [0], 0)
        if self.prefill == "reference":
            self.prefiller([0])                 # compiles the reference's step
        if self.drafter is not None:
            for S in {self._speculative_sequences(n) for n in range(1, self.batch + 1)} - {None}:
                if S not in self._verifiers:
                    self._launch_verify(list(range(S)), np.zeros((S, R), np.int32),
                                        np.zeros(S, np.int32), lambda logits, S=S: np.ones(S, np.int32))
        if R:
            self._state = self._zero_state()
        return time.perf_counter() - t0

    # ---- the engine thread ---------------------------------------------------------------
    def _free_rows(self) -> int:
        return sum(r is None for r in self._rows)

    def _zero_state(self) -> dict:
        return {n: jax.device_put(a, self._ranked) for n, a in self.gen.init_state(self.batch).items()}

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
        return taken

    def _finish(self, req: Request, event: Event) -> None:
        req.finished = True
        if req.row is not None and self._rows[req.row] is req:
            self._rows[req.row] = None
        self.stats.requests_done += 1
        req.emit(event)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not self._stopping and not self._waiting and all(r is None for r in self._rows):
                    self._wake.wait()
                if self._stopping:
                    return
                taken = self._admit()
                if all(r is None for r in self._rows):
                    continue
            if taken:
                mask = np.zeros(self.batch, bool)
                mask[taken] = True
                self._state = _clear_rows(self._state, jnp.asarray(mask), self._row_states)
            try:
                if self.prefill == "verify":
                    for b in taken:
                        self._prefill_verify(self._rows[b])
                elif self.prefill == "reference":
                    for b in taken:
                        self._prefill_reference(self._rows[b])
                if any(r is not None for r in self._rows):
                    drafts = self._drafts()
                    if drafts is not None:
                        self._run_speculative(drafts)
                    else:
                        self._run_step()
            except Exception as e:          # noqa: BLE001 - every request must hear of it
                log.exception("decode step failed")
                with self._wake:
                    for req in self._rows:
                        if req is not None:
                            self._finish(req, Event(finish_reason="error", error=f"decode step failed: {e}"))
                self._state = self._zero_state()      # the failed step may have consumed it

    def _run_step(self) -> None:
        """One decode step over all rows, then one on-device sample of every row (and one
        transfer of the tokens, with logprobs where a row asked for them)."""
        rows = list(self._rows)
        tokens = np.zeros(self.batch, np.int32)
        positions = np.zeros(self.batch, np.int32)
        for b, req in enumerate(rows):
            if req is None:
                continue
            history = req.prompt + req.generated
            tokens[b], positions[b] = history[req.fed], req.fed
        t0 = time.perf_counter()
        logits, _, self._state = self._step(self.weights, self._state, tokens, positions)
        params = [req.sampling if req is not None else None for req in rows]
        sampled = jax.device_get(sample_rows(logits, *map(jnp.asarray, row_arrays(
            params, [len(req.generated) if req is not None else 0 for req in rows])),
            width=logprob_width(params)))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self.stats.busy_row_steps += sum(req is not None for req in rows)
        with self._wake:
            for b, req in enumerate(rows):
                if req is None or req.finished:
                    continue
                req.fed += 1
                if req.fed >= len(req.prompt):         # still prefilling: the output is ignored
                    self._accept(req, sampled, b)

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
    def _verifier(self, S: int) -> Any:
        if S not in self._verifiers:
            self._verifiers[S] = self.gen.make_verify_step(self.mesh, S, self.verify_rows, self.interpret)
        return self._verifiers[S]

    def _launch_verify(self, rows: list[int], tokens: np.ndarray, starts: np.ndarray,
                       accept: Callable[[jax.Array], np.ndarray]) -> None:
        """One verify launch of tokens [S, R] at starts [S] on the batch's rows `rows` (all of
        them, in order: the batch's state as it is; else those rows' states taken out and put
        back); `accept(logits)` gives the rows each sequence keeps, which are committed."""
        whole = rows == list(range(self.batch))
        at = jnp.asarray(rows, jnp.int32)
        one = self._state if whole else _take_rows(self._state, at, self._seq_axes)
        caches = {n: a for n, a in one.items() if n not in self.gen.ROW_STATES}
        states = {n: a for n, a in one.items() if n in self.gen.ROW_STATES}
        logits, _, verified = self._verifier(len(rows))(self.weights, caches, states, tokens, starts)
        one = self.gen.commit(one, verified, accept(logits))
        self._state = one if whole else _put_rows(self._state, one, at, self._seq_axes)

    def _verify_chunk(self, row: int, chunk: list[int], start: int) -> jax.Array:
        """One verify launch of `chunk` (up to R tokens at positions start...) on row `row`
        alone, all committed; the last token's logits [1, vocab]."""
        R = self.verify_rows
        tokens = np.array([chunk + [chunk[-1]] * (R - len(chunk))], np.int32)
        last = []

        def accept(logits: jax.Array) -> np.ndarray:
            last.append(logits[:, len(chunk) - 1])
            return np.array([len(chunk)], np.int32)
        self._launch_verify([row], tokens, np.array([start], np.int32), accept)
        return last[0]

    def _prefill_verify(self, req: Request) -> None:
        """A newly admitted request's prompt through the verify step, R tokens a launch (the
        tail that would pass the context, if any, is left to decode steps); its first token
        sampled from the last prompt token's logits."""
        t0 = time.perf_counter()
        logits = None
        while len(req.prompt) - req.fed > 0 and req.fed + self.verify_rows <= self.context:
            chunk = req.prompt[req.fed:req.fed + self.verify_rows]
            logits = self._verify_chunk(req.row, chunk, req.fed)
            req.fed += len(chunk)
            self.stats.prefill_launches += 1
        if logits is not None and req.fed == len(req.prompt):
            params = map(jnp.asarray, row_arrays([req.sampling], [0]))
            sampled = jax.device_get(sample_rows(logits, *params, width=logprob_width([req.sampling])))
            with self._wake:
                self._accept(req, sampled, 0)
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _prefill_reference(self, req: Request) -> None:
        """A newly admitted request's prompt but its last token through the family reference
        (`prefiller`), its state written into the request's row; the next decode step feeds
        the last token and gives the first."""
        if len(req.prompt) < 2:
            return
        t0 = time.perf_counter()
        one = {n: jax.device_put(a, self._ranked) for n, a in self.prefiller(req.prompt[:-1]).items()}
        self._state = _put_rows(self._state, one, jnp.asarray([req.row], jnp.int32), self._seq_axes)
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
            drafts[b] = list(self.drafter(history, R - 1))[:R - 1]
        return drafts if any(drafts.values()) else None

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
        kept: list[tuple[Sampled, np.ndarray]] = []

        def accept(logits: jax.Array) -> np.ndarray:
            sampled = jax.device_get(greedy_rows(logits.reshape(S * R, -1), width=width))
            predicted = np.asarray(sampled.tokens).reshape(S, R)
            counts = np.ones(S, np.int32)             # the anchor, then each matching draft
            for i, b in enumerate(rows):
                d = drafts.get(b, [])
                while counts[i] <= len(d) and d[counts[i] - 1] == predicted[i, counts[i] - 1]:
                    counts[i] += 1
            kept.append((sampled, counts))
            return counts
        t0 = time.perf_counter()
        self._launch_verify(rows, tokens, starts, accept)
        sampled, counts = kept[0]
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


def _verifies_one_sequence(gen: Any) -> bool:
    return bool(getattr(gen, "VERIFY_ROWS", 0)) and gen.VERIFY_SEQUENCES[0] <= 1


@functools.partial(jax.jit, static_argnums=(2,))
def _take_rows(state: dict, rows: jax.Array, axes: tuple[tuple[str, int], ...]) -> dict:
    """Some rows' state (a state of len(rows) sequences) out of a batch's; axes: (name, the
    sequence axis with the rank axis)."""
    return {n: jnp.take(state[n], rows, axis=axis) for n, axis in axes}


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _put_rows(state: dict, some: dict, rows: jax.Array, axes: tuple[tuple[str, int], ...]) -> dict:
    """The batch's state with some rows' state written back at `rows`."""
    def put(a, part, axis):
        moved = jnp.moveaxis(a, axis, 0).at[rows].set(jnp.moveaxis(part.astype(a.dtype), axis, 0))
        return jnp.moveaxis(moved, 0, axis)
    return {n: put(state[n], some[n], axis) for n, axis in axes}


@functools.partial(jax.jit, static_argnums=(2,), donate_argnums=(0,))
def _clear_rows(state: dict, rows: jax.Array, row_states: tuple[tuple[str, int], ...]) -> dict:
    """The state with the recurrent and conv entries of the masked rows zeroed. row_states:
    (name, the row axis after the layer axis) of each per-row state; the others (KV caches)
    are kept."""
    out = dict(state)
    for name, axis in row_states:
        a = state[name]
        shape = [1] * a.ndim
        shape[axis + 2] = rows.shape[0]          # past the rank and layer axes
        out[name] = jnp.where(rows.reshape(shape), jnp.zeros((), a.dtype), a)
    return out
