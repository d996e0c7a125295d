"""The serving engine's device side: the batch's state on the mesh and every launch that reads
or changes it. Each launch is a `Launch` (what to run, with its host inputs), run by
`Device.run`; the engine decides which launches to make and reads their results. Under
jax.distributed every process runs the same launches in the same order (mkc.serve.multihost
sends each as `Codec`'s fixed-shape int32 descriptor), so this is the one place a launch is
defined: process 0's engine and the other processes' follower loop both call `Device.run`.

Sampling runs on every process, not once on process 0: the step's logits come back
replicated, `sample_rows` is a jitted function of them and of the descriptor's per-row
settings (seeds included), so every process computes the same tokens, and the verify
launches' accepted counts (which `commit` needs on every process) follow from them without a
second message.
"""
from __future__ import annotations

import enum
import functools
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from mkc.serve.drafting import accepted_rows
from mkc.serve.sampling import Sampled, greedy_rows, sample_rows, score_rows


class Kind(enum.IntEnum):
    DECODE = 1        # a decode step over all B rows, then each row's sampled token
    PREFILL = 2       # a verify launch of one row's prompt chunk, all committed
    SPECULATE = 3     # a verify launch of anchors and drafts, the matching drafts committed
    CLEAR = 4         # zero the per-row states of the masked rows (a row's new request)
    RESET = 5         # zero the whole state (after warm-up, or a failed launch)
    SYNC = 6          # no device work: the processes confirm they are in step
    STOP = 7          # no device work: the other processes stop


def _empty() -> np.ndarray:
    return np.zeros(0, np.int32)


_SAMPLING_DTYPES = (np.float32, np.int32, np.float32, np.int32, np.int32, np.int32)   # row_arrays


@dataclass(frozen=True, eq=False)
class Launch:
    """One launch and its host inputs.

    DECODE: `tokens`, `positions` [B]; `sampling`: `row_arrays`' six [B] arrays.
    PREFILL: `rows` [1] (the row), `tokens` [1, R] (the chunk, padded), `positions` [1] (its
    start), `counts` [1] (the chunk's tokens), or [2] for the prompt's logprobs (then the
    prompt token after the chunk, or -1: each chunk token's logits score the token after it,
    `width` wide); with `sample`, the first generated token is sampled from the last chunk
    token's logits with `sampling` (six [1] arrays).
    SPECULATE: `rows` [S] (the batch's rows, in order), `tokens` [S, R] (each row's anchor,
    drafts, padding), `positions` [S] (starts), `counts` [S] (drafts a row).
    CLEAR: `rows` [B], 1 where a row's states are zeroed. `width`: the logprobs' width (None:
    no logprobs)."""

    kind: Kind
    tokens: np.ndarray = field(default_factory=_empty)
    positions: np.ndarray = field(default_factory=_empty)
    rows: np.ndarray = field(default_factory=_empty)
    counts: np.ndarray = field(default_factory=_empty)
    sampling: tuple[np.ndarray, ...] = ()
    width: int | None = None
    sample: bool = False


class Codec:
    """A Launch as a fixed-shape int32 vector and back: a header (kind, width + 1, sample, the
    verify launch's sequences), each field's length, then the fields (floats by their bits),
    zero-padded to `size`, which depends only on the batch and the verify step's rows."""

    HEADER = 4
    FIELDS = 4 + len(_SAMPLING_DTYPES)

    def __init__(self, batch: int, verify_rows: int):
        self.batch, self.verify_rows = batch, verify_rows
        B, R = batch, max(verify_rows, 1)
        payload = max(2 * B + B * len(_SAMPLING_DTYPES), B * (R + 3), R + 4 + len(_SAMPLING_DTYPES))
        self.size = self.HEADER + self.FIELDS + payload

    def encode(self, launch: Launch) -> np.ndarray:
        fields = [launch.tokens, launch.positions, launch.rows, launch.counts]
        fields += list(launch.sampling) or [np.zeros(0, d) for d in _SAMPLING_DTYPES]
        flat = [np.ascontiguousarray(f, dtype=d).reshape(-1).view(np.int32)
                for f, d in zip(fields, [np.int32] * 4 + list(_SAMPLING_DTYPES))]
        sequences = int(np.shape(launch.tokens)[0]) if np.ndim(launch.tokens) == 2 else 0
        head = [int(launch.kind), -1 if launch.width is None else launch.width, int(launch.sample),
                sequences, *(f.size for f in flat)]
        out = np.concatenate([np.asarray(head, np.int32), *flat])
        if out.size > self.size:
            raise ValueError(f"a {launch.kind.name} launch needs {out.size} words; the descriptor "
                             f"holds {self.size}")
        return np.pad(out, (0, self.size - out.size))

    def decode(self, words: np.ndarray) -> Launch:
        words = np.asarray(words, np.int32)
        if words.shape != (self.size,):
            raise ValueError(f"a descriptor of {words.shape} words; expected ({self.size},)")
        kind, width, sample, sequences = (int(w) for w in words[:self.HEADER])
        lengths = words[self.HEADER:self.HEADER + self.FIELDS]
        at, fields = self.HEADER + self.FIELDS, []
        for n, dtype in zip(lengths, [np.int32] * 4 + list(_SAMPLING_DTYPES)):
            fields.append(words[at:at + n].view(dtype).copy())
            at += n
        tokens, positions, rows, counts, *sampling = fields
        if sequences:
            tokens = tokens.reshape(sequences, -1)
        return Launch(Kind(kind), tokens, positions, rows, counts,
                      tuple(sampling) if any(s.size for s in sampling) else (),
                      None if width < 0 else width, bool(sample))


