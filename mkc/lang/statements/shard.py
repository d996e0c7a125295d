"""`shard CLASS over GROUP`: how a dimension class is split over ranks."""
from __future__ import annotations

from dataclasses import dataclass

from mkc.diagnostics import Span
from mkc.lang.ast import Group, Name
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
// shard <dimension class> over <group> (a shard_group: `tp`, `tp / N`, `host`, `chip`, N)
shard_stmt: "shard" NAME "over" shard_group
''')


@dataclass(frozen=True)
class Shard:
    dim: Name
    group: Group
    span: Span


@SYNTAX.statement("shard_stmt", "schedule", "shards")
def shard_stmt(b: Builder, meta: Meta, items: list) -> Shard:
    return Shard(b.name(items[0]), items[1], b.span(meta))
