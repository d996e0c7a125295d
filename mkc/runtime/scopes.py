"""Names the emitted kernel gives its work, so the step-time model can count each op's cost
from the kernel itself (`mkc.perf.work`) rather than from a hand table.

Every compute body a generated module calls runs inside the JAX name scope
`mkc_op:<layer kind>.<op>` (kind `tail` for the embedding, final norm and lm_head), which
tracing records on every equation it emits. Inside an op, the work a weight read brings (the
MXU dot of one ring tile, pooled matrix or expert slot, with any in-kernel decode and the
accumulation) runs under `mkc_weights`, and the work of one KV tile under `mkc_kv_tile`: the
model charges those where the trace reads weights and KV tiles, the rest where the op begins.
"""
from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Iterator

import jax

OP = "mkc_op"
WEIGHTS = "mkc_weights"
KV_TILE = "mkc_kv_tile"
TAIL = "tail"


def op_scope_name(kind: str, op: str) -> str:
    return f"{OP}:{kind}.{op}"


@contextlib.contextmanager
def op(kind: str, name: str) -> Iterator[None]:
    """The work of op `name` of layer kind `kind` (or `TAIL`)."""
    with jax.named_scope(op_scope_name(kind, name)):
        yield


def weights() -> contextlib.AbstractContextManager:
    """The work one weight read brings (per value read; see the module docstring)."""
    return jax.named_scope(WEIGHTS)


def kv_tile() -> contextlib.AbstractContextManager:
    """The work of one KV tile of an attention op."""
    return jax.named_scope(KV_TILE)


class NamedOps:
    """A family's lowering module whose functions, called with a layer context (anything with
    a `kind`) first, run in their op's scope; other attributes pass through unchanged."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def __getattr__(self, name: str):
        fn = getattr(self._module, name)
        if not callable(fn) or isinstance(fn, type):
            return fn

        @functools.wraps(fn)
        def in_scope(c, *args, **kwargs):
            kind = getattr(c, "kind", None)
            if not isinstance(kind, str):
                return fn(c, *args, **kwargs)
            with op(kind, name):
                return fn(c, *args, **kwargs)
        return in_scope


def named_ops(module: types.ModuleType) -> NamedOps:
    return NamedOps(module)
