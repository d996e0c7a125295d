"""The header settings: model, target, mesh, batch, verify, context, vmem. Each is a
`Setting` (a value and its span) under its keyword in `Schedule.settings`, set at most once."""
from __future__ import annotations

from mkc.lang.ast import Setting
from mkc.lang.syntax import Builder, Meta, Syntax

SYNTAX = Syntax(r'''
model_stmt:   "model" STRING
// a TPU generation (v5e, v5p, v6e, tpu7x, ...) and its chip grid
target_stmt:  "target" NAME "topology" TOPOLOGY
mesh_stmt:    "mesh" NAME "=" INT
batch_stmt:   "batch" INT ("to" INT)?
// A verify step: up to N rows per sequence (an anchor and its drafts) at consecutive
// positions, for a range of sequences (default 1), with the state after every row kept.
verify_stmt:  "verify" INT ("sequences" INT ("to" INT)?)?
context_stmt: "context" INT
vmem_stmt:    "vmem" "limit" size "reserve" size
''')


@SYNTAX.statement("model_stmt", "schedule", "model", setting=True)
def model_stmt(b: Builder, meta: Meta, items: list) -> Setting:
    return Setting(str(items[0])[1:-1], b.span(meta))


@SYNTAX.statement("target_stmt", "schedule", "target", setting=True)
def target_stmt(b: Builder, meta: Meta, items: list) -> Setting:
    # (generation, (topology text with its span, dimensions)): how many dimensions a
    # generation takes is resolve's business
    return Setting((b.name(items[0]), items[1]), b.span(meta))


@SYNTAX.statement("mesh_stmt", "schedule", "mesh", setting=True)
def mesh_stmt(b: Builder, meta: Meta, items: list) -> Setting:
    return Setting((b.name(items[0]), int(items[1])), b.span(meta))


@SYNTAX.statement("batch_stmt", "schedule", "batch", setting=True)
def batch_stmt(b: Builder, meta: Meta, items: list) -> Setting:
    lo = int(items[0])
    hi = int(items[1]) if len(items) > 1 else lo
    return Setting((lo, hi), b.span(meta))


@SYNTAX.statement("verify_stmt", "schedule", "verify", setting=True)
def verify_stmt(b: Builder, meta: Meta, items: list) -> Setting:
    lo = int(items[1]) if len(items) > 1 else 1
    hi = int(items[2]) if len(items) > 2 else lo
    return Setting((int(items[0]), (lo, hi)), b.span(meta))


@SYNTAX.statement("context_stmt", "schedule", "context", setting=True)
def context_stmt(b: Builder, meta: Meta, items: list) -> Setting:
    return Setting(int(items[0]), b.span(meta))


@SYNTAX.statement("vmem_stmt", "schedule", "vmem", setting=True)
def vmem_stmt(b: Builder, meta: Meta, items: list) -> Setting:
    return Setting((items[0], items[1]), b.span(meta))