def result_bytes(result: Any) -> bytes:
    """A launch's host result as bytes (for the processes' lockstep digest)."""
    if result is None:
        return b""
    if isinstance(result, (tuple, list)):
        return b"|".join(result_bytes(r) for r in result)
    return np.ascontiguousarray(np.asarray(result)).tobytes()


class KernelSteps:
    """The kernel's launches (`--backend kernel`): its decode step at `batch` rows on `mesh` (in
    interpret mode where `interpret` is set), its verify steps, and its state layout (a leading
    rank axis). The step provider `Device` runs by default; `mkc.serve.emulation.EmulationSteps`
    is the other, with the same members."""

    name = "kernel"
    eager = False                    # a compiled step (the emulation's may run eagerly)

    def __init__(self, gen: Any, weights: dict, mesh: Any, batch: int, interpret: Any = None):
        self.gen, self.weights, self.mesh, self.batch = gen, weights, mesh, batch
        self.interpret = interpret
        self._step = gen.make_decode_step(mesh, batch, interpret)
        self._ranked = NamedSharding(mesh, P(gen.AXIS))
        self.verify_rows: int = getattr(gen, "VERIFY_ROWS", 0)
        self.seq_axes = sequence_axes(gen)
        row_states = (tuple(dict(gen.ROW_STATES).items()) if hasattr(gen, "ROW_STATES")
                      else row_states_of(gen))
        self.clear_axes = tuple((n, axis + 2) for n, axis in row_states)    # past rank and layer

    def zero_state(self) -> dict:
        place = getattr(self.gen, "place_state", None)
        if place is not None:           # each process creates only its own ranks' shards
            return place(self.batch, self.mesh)
        return {n: jax.device_put(a, self._ranked) for n, a in self.gen.init_state(self.batch).items()}

    def decode(self, state: dict, tokens: np.ndarray, positions: np.ndarray) -> tuple[jax.Array, dict]:
        logits, _, state = self._step(self.weights, state, tokens, positions)
        return logits, state

    def own_state(self, state: dict) -> dict:
        return {n: jax.device_put(a, self._ranked) for n, a in state.items()}

    def verifier(self, S: int) -> Any:
        return self.gen.make_verify_step(self.mesh, S, self.verify_rows, self.interpret)


