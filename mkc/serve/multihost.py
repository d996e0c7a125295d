"""`mkc serve` on several processes under jax.distributed: one process per host of the slice,
every one started with the same spec and model. Process 0 (the leader) owns HTTP and the
engine's scheduling; every other process (a follower) runs `follow`: it takes each launch the
leader makes, in order, and runs it with the same `Device.run` on its own ranks, so each
kernel launch is one SPMD program on every process with the same inputs.

Launches travel through the coordination service's key-value store (the one jax.distributed
starts in process 0), not a device collective such as `broadcast_one_to_all`: every wait has a
timeout (a device collective waits for a dead process forever), an idle follower waits in a
host RPC rather than inside a collective, and the CPU test exercises the same transport as a
TPU slice (no cross-process CPU collectives needed). Its cost is one small RPC before each
launch (about 0.3 ms on this machine's loopback).

Keys, under `mkc-serve/`: `config` (the leader's settings; a follower that differs refuses)
and `joined/<process>`; `launch/<epoch>/<seq>` (a launch: its sequence number, whether to
confirm it, and its `Codec` descriptor); `digest/<seq>/<process>` (a follower's confirmation).
Each process folds every launch's descriptor and its host results (sampled tokens, logprobs,
accepted counts) into a running digest. The leader asks for a confirmation every `every`
launches, when it goes idle, every `timeout / 2` seconds while idle, and at STOP; a follower
that does not confirm within `timeout` seconds (it died or hangs), or whose digest differs (it
ran something else, or computed other results), raises LockstepFailure on the leader, which
stops serving. A confirmed launch ends an epoch; the leader then deletes its keys.
"""
from __future__ import annotations

import hashlib
import json
import logging
import struct
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from mkc.serve.device import Device, Kind, Launch, result_bytes
from mkc.serve.engine import LockstepFailure

log = logging.getLogger("mkc.serve")

PREFIX = "mkc-serve"
STARTUP_SECONDS = 900.0      # loading and compiling before the first confirmation (minutes at full size)
ABORT_MS = 5000             # how long a failing process 0 waits for the others to hear it stop
# After they said they leave, how long it stays up: its exit takes the coordination service
# with it, and a process whose JAX client sees the service gone aborts (SIGABRT) instead of
# exiting with its own status.
ABORT_LINGER_S = 2.0
POLL_MS = 1000               # a follower's wait for the next launch, between checks that process 0 lives
_FRAME = struct.Struct("<qB")    # a launch's sequence number and whether to confirm it
_FAILED = b"\x00failed"          # the outcome of a launch that raised


class PeerError(RuntimeError):
    """Another process could not start, or process 0 went away: this process stops."""


@dataclass(frozen=True)
class Options:
    """How this process joins: `coordinator`, `num_processes`, `process_id` given, or all None
    (`--distributed`: jax.distributed detects them, as on Cloud TPU); `every` and `timeout`:
    the leader's confirmations (module docstring)."""

    coordinator: str | None = None
    num_processes: int | None = None
    process_id: int | None = None
    every: int = 8
    timeout: float = 60.0


def initialize(options: Options) -> tuple[int, int]:
    """jax.distributed.initialize for these options; (this process's id, the processes). JAX's
    own heartbeat stops every process when one dies; it is set longer than the leader's
    confirmations so that the leader's message comes first."""
    import jax
    jax.distributed.initialize(options.coordinator, options.num_processes, options.process_id,
                               heartbeat_timeout_seconds=int(max(100, 3 * options.timeout)))
    return jax.process_index(), jax.process_count()


def _client():
    from jax._src.distributed import global_state     # the coordination service's client
    if global_state.client is None:
        raise RuntimeError("jax.distributed is not initialized")
    return global_state.client


def _timed_out(e: Exception) -> bool:
    return "DEADLINE_EXCEEDED" in str(e)


class _Digest:
    """The running digest of every launch's descriptor and host results, equal on every
    process that ran the same launches with the same results."""

    def __init__(self):
        self.value = b"mkc-serve"

    def fold(self, words: np.ndarray, outcome: bytes) -> None:
        self.value = hashlib.blake2b(self.value + words.tobytes() + outcome, digest_size=16).digest()


