"""`kv ring N slots`: a layer kind's KV cache kept in HBM as a ring of its attention window's
last positions (a sliding-window layer's), rather than one slot per token of the context."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// The window's KV ring of a layer kind that attends to its last W positions only (GPT-OSS's
// sliding layers): `kv ring 144 slots` keeps its KV cache in HBM as 144 token slots, position p
// in slot p % 144, whatever the context. The phase's `kv tiles` stream the ring (its tile a
// divisor of the slots) and the kernel masks each slot by the position it holds. The checks
// prove the ring holds every row's window: W slots when decoding, W + R - 1 for a verify step
// of R rows a sequence (its last row's write must not overwrite its first row's window).
kv_ring:        "kv" "ring" INT "slots"
''')


@dataclass(frozen=True)
class KvRing:
    slots: int
    span: Span


@SYNTAX.statement("kv_ring", "phase", "kv_rings")
def kv_ring(b: Builder, meta: Meta, items: list) -> KvRing:
    return KvRing(int(items[0]), b.span(meta))