class Device:
    """The batch's state and the launches on it (module docstring): the decode step at `batch`
    rows, verify launches of 1 or more sequences (compiled on first use), and the jitted row
    updates. `steps`: what runs them and in which state layout, the kernel's (`KernelSteps`,
    the default) or its rounding emulation (`mkc.serve.emulation.EmulationSteps`)."""

    def __init__(self, gen: Any, weights: dict, mesh: Any, batch: int, interpret: Any = None,
                 steps: Any = None):
        self.gen, self.weights, self.mesh, self.batch = gen, weights, mesh, batch
        self.interpret = interpret
        self.steps = steps if steps is not None else KernelSteps(gen, weights, mesh, batch, interpret)
        self.backend: str = self.steps.name
        self.verify_rows: int = self.steps.verify_rows
        self.verifiers: dict[int, Any] = {}
        self._seq_axes = self.steps.seq_axes
        self._clear_axes = self.steps.clear_axes
        self.codec = Codec(batch, self.verify_rows)
        self.state = self._zero_state()

    def run(self, launch: Launch) -> Any:
        """Run one launch: DECODE gives a Sampled of B rows; PREFILL a Sampled of 1 row (or None
        without `sample`), with the prompt's logprobs a pair of it and their Sampled of the
        chunk's rows; SPECULATE (Sampled of S * R rows, accepted counts [S]); the others
        None. Host results only: every process reads them from its own replica."""
        if launch.kind == Kind.DECODE:
            logits, self.state = self.steps.decode(self.state, launch.tokens, launch.positions)
            return jax.device_get(sample_rows(logits, *launch.sampling, width=launch.width))
        if launch.kind == Kind.PREFILL:
            return self._prefill(launch)
        if launch.kind == Kind.SPECULATE:
            return self._speculate(launch)
        if launch.kind == Kind.CLEAR:
            self.state = _clear_rows(self.state, launch.rows.astype(bool), self._clear_axes)
        elif launch.kind == Kind.RESET:
            self.state = self._zero_state()
        return None

    def put_row_state(self, row: int, state: dict) -> None:
        """Write one sequence's state (the kernel's layout, a leading rank axis) into batch row
        `row`: a host-made state, so not a Launch (one process only: `--prefill reference`)."""
        one = self.steps.own_state(state)
        self.state = _put_rows(self.state, one, jnp.asarray([row], jnp.int32), self._seq_axes)

    def _zero_state(self) -> dict:
        return self.steps.zero_state()

    def _verifier(self, S: int) -> Any:
        if not self.verify_rows:
            raise ValueError(f"the {self.backend} backend has no verify step")
        if S not in self.verifiers:
            self.verifiers[S] = self.steps.verifier(S)
        return self.verifiers[S]

    def _verify(self, rows: np.ndarray, tokens: np.ndarray, starts: np.ndarray, accept) -> None:
        """One verify launch of tokens [S, R] at starts [S] on the batch's rows `rows` (all of
        them, in order: the batch's state as it is; else those rows' states taken out and put
        back); `accept(logits)` gives the rows each sequence keeps, which are committed."""
        whole = rows.tolist() == list(range(self.batch))
        one = self.state if whole else _take_rows(self.state, rows, self._seq_axes)
        caches = {n: a for n, a in one.items() if n not in self.gen.ROW_STATES}
        states = {n: a for n, a in one.items() if n in self.gen.ROW_STATES}
        logits, _, verified = self._verifier(len(rows))(self.weights, caches, states, tokens, starts)
        one = self.gen.commit(one, verified, accept(logits))
        self.state = one if whole else _put_rows(self.state, one, rows, self._seq_axes)

    def _prefill(self, launch: Launch) -> Any:
        n = int(launch.counts[0])
        rows = []

        def accept(logits: jax.Array) -> np.ndarray:
            rows.append(logits[0, :n])
            return np.array([n], np.int32)
        self._verify(launch.rows, launch.tokens, launch.positions, accept)
        sampled = None
        if launch.sample:
            sampled = jax.device_get(sample_rows(rows[0][n - 1:], *launch.sampling, width=launch.width))
        if launch.counts.size < 2:
            return sampled
        after = np.append(launch.tokens[0, 1:n], launch.counts[1])    # -1: no token after
        scored = score_rows(rows[0], jnp.asarray(np.maximum(after, 0), jnp.int32), width=launch.width or 0)
        return sampled, jax.device_get(scored)

    def _speculate(self, launch: Launch) -> tuple[Sampled, np.ndarray]:
        S, R = launch.tokens.shape
        kept = []

        def accept(logits: jax.Array) -> np.ndarray:
            sampled = jax.device_get(greedy_rows(logits.reshape(S * R, -1), width=launch.width))
            predicted = np.asarray(sampled.tokens).reshape(S, R)
            counts = np.array([accepted_rows(launch.tokens[i], int(launch.counts[i]), predicted[i])
                               for i in range(S)], np.int32)
            kept.append((sampled, counts))
            return counts
        self._verify(launch.rows, launch.tokens, launch.positions, accept)
        return kept[0]


def sequence_axes(gen: Any) -> tuple[tuple[str, int], ...]:
    """Each state of a module and its sequence (or row) axis counted with the rank axis: where
    its shapes at 1 and 2 sequences differ."""
    one, two = gen.state_shapes(1), gen.state_shapes(2)
    return tuple((n, 1 + next(i for i, (x, y) in enumerate(zip(one[n][0], two[n][0])) if x != y))
                 for n in one)


def row_states_of(gen: Any) -> tuple[tuple[str, int], ...]:
    """A module's per-row states (recurrent, conv: what a new request's row must have zeroed)
    with their row axis after the layer axis, as its ROW_STATES would list them: a module
    compiled without a `verify` line exports no ROW_STATES, so they are its states that are no
    layer kind's KV cache (`KINDS`), at their sequence axis."""
    caches = {c for plan in gen.KINDS.values() for c in plan.caches}
    return tuple((n, axis - 2) for n, axis in sequence_axes(gen) if n not in caches)


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
    (name, its row axis) of each per-row state; the others (KV caches) are kept."""
    out = dict(state)
    for name, axis in row_states:
        a = state[name]
        shape = [1] * a.ndim
        shape[axis] = rows.shape[0]
        out[name] = jnp.where(rows.reshape(shape), jnp.zeros((), a.dtype), a)
    return out
