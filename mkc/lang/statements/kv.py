"""`kv tiles N slots of T tokens ahead A [at layer start]`: the KV cache streamed through VMEM
in tiles; `at layer start`, the first A tiles' copies start as the layer begins rather than at
the op that reads them."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
kv_item:        "kv" "tiles" INT "slots" "of" INT "tokens" "ahead" INT kv_at_start?
kv_at_start:    "at" "layer" "start"
''')


@dataclass(frozen=True)
class KvTiles:
    slots: int
    tokens: int
    ahead: int
    span: Span
    at_start: bool = False


@SYNTAX.rule("kv_at_start")
def kv_at_start(b: Builder, meta: Meta, items: list) -> bool:
    return True


@SYNTAX.statement("kv_item", "phase", "kv_tiles")
def kv_item(b: Builder, meta: Meta, items: list) -> KvTiles:
    return KvTiles(int(items[0]), int(items[1]), int(items[2]), b.span(meta),
                   at_start=len(items) > 3)
