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
import types
from collections.abc import Iterator

import jax

from mkc.model.contracts import body_of

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
    """A family's lowering module whose bodies, called as `lower.<op>(c, ...)` with a layer
    context `c` first, run `BODIES[(c.kind, op)]` (`mkc.layers.sublayer.body_table`) in their
    op's scope; its other attributes (the kernel-wide `prologue`, `final_hidden`, constants)
    pass through unchanged."""

    def __init__(self, module: types.ModuleType) -> None:
        self._module = module

    def body(self, kind: str, name: str):
        """The function op `name` of layer kind `kind` runs (unwrapped from its scope)."""
        return body_of(self._module, kind, name)

    def __getattr__(self, name: str):
        if not any(op == name for _, op in getattr(self._module, "BODIES", {})):
            attribute = getattr(self._module, name, None)
            if attribute is None:
                raise AttributeError(f"{self._module.__name__} has no body or attribute {name}")
            return attribute

        def in_scope(c, *args, **kwargs):
            kind = getattr(c, "kind", None)
            body = body_of(self._module, kind, name)
            if body is None:
                raise AttributeError(f"{self._module.__name__} has no body of {kind}.{name}")
            with op(kind, name):
                return body(c, *args, **kwargs)
        in_scope.__name__ = name
        return in_scope


def named_ops(module: types.ModuleType) -> NamedOps:
    return NamedOps(module)