def _run(device: Device, launch: Launch, digest: _Digest, words: np.ndarray) -> tuple[Any, Exception | None]:
    """One launch here, folded into the digest: (its result, or the exception it raised)."""
    try:
        result = device.run(launch)
    except Exception as e:          # noqa: BLE001 - the leader re-raises; a follower logs it
        digest.fold(words, _FAILED)
        return None, e
    digest.fold(words, result_bytes(result))
    return result, None


class Leader:
    """Process 0's side: runs each launch here after sending it to the other processes, and
    confirms they stay in step (module docstring). The engine's `Lockstep`."""

    def __init__(self, processes: int, every: int = 8, timeout: float = 60.0,
                 startup_timeout: float = STARTUP_SECONDS):
        self.processes, self.every, self.timeout = processes, every, timeout
        self.startup_timeout = max(startup_timeout, timeout)
        self._client = _client()
        self._digest = _Digest()
        self._seq = self._epoch = self._unconfirmed = 0
        self._started = False             # the followers confirmed their first launch
        self._last_confirmed = time.monotonic()
        self._joined = False
        self._lost: set[int] = set()      # processes that did not answer in time

    # ---- start and stop ------------------------------------------------------------------
    def join(self, config: dict) -> None:
        """Publish this process's settings and wait for every other process to join with the
        same ones; PeerError naming a process that differs or could not start."""
        self._client.key_value_set(f"{PREFIX}/config", json.dumps(config, sort_keys=True))
        problems = []
        for pid in range(1, self.processes):
            try:
                said = self._client.blocking_key_value_get(f"{PREFIX}/joined/{pid}",
                                                           int(self.startup_timeout * 1000))
            except Exception as e:       # noqa: BLE001
                said = (f"it did not join within {self.startup_timeout:.0f} s" if _timed_out(e)
                        else f"the coordination service failed: {e}")
            if said:
                problems.append(f"process {pid}: {said}")
        self._joined = True
        if problems:
            raise PeerError("; ".join(problems))

    def abort(self, message: str) -> None:
        """Stop the other processes after this one failed: before they joined, through the
        config they wait for; after, with a STOP launch (not confirmed). Waits a few seconds
        for them to hear it (this process's exit takes the coordination service with it)."""
        try:
            if not self._joined:
                self._client.key_value_set(f"{PREFIX}/config", json.dumps({"error": message}),
                                           allow_overwrite=True)
            else:
                self._publish(np.zeros(0, np.int32), confirm=False)     # no descriptor: stop
            for pid in sorted(set(range(1, self.processes)) - self._lost):
                self._client.blocking_key_value_get(f"{PREFIX}/left/{pid}", ABORT_MS)
            time.sleep(ABORT_LINGER_S)
        except Exception:                # noqa: BLE001 - stopping anyway
            pass

    # ---- the engine's Lockstep -----------------------------------------------------------
    def run(self, device: Device, launch: Launch) -> Any:
        words = device.codec.encode(launch)
        confirm = launch.kind in (Kind.SYNC, Kind.STOP) or self._unconfirmed + 1 >= self.every
        seq = self._publish(words, confirm)
        result, error = _run(device, launch, self._digest, words)
        if confirm:
            self._confirm(seq, launch)
        if error is not None:
            raise error
        return result

    def sync_due(self) -> float:
        if self._unconfirmed:
            return 0.0                   # a burst ended: confirm it before idling
        return self._last_confirmed + max(1.0, self.timeout / 2) - time.monotonic()

    def stop(self, device: Device) -> None:
        self.run(device, Launch(Kind.STOP))

    # ---- the key-value store -------------------------------------------------------------
    def _publish(self, words: np.ndarray, confirm: bool) -> int:
        """Send a launch; its sequence number. A launch to confirm ends its epoch (on every
        process, whether or not the confirmation comes)."""
        seq = self._seq
        frame = _FRAME.pack(seq, confirm) + words.tobytes()
        self._client.key_value_set_bytes(f"{PREFIX}/launch/{self._epoch}/{seq}", frame)
        self._seq += 1
        self._unconfirmed = 0 if confirm else self._unconfirmed + 1
        self._epoch += confirm
        return seq

    def _confirm(self, seq: int, launch: Launch) -> None:
        timeout = self.timeout if self._started else self.startup_timeout
        deadline = time.monotonic() + timeout
        what = f"launch {seq} (a {launch.kind.name.lower()} launch)"
        for pid in range(1, self.processes):
            left = max(1, int((deadline - time.monotonic()) * 1000))
            try:
                theirs = self._client.blocking_key_value_get_bytes(f"{PREFIX}/digest/{seq}/{pid}", left)
            except Exception as e:       # noqa: BLE001
                if _timed_out(e):
                    self._lost.add(pid)
                    raise LockstepFailure(
                        f"process {pid} did not confirm {what} within {timeout:.0f} s: it died, "
                        f"hangs or runs far behind (see its log)") from None
                raise LockstepFailure(f"the coordination service failed while confirming {what}: "
                                      f"{e}") from None
            if theirs != self._digest.value:
                raise LockstepFailure(
                    f"process {pid} is out of step at {what}: the launches it ran or their results "
                    f"(sampled tokens, logprobs, accepted drafts) differ from process 0's")
        self._client.key_value_delete(f"{PREFIX}/digest/{seq}")
        self._client.key_value_delete(f"{PREFIX}/launch/{self._epoch - 1}")    # every one has read it
        self._started = True
        self._last_confirmed = time.monotonic()


