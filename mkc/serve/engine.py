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
once), while the other rows wait. `auto`, the default, is `verify` where the module has a
verify step of one sequence (docs/serving.md has the measurements). A row taken over by a new
request has its recurrent and conv states zeroed first (its KV entries need no clearing: the
new request rewrites each position before it attends to it, and positions past its own are
masked).

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mkc.serve.sampling import SamplingParams, row_arrays, sample_rows

log = logging.getLogger("mkc.serve")


class QueueFull(Exception):
    """Every row is busy and the waiting queue is at its bound."""


@dataclass(frozen=True)
class Event:
    """What the engine tells a request: a token (`token` set), or the end (`finish_reason`:
    "stop", "length", or "error" with `error` saying why)."""

    token: int | None = None
    finish_reason: str | None = None
    error: str | None = None


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


class Engine:
    """Serves one generated module on `mesh` at B rows.

    `gen`: the generated module; `weights`: its placed weights; `interpret`: None on TPU, or
    Pallas' InterpretParams on CPU; `max_queue`: requests that may wait for a row before
    `submit` refuses more (QueueFull); `prefill`: "decode", "verify" or "auto" (verify where
    the module has a verify step of one sequence, else decode; module docstring)."""

    def __init__(self, gen: Any, weights: dict, mesh: Any, batch: int, interpret: Any = None,
                 max_queue: int = 64, eos_token_ids: frozenset[int] = frozenset(),
                 prefill: str = "auto"):
        low, high = gen.BATCH_RANGE
        if not low <= batch <= high:
            raise ValueError(f"--batch {batch}: the module is built for batches {low} to {high}")
        self.gen, self.weights, self.mesh, self.batch = gen, weights, mesh, batch
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
        self.prefill = prefill
        if prefill == "verify":
            if not _verifies_one_sequence(gen):
                raise ValueError("--prefill verify needs a verify step of one sequence: add "
                                 "`verify R sequences 1 to N` to the spec")
            self.verify_rows = gen.VERIFY_ROWS
            self._verify = gen.make_verify_step(mesh, 1, self.verify_rows, interpret)
            one, two = gen.state_shapes(1), gen.state_shapes(2)
            # each state's sequence (or row) axis, with the rank axis: where 1 and 2 differ
            self._seq_axes = tuple((n, 1 + next(i for i, (x, y) in enumerate(zip(one[n][0], two[n][0]))
                                                if x != y)) for n in one)
        elif prefill != "decode":
            raise ValueError(f"prefill {prefill!r}: choose auto, decode or verify")
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
        compile); its seconds."""
        t0 = time.perf_counter()
        self._run_step()
        if self.prefill == "verify":
            self._verify_chunk(0, [0], 0)
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
                if any(r is not None for r in self._rows):
                    self._run_step()
            except Exception as e:          # noqa: BLE001 - every request must hear of it
                log.exception("decode step failed")
                with self._wake:
                    for req in self._rows:
                        if req is not None:
                            self._finish(req, Event(finish_reason="error", error=f"decode step failed: {e}"))
                self._state = self._zero_state()      # the failed step may have consumed it

    def _run_step(self) -> None:
        """One decode step over all rows, then one on-device sample of every row."""
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
        sampled = np.asarray(sample_rows(logits, *map(jnp.asarray, row_arrays(
            params, [len(req.generated) if req is not None else 0 for req in rows]))))
        self.stats.steps += 1
        self.stats.step_seconds += time.perf_counter() - t0
        self.stats.busy_row_steps += sum(req is not None for req in rows)
        with self._wake:
            for b, req in enumerate(rows):
                if req is None or req.finished:
                    continue
                req.fed += 1
                if req.fed >= len(req.prompt):         # still prefilling: the output is ignored
                    self._accept(req, int(sampled[b]))

    def _accept(self, req: Request, token: int) -> None:
        """Under the lock: a request's next token, and its end if that was its last."""
        req.generated.append(token)
        req.emit(Event(token=token))
        if token in req.sampling.stop_token_ids:
            self._finish(req, Event(finish_reason="stop"))
        elif (len(req.generated) >= req.sampling.max_tokens
              or len(req.prompt) + len(req.generated) > self.context):
            self._finish(req, Event(finish_reason="length"))

    def _verify_chunk(self, row: int, chunk: list[int], start: int):
        """One verify launch of `chunk` (up to R tokens at positions start...) on row `row`
        alone, its accepted rows committed back into the batch's state; the last token's
        logits [1, vocab]."""
        R = self.verify_rows
        one = _take_row(self._state, jnp.int32(row), self._seq_axes)
        caches = {n: a for n, a in one.items() if n not in self.gen.ROW_STATES}
        states = {n: a for n, a in one.items() if n in self.gen.ROW_STATES}
        tokens = np.array([chunk + [chunk[-1]] * (R - len(chunk))], np.int32)
        logits, _, verified = self._verify(self.weights, caches, states, tokens, np.array([start], np.int32))
        one = self.gen.commit(one, verified, np.array([len(chunk)], np.int32))
        self._state = _put_row(self._state, one, jnp.int32(row), self._seq_axes)
        return logits[:, len(chunk) - 1]

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
            token = int(np.asarray(sample_rows(logits, *params))[0])
            with self._wake:
                self._accept(req, token)
        self.stats.prefill_seconds += time.perf_counter() - t0


def _verifies_one_sequence(gen: Any) -> bool:
    return bool(getattr(gen, "VERIFY_ROWS", 0)) and gen.VERIFY_SEQUENCES[0] <= 1


@functools.partial(jax.jit, static_argnums=(2,))
def _take_row(state: dict, row: jax.Array, axes: tuple[tuple[str, int], ...]) -> dict:
    """One row's state (a state of one sequence) out of a batch's; axes: (name, the sequence
    axis with the rank axis)."""
    return {n: jax.lax.dynamic_slice_in_dim(state[n], row, 1, axis) for n, axis in axes}


@functools.partial(jax.jit, static_argnums=(3,), donate_argnums=(0,))
def _put_row(state: dict, one: dict, row: jax.Array, axes: tuple[tuple[str, int], ...]) -> dict:
    """The batch's state with one row's state written back at `row`."""
    return {n: jax.lax.dynamic_update_slice_in_dim(state[n], one[n].astype(state[n].dtype), row, axis)
            for n, axis in axes}


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
