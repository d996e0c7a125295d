"""In-kernel collectives by remote DMA, for grid-less Pallas TPU kernels run under ``shard_map``.

The mechanism of the generated kernels' all-reduce, with the refs passed explicitly. A group is
the ``size`` ranks ``base + i * stride`` (i < size) containing the caller, on the mesh axis
``axis``; ranks are numbered core-fastest (the ranks of a chip, then the chips of a host, are
consecutive; `mkc.target` checks libtpu's device order keeps them so), so on tpu7x (2 ranks a
chip, 4 chips a host) (2, 1) pairs the two cores of a chip and (8, 1) spans a host. Each
collective owns:

* ``recv``: a VMEM buffer ``[2, size, B, width]``: slot [p, i] holds group member i's share for
  a use of parity p (the sender writes its own slot locally, then copies it to every peer); a
  payload narrower than ``width`` uses the leading columns;
* ``send_sem``, ``recv_sem``: DMA semaphore arrays ``(2, size)``;
* ``counter_ref[counter]``: an SMEM int32 use counter, zeroed once at kernel entry.

The caller must run ``barrier`` (with ``collective_id`` set in the compiler params) before the
first collective, and every rank of a group must make the same sequence of calls on a buffer,
so that all agree on the counter and hence on the parity.

Why reusing slot ``c % 2`` is safe: a use ends with the reads of every slot of its parity, and
only then can the rank start its next use. A peer writes parity ``c % 2`` again at use c + 2,
which it reaches only after receiving this rank's share of use c + 1, i.e. after this rank has
read use c. Receive semaphores of a parity are likewise never signalled for use c + 2 before
the wait of use c; send semaphores are drained within each use.

An all-reduce is a tuple of stages, each with its own `run` (`allreduce`): `Stage`, one-shot
(every member sends its whole partial to every peer and sums all slots), or the scattered form
`ReduceScatter`, `Stage`s on the chunk, `GatherSums`; `FromRows` picks a tuple by the kernel's
rows. The scattered form adds the same values in the same order as the one-shot stages, so
with its sums gathered in f32 its result is bit-identical: member j of the first group sums
column chunk j of the group's partials, slot by slot in group order in f32 (what a one-shot
stage does to those columns); the later stages reduce that chunk among the ranks holding the
same chunk index (the peers a one-shot later stage has), one-shot or, nested, each
reduce-scattering the chunk again; the all-gathers, in reverse, move the sums exactly. Gathered
in bf16, the result is the same sums rounded once to bf16 (the gathers after the first move
bf16 values exactly).

The reduce-scatter's receive slots ``recv [2, size, B, chunk]`` (slot [p, i]: member i's copy
of this rank's chunk) follow the protocol above: a peer sends into this rank's slot of parity
``c % 2`` only at its use c + 2, after this rank's share of use c + 1 reached it, which this
rank sends only after its sum of use c has read every slot. Its send staging ``staging [size,
B, chunk]`` (chunk j of this rank's partial, for member j; no parity) is written at the start
of each use and read only by this use's outgoing copies, all of which are waited
(``wait_send``) before the use returns, so the next use's writes never meet a copy still
reading it. Its own chunk goes from staging to its own slot by a local copy (on send semaphore
[par, 0], which no remote copy uses), waited with the sends.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.ir import scatter_chunk

F32 = jnp.float32


def barrier(axis: str, ranks: int) -> None:
    """Wait until all ``ranks`` ranks of ``axis`` are inside the kernel, so that no remote copy
    lands in the VMEM of a rank that has not started it (needs ``collective_id``)."""
    me = lax.axis_index(axis)
    sem = pltpu.get_barrier_semaphore()
    for k in range(1, ranks):
        pl.semaphore_signal(sem, 1, device_id=(lax.rem(me + k, ranks),))
    pl.semaphore_wait(sem, ranks - 1)


def enter(axis: str, ranks: int, counters) -> None:
    """Start a step's collectives: every peer inside the kernel (`barrier`), then every use
    counter of the SMEM ref `counters` at zero."""
    barrier(axis, ranks)
    for counter in range(counters.shape[0]):
        counters[counter] = 0


@dataclass(frozen=True)
class _Sent:
    """A use of a buffer whose outgoing copies are started: `land` waits for them to leave
    and for every peer's share to arrive (built only then, so a use run at once traces as
    it always has)."""

    par: jax.Array                 # the parity whose slots the use fills
    land: Callable[[], None]


def _send_shares(value: jax.Array, recv, send_sem, recv_sem, counter_ref, counter: int,
                 axis: str, size: int, stride: int) -> _Sent:
    """Write ``value`` to this rank's slot and start its copies to every group peer."""
    me = lax.axis_index(axis)
    local = lax.rem(me // stride, size)
    base = me - local * stride
    c = counter_ref[counter]
    counter_ref[counter] = c + 1
    par = lax.rem(c, 2)
    width = value.shape[-1]

    def slot(i):     # a payload narrower than the buffer uses (and moves) its leading columns
        return recv.at[par, i] if width == recv.shape[-1] else recv.at[par, i, :, :width]

    slot(local)[...] = value.astype(recv.dtype)
    sends = []
    for k in range(1, size):
        peer = base + lax.rem(local + k, size) * stride
        cp = pltpu.make_async_remote_copy(slot(local), slot(local), send_sem.at[par, k],
                                          recv_sem.at[par, local], device_id=(peer,))
        cp.start()
        sends.append(cp)

    def land() -> None:
        for cp in sends:
            cp.wait_send()
        _receive(slot, send_sem, recv_sem, par, local, base, size, stride)
    return _Sent(par, land)


def _receive(slot, send_sem, recv_sem, par, local, base, size: int, stride: int) -> None:
    """Wait for every peer's copy into its slot of parity ``par``."""
    for k in range(1, size):
        # A descriptor of the matching incoming copy; only its receive semaphore and size matter.
        src = lax.rem(local + size - k, size)
        pltpu.make_async_remote_copy(slot(src), slot(src), send_sem.at[par, k],
                                     recv_sem.at[par, src], device_id=(base + src * stride,)).wait_recv()


def _exchange(value: jax.Array, recv, send_sem, recv_sem, counter_ref, counter: int, axis: str,
              size: int, stride: int) -> jax.Array:
    """Send ``value`` to every group peer and wait for all their shares; returns the parity
    whose slots ``recv[par, i]`` now hold member i's share."""
    sent = _send_shares(value, recv, send_sem, recv_sem, counter_ref, counter, axis, size, stride)
    sent.land()
    return sent.par


def _sum_slots(recv, par, size: int, width: int) -> jax.Array:
    """The f32 sum of the slots of parity ``par``, in group order."""
    total = recv[par, 0, :, :width].astype(F32)
    for i in range(1, size):
        total = total + recv[par, i, :, :width].astype(F32)
    return total


def allreduce_stage(partial: jax.Array, recv, send_sem, recv_sem, counter_ref, counter: int,
                    axis: str, size: int, stride: int) -> jax.Array:
    """f32 sum of ``partial [B, width]`` over the group, travelling in ``recv.dtype``. All members
    add the slots in the same (group) order, so their results are bit-identical."""
    par = _exchange(partial, recv, send_sem, recv_sem, counter_ref, counter, axis, size, stride)
    return _sum_slots(recv, par, size, partial.shape[-1])


def _send_chunks(partial: jax.Array, recv, staging, send_sem, recv_sem, counter_ref,
                 counter: int, axis: str, size: int, stride: int) -> _Sent:
    """Stage chunk j of ``partial`` for member j and start the copies of each to its member
    (its own by a local copy)."""
    me = lax.axis_index(axis)
    local = lax.rem(me // stride, size)
    base = me - local * stride
    c = counter_ref[counter]
    counter_ref[counter] = c + 1
    par = lax.rem(c, 2)
    chunk = scatter_chunk(partial.shape[-1], size)
    if size * chunk > partial.shape[-1]:
        partial = jnp.pad(partial, ((0, 0), (0, size * chunk - partial.shape[-1])))
    narrow = chunk != recv.shape[-1]    # a narrower payload uses the leading columns

    def slot(i):
        return recv.at[par, i, :, :chunk] if narrow else recv.at[par, i]

    def staged(j):
        return staging.at[j, :, :chunk] if narrow else staging.at[j]

    for j in range(size):
        staged(j)[...] = partial[:, j * chunk:(j + 1) * chunk].astype(recv.dtype)
    # its own chunk to its own slot by a local copy (a vector copy from a row of `staging`
    # chosen at run time costs the kernel ~1.4 MiB of spill slots at K3's size), on send
    # semaphore [par, 0], which no remote copy uses
    own = pltpu.make_async_copy(staged(local), slot(local), send_sem.at[par, 0])
    own.start()
    sends = []
    for k in range(1, size):
        member = lax.rem(local + k, size)
        cp = pltpu.make_async_remote_copy(staged(member), slot(local), send_sem.at[par, k],
                                          recv_sem.at[par, local],
                                          device_id=(base + member * stride,))
        cp.start()
        sends.append(cp)

    def land() -> None:
        for cp in sends:
            cp.wait_send()
        own.wait()
        _receive(slot, send_sem, recv_sem, par, local, base, size, stride)
    return _Sent(par, land)


def reduce_scatter(partial: jax.Array, recv, staging, send_sem, recv_sem, counter_ref,
                   counter: int, axis: str, size: int, stride: int) -> jax.Array:
    """Member j's chunk j (`scatter_chunk` columns) of the group's f32 sum of ``partial [B,
    width]``, each member's chunk travelling in ``recv.dtype`` and the slots added in group
    order, as `allreduce_stage` adds those columns. ``staging`` is the send staging (module
    docstring)."""
    sent = _send_chunks(partial, recv, staging, send_sem, recv_sem, counter_ref, counter, axis,
                        size, stride)
    sent.land()
    return _sum_slots(recv, sent.par, size, scatter_chunk(partial.shape[-1], size))


def _concat_slots(recv, par, size: int, width: int) -> jax.Array:
    return jnp.concatenate([recv[par, i, :, :width] for i in range(size)], axis=-1)


def allgather(shard: jax.Array, recv, send_sem, recv_sem, counter_ref, counter: int, axis: str,
              size: int, stride: int) -> jax.Array:
    """The group's ``[B, width]`` shards concatenated in group order: ``[B, size * width]`` in
    ``recv.dtype``."""
    par = _exchange(shard, recv, send_sem, recv_sem, counter_ref, counter, axis, size, stride)
    return _concat_slots(recv, par, size, shard.shape[-1])


def exchange_with_sibling(share: jax.Array, recv, send_sem, recv_sem, counter_ref, counter: int,
                          axis: str) -> jax.Array:
    """Swap ``share [B, width]`` with the other core of this chip (rank ^ 1); returns both shares
    ``[B, 2 * width]``, core 0's first (``recv`` is ``[2, 2, B, width]``)."""
    return allgather(share, recv, send_sem, recv_sem, counter_ref, counter, axis, 2, 1)


# ---- named stages, as generated modules declare them -------------------------------------------
class _Landing:
    """A stage is `start` (its copies sent), `land` (waited) and `finish` (its slots read);
    `run` does the three at once."""

    def run(self, refs, value: jax.Array, axis: str) -> jax.Array:
        sent = self.start(refs, value, axis)
        sent.land()
        return self.finish(refs, sent.par, value.shape[-1])


@dataclass(frozen=True)
class Stage(_Landing):
    """One direct all-reduce stage or all-gather: over the group (size, stride) through receive
    buffer `buffer` (its send and receive semaphores are `buffer + "__send"` / `"__recv"`),
    whose use counter is `counter_ref[counter]`. As an all-reduce stage (`run`): the one-shot
    f32 sum of the value over the group (`allreduce_stage`)."""

    buffer: str
    counter: int
    size: int
    stride: int

    def start(self, refs, value: jax.Array, axis: str) -> _Sent:
        return _send_shares(value, *_stage_refs(refs, self), axis, self.size, self.stride)

    def finish(self, refs, par: jax.Array, width: int) -> jax.Array:
        return _sum_slots(getattr(refs, self.buffer), par, self.size, width)


@dataclass(frozen=True)
class ReduceScatter(_Landing):
    """The scattered form's first stage (`reduce_scatter`): `[B, width]` partials to this
    member's f32 chunk sum `[B, scatter_chunk(width, size)]`, through receive slots `buffer`
    (with its semaphores and counter, as a `Stage`'s) and send staging `staging`."""

    buffer: str
    staging: str
    counter: int
    size: int
    stride: int

    def start(self, refs, value: jax.Array, axis: str) -> _Sent:
        recv, send_sem, recv_sem, counter_ref, counter = _stage_refs(refs, self)
        return _send_chunks(value, recv, getattr(refs, self.staging), send_sem, recv_sem,
                            counter_ref, counter, axis, self.size, self.stride)

    def finish(self, refs, par: jax.Array, width: int) -> jax.Array:
        return _sum_slots(getattr(refs, self.buffer), par, self.size,
                          scatter_chunk(width, self.size))


@dataclass(frozen=True)
class GatherSums(_Landing):
    """The scattered form's last stages: the group's chunk sums concatenated in group order
    (`allgather`), in the dtype of its buffer (f32: exact). A nested form's inner gathers cut
    the result to `columns`, the chunk their group scattered (its padding columns dropped; 0:
    kept, the all-reduce's result is cut at its end)."""

    buffer: str
    counter: int
    size: int
    stride: int
    columns: int = 0

    def start(self, refs, value: jax.Array, axis: str) -> _Sent:
        return _send_shares(value, *_stage_refs(refs, self), axis, self.size, self.stride)

    def finish(self, refs, par: jax.Array, width: int) -> jax.Array:
        out = _concat_slots(getattr(refs, self.buffer), par, self.size, width)
        return out[:, :self.columns] if self.columns and self.columns < out.shape[-1] else out


AllReduceStage = Stage | ReduceScatter | GatherSums


@dataclass(frozen=True)
class FromRows:
    """An all-reduce whose kernels of at least `rows` rows run `stages` and narrower ones
    `below` (itself chosen by rows where it is a `FromRows`): the scattered form from the rows
    it scatters from, and one-shot stages through each span of widths' own buffers."""

    rows: int
    below: "tuple[AllReduceStage, ...] | FromRows"
    stages: tuple[AllReduceStage, ...]

    def at(self, rows: int) -> tuple[AllReduceStage, ...]:
        if rows >= self.rows:
            return self.stages
        return self.below.at(rows) if isinstance(self.below, FromRows) else self.below


def _stage_refs(refs, st: Stage | ReduceScatter | GatherSums) -> tuple:
    """(recv, send_sem, recv_sem, counter_ref, counter) of a stage from the refs by name."""
    return (getattr(refs, st.buffer), getattr(refs, st.buffer + "__send"),
            getattr(refs, st.buffer + "__recv"), refs.collective_count, st.counter)


def allreduce(refs, partial: jax.Array, stages: tuple[AllReduceStage, ...] | FromRows,
              axis: str) -> jax.Array:
    """All-reduce `partial [B, width]` through its stages, each run in turn (a `FromRows`'
    for B rows); `refs` holds every kernel ref by name (the buffers, their semaphores and
    `collective_count`). A scattered form's padding columns (`scatter_chunk`) are cut off."""
    if isinstance(stages, FromRows):
        stages = stages.at(partial.shape[0])
    width = partial.shape[-1]
    for st in stages:
        partial = st.run(refs, partial, axis)
    return _cut(partial, width)


class InFlight:
    """A collective started after its op (`overlap`) whose stages run while later ops compute:
    each `advance` lands the stage in flight and starts the next (at the last, nothing), and
    `finish` lands what remains and returns the result. It adds the same values in the same
    order as the collective run at once. Its buffers are its own, so no other use of them
    falls between its start and its finish (the parity argument of the module docstring)."""

    def __init__(self, refs, stages: tuple[AllReduceStage, ...], value: jax.Array, axis: str,
                 columns: int | None = None):
        self.refs, self.axis, self.rest = refs, axis, list(stages)
        self.columns = columns          # an all-reduce's width: its result cut back to it
        self._start(value)

    def _start(self, value: jax.Array) -> None:
        self.stage, self.width = self.rest.pop(0), value.shape[-1]
        self.sent = self.stage.start(self.refs, value, self.axis)

    def _land(self) -> jax.Array:
        self.sent.land()
        return self.stage.finish(self.refs, self.sent.par, self.width)

    def advance(self) -> None:
        if self.rest:
            self._start(self._land())

    def finish(self) -> jax.Array:
        value = self._land()
        while self.rest:
            self._start(value)
            value = self._land()
        return value if self.columns is None else _cut(value, self.columns)


def _cut(value: jax.Array, width: int) -> jax.Array:
    """A scattered form's result without its padding columns (`scatter_chunk`), in f32 (its
    sums may have been gathered in bf16)."""
    return (value if value.shape[-1] == width else value[:, :width]).astype(F32)


def start_allreduce(refs, partial: jax.Array, stages: tuple[AllReduceStage, ...] | FromRows,
                    axis: str) -> InFlight:
    """`allreduce` of `partial` started, to finish later (`InFlight`)."""
    if isinstance(stages, FromRows):
        stages = stages.at(partial.shape[0])
    return InFlight(refs, stages, partial, axis, columns=partial.shape[-1])


def start_gather(refs, shard: jax.Array, st: Stage, axis: str) -> InFlight:
    """`gather` of `shard` started, to finish later (`InFlight`)."""
    return InFlight(refs, (GatherSums(st.buffer, st.counter, st.size, st.stride),), shard, axis)


def gather(refs, shard: jax.Array, st: Stage, axis: str) -> jax.Array:
    """`allgather` of `shard` through a named stage (the cores of one chip: the stage (2, 1))."""
    return allgather(shard, *_stage_refs(refs, st), axis, st.size, st.stride)


def embed(refs, table, rows_buf, sem, vocab_local: int, vocab: tuple[int, int],
          stages: tuple[AllReduceStage, ...] | FromRows, axis: str, B: int) -> jax.Array:
    """Vocab-sharded embedding lookup of `refs.tokens` -> [B, hidden] f32: each rank copies the
    aligned 16-row bf16 block holding each token (a single bf16 row is not a legal DMA on TPU),
    keeps the row if its vocab part (rule `vocab` = (ways, stride)) owns the token, and the
    vocab group all-reduces (exact: one rank contributes each row, the others zeros)."""
    hidden = table.shape[-1]
    ways, stride = vocab
    lo = lax.rem(lax.axis_index(axis) // stride, ways) * vocab_local
    copies, owned, offset = [], [], []
    for b in range(B):
        tok = refs.tokens[b]
        idx = jnp.clip(tok - lo, 0, vocab_local - 1)
        base = pl.multiple_of((idx // 16) * 16, 16)
        cp = pltpu.make_async_copy(table.at[pl.ds(base, 16)], rows_buf.at[b], sem)
        cp.start()
        copies.append(cp)
        owned.append((tok >= lo) & (tok < lo + vocab_local))
        offset.append(idx - base)
    for cp in copies:
        cp.wait()
    row = lax.broadcasted_iota(jnp.int32, (16, hidden), 0)
    picked = [jnp.sum(jnp.where((row == offset[b]) & owned[b], rows_buf[b].astype(F32), 0.0),
                      axis=0, keepdims=True) for b in range(B)]
    rows = jnp.concatenate(picked, axis=0) if B > 1 else picked[0]
    return allreduce(refs, rows, stages, axis)