class Follower:
    """A follower's side: joins process 0 and runs its launches in order (`follow`)."""

    def __init__(self, process_id: int):
        self.process_id = process_id
        self._client = _client()

    def join(self, config: dict | None, problem: str | None = None) -> None:
        """Check this process's settings against process 0's and tell it (or tell it why this
        process could not start: `problem`); PeerError when they differ or process 0 gave up."""
        try:
            theirs = json.loads(self._client.blocking_key_value_get(f"{PREFIX}/config",
                                                                    int(STARTUP_SECONDS * 1000)))
        except Exception as e:           # noqa: BLE001
            raise PeerError(f"process 0 did not publish its settings ({e})") from None
        if problem is None and "error" in theirs:
            self._client.key_value_set(f"{PREFIX}/left/{self.process_id}", "")
            raise PeerError(f"process 0 could not start: {theirs['error']}")
        if problem is None:
            differ = [f"{k} {config.get(k)} here, {theirs.get(k)} on process 0"
                      for k in sorted(set(config) | set(theirs)) if config.get(k) != theirs.get(k)]
            if differ:
                problem = "started with other settings than process 0: " + "; ".join(differ)
        self._client.key_value_set(f"{PREFIX}/joined/{self.process_id}", problem or "")
        if problem is not None:
            raise PeerError(problem)

    def follow(self, device: Device) -> int:
        """Run process 0's launches until its STOP; the launches run."""
        digest, seq, epoch = _Digest(), 0, 0
        while True:
            try:
                frame = self._client.blocking_key_value_get_bytes(f"{PREFIX}/launch/{epoch}/{seq}", POLL_MS)
            except Exception as e:       # noqa: BLE001
                if _timed_out(e):
                    continue
                raise PeerError(f"process 0 went away (the coordination service: {e})") from None
            sent, confirm = _FRAME.unpack_from(frame)
            if sent != seq:
                raise PeerError(f"launch {sent} arrived where {seq} was expected")
            words = np.frombuffer(frame[_FRAME.size:], np.int32)
            if words.size == 0:          # a stop without a descriptor: process 0 failed
                self._client.key_value_set(f"{PREFIX}/left/{self.process_id}", "")
                raise PeerError(f"process 0 failed after {seq} launches (see its log)")
            launch = device.codec.decode(words)
            _, error = _run(device, launch, digest, words)
            if error is not None:
                log.error("launch %d (%s) failed here: %s", seq, launch.kind.name.lower(), error)
            if confirm:
                self._client.key_value_set_bytes(f"{PREFIX}/digest/{seq}/{self.process_id}", digest.value)
                epoch += 1
            seq += 1
            if launch.kind == Kind.STOP:
                return seq


def config_of(served: Any, batch: int, model: str, seed: int) -> dict:
    """What must be the same on every process: the generated module (spec and config), the
    batch (which sizes the descriptors), the weights' source (a checkpoint's path may differ
    between hosts; its bytes are not hashed)."""
    from pathlib import Path
    source = Path(served.gen.__file__).read_bytes() if getattr(served.gen, "__file__", None) else b""
    return {"module": hashlib.sha256(source).hexdigest()[:16], "batch": batch,
            "weights": "checkpoint" if Path(model).is_dir() else f"random_weights({seed}) of {model}"}
