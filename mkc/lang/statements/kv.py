"""`kv tiles N slots of T tokens ahead A`: the KV cache streamed through VMEM in tiles."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
kv_item:        "kv" "tiles" INT "slots" "of" INT "tokens" "ahead" INT
''')


@dataclass(frozen=True)
class KvTiles:
    slots: int
    tokens: int
    ahead: int
    span: Span


@SYNTAX.statement("kv_item", "phase", "kv_tiles")
def kv_item(b: Builder, meta: Meta, items: list) -> KvTiles:
    return KvTiles(int(items[0]), int(items[1]), int(items[2]), b.span(meta))
