"""Resolve a parsed schedule against the model graph and target into the schedule IR."""
from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import keyword
import re
import sys
from pathlib import Path

from mkc import ir, target
from mkc.diagnostics import MkcError, Span, fail
from mkc.lang import ast
from mkc.model import registry as families
from mkc.model.config import dims_from_config, read_config, resolve_config_path
from mkc.model.family import FormatError
from mkc.model.graph import DecodeGraph, ShardingError, build_graph
from mkc.model.sharding import ShardTable

ALLREDUCE_ALGORITHMS = ("direct", "two_level")
TWO_LEVEL_GROUPS = ("chip", "host")
WIRE_DTYPES = ("bf16", "f32")
RING_DTYPES = ("bf16",)
# No "__": generated code joins names with a double underscore, so user names cannot collide.
_IDENT = re.compile(r"^[a-z](?:_?[a-z0-9])*$")
# Names the generated module defines itself; a spec buffer may not shadow them.
# (A family's VMEM activations, e.g. K3's `blocks`, are reserved too: see _validate_identifier.)
_RESERVED = {"x", "stage", "acc", "ring", "vectors", "logits", "state", "start", "end",
             "embed", "embed_rows", "head_norm", "tables", "tokens", "positions", "rope",
             "ring_hbm", "vectors_hbm", "head_norm_hbm", "ring_sem", "vectors_sem", "sems",
             "send_sem", "recv_sem", "collective_count", "tile_class", "pool_sem", "expert_sem",
             "expert_list", "expert_count"}
MAX_NAME = 64          # a schedule's name becomes a file name, with the model's appended
# Cost-model constant for choosing the ring tile: what one extra DMA costs, in bytes moved.
TILE_OVERHEAD_BYTES = 64 * 1024


def _did_you_mean(word: str, options: list[str]) -> str:
    import difflib
    close = difflib.get_close_matches(word, options, n=1)
    return f"did you mean '{close[0]}'? " if close else ""


def _unknown(what: str, name: ast.Name, options: list[str]) -> MkcError:
    return fail("E-UNKNOWN", f"unknown {what} '{name.text}'", name.span,
                hint=_did_you_mean(name.text, options) + f"known: {', '.join(options) or 'none'}")


def _require(sched: ast.Schedule, key: str, example: str) -> ast.Setting:
    if key not in sched.settings:
        raise fail("E-MISSING", f"the schedule does not set '{key}'", sched.name.span,
                   hint=f"add a line like `{example}`")
    return sched.settings[key]


def _validate_identifier(name: ast.Name, what: str, graph: DecodeGraph | None = None) -> str:
    """A spec name that becomes a generated identifier; with the graph, the family's VMEM
    activation buffers are taken too."""
    text = name.text
    reserved = _RESERVED | (set(graph.activations) if graph is not None else set())
    if not _IDENT.match(text) or keyword.iskeyword(text) or text in reserved:
        raise fail("E-NAME", f"'{text}' cannot name a {what}", name.span,
                   hint="use lower-case letters and digits joined by single '_', starting with "
                        "a letter, not a Python keyword or one of: "
                        + ", ".join(sorted(reserved)))
    return text


def _choose_tile(rows: int, cols: int, max_rows: int, max_cols: int) -> tuple[int, int]:
    """A family's tile: multiples of 128 within the ring bound, minimising the bytes its
    copies move (padding included) plus a per-copy overhead; ties go to larger tiles."""
    best = None
    # A tile larger than the matrix rounded up to 128 only adds padding, so the search stops
    # there: its cost is bounded by the matrix, not by the ring's bound.
    for r in range(128, min(max_rows, max(128, -(-rows // 128) * 128)) + 1, 128):
        for c in range(128, min(max_cols, max(128, -(-cols // 128) * 128)) + 1, 128):
            n = -(-rows // r) * -(-cols // c)
            key = (n * (r * c * 2 + TILE_OVERHEAD_BYTES), -r * c, -c)
            if best is None or key < best[0]:
                best = (key, (r, c))
    return best[1]


def _group(g: ast.Group, axis: str, topo: target.Topology) -> tuple[int, int]:
    """A rank group as (ways, stride): rank r is in part (r // stride) % ways."""
    n = topo.num_cores
    if g.name is None:
        if g.ways < 1 or n % g.ways:
            raise fail("E-SHARD", f"{g.ways} ways do not divide the {n} ranks", g.span,
                       hint=f"use a divisor of {n}, `{axis}`, `host` or `chip`")
        return (g.ways, 1)
    text = g.name.text
    if text == axis:
        if g.divisor is None:
            return (n, 1)
        if g.divisor < 1 or n % g.divisor:
            raise fail("E-SHARD", f"{axis} / {g.divisor} does not divide the {n} ranks into "
                       "groups", g.span, hint=f"use a divisor of {n}")
        return (n // g.divisor, g.divisor)
    if g.divisor is not None:
        raise fail("E-SHARD", f"only the mesh axis can be divided, not '{text}'", g.span,
                   hint=f"write `{axis} / {g.divisor}`")
    if text == "host":
        return (topo.cores_per_host, 1)
    if text == "chip":
        return (topo.chip.cores_per_chip, 1)
    raise _unknown("rank group", g.name, [axis, "host", "chip"])


def _group_spellings(axis: str, topo: target.Topology) -> dict[str, tuple[int, int]]:
    """Every way to write a rank group on this mesh, with the (ways, stride) it means."""
    n = topo.num_cores
    divisors = [d for d in range(2, n) if n % d == 0]
    out = {axis: (n, 1)}
    out |= {str(w): (w, 1) for w in reversed(divisors)}
    out |= {f"{axis} / {d}": (n // d, d) for d in divisors}
    out |= {name: (w, 1) for name, w in (("host", topo.cores_per_host),
                                          ("chip", topo.chip.cores_per_chip)) if 1 < w < n}
    return out


def _resolve_formats(sched: ast.Schedule, family, chip: str) -> dict[str, ir.WeightFormat]:
    """Every matrix class with a choice of format -> the one the spec picks (`format CLASS
    FORMAT`), else the checkpoint's; each with what the target's MXU takes."""
    offered = dict(family.weight_formats)
    fp8_operand = target.generation(chip).fp8_operand
    chosen = {cls: dataclasses.replace(f, fp8_operand=fp8_operand)
              for cls, f in family.default_formats().items()}
    seen: dict[str, Span] = {}
    for f in sched.formats:
        cls = f.matrix.text
        if cls not in offered:
            if not offered:
                raise fail("E-FORMAT", f"the {family.name} family stores every matrix one way: "
                           f"{cls} has no other format", f.matrix.span,
                           hint="remove the `format` line")
            raise _unknown(f"matrix class with a choice of format in {family.name}", f.matrix,
                           list(offered))
        if cls in seen:
            raise fail("E-DUPLICATE", f"the format of {cls} is set twice", f.span,
                       hint=f"keep one `format {cls}` line (the first is at line "
                            f"{seen[cls].line})")
        if f.format.text not in offered[cls]:
            raise fail("E-FORMAT", f"{cls} cannot be stored as {f.format.text!r}", f.format.span,
                       hint=f"{cls} takes {', '.join(offered[cls])} (the first is the "
                            "checkpoint's)")
        if f.block is not None and f.block < 1:
            raise fail("E-FORMAT", f"a block of {f.block} rows holds nothing", f.span,
                       hint="a block is the input rows one scale covers: e.g. `block 512`")
        seen[cls] = f.span
        chosen[cls] = ir.WeightFormat(f.format.text, f.block or 0, fp8_operand)
    return chosen


def _format_error(e: FormatError, sched: ast.Schedule) -> MkcError:
    span = next((f.span for f in sched.formats if f.matrix.text == e.cls), sched.name.span)
    return fail("E-FORMAT", str(e), span, hint=e.hint)


def _valid_spellings(cls: str, rules: dict[str, tuple[int, int]], family, dims, axis: str,
                     topo: target.Topology, formats: dict[str, ir.WeightFormat]) -> list[str]:
    """The groups `cls` could be sharded over on this mesh, other rules unchanged, for which
    the family's graph builds (only on the failure path: a build costs microseconds)."""
    valid = []
    for text, group in _group_spellings(axis, topo).items():
        try:
            family.build(dims, rules | {cls: group}, topo.num_cores, formats)
        except (ShardingError, FormatError):
            continue
        valid.append((-group[0], group[1], text))
    return [text for *_, text in sorted(valid)]      # the widest split first


def _resolve_target(tgt: ast.Setting) -> target.Topology:
    """`target GEN topology GRID`: a generation JAX and libtpu know, and a grid libtpu lays
    out; anything else is a diagnostic at the statement, listing what would do."""
    gen, (grid, dims) = tgt.value
    if gen.text in target.all_generations() and gen.text not in target.known_chips():
        raise fail("E-TARGET", f"unsupported TPU generation '{gen.text}': "
                   f"{target.generation(gen.text).unsupported}", gen.span,
                   hint=f"generations mkc compiles for: {', '.join(target.known_chips())}")
    if gen.text not in target.known_chips():
        raise fail("E-TARGET", f"unknown TPU generation '{gen.text}'", gen.span,
                   hint=_did_you_mean(gen.text, target.known_chips())
                   + f"generations mkc compiles for: {', '.join(target.known_chips())}")
    try:
        return target.topology(gen.text, dims)
    except target.TargetError as e:
        raise fail("E-TARGET", e.message, grid.span, hint=e.hint) from None


def _point(p: ast.Point, ops: list[str], kind: str) -> int:
    a = p.anchor.text
    if p.where == "at":
        if a == "start":
            return 0
        if a == "end":
            return len(ops)
        raise fail("E-UNKNOWN", f"unknown program point 'at {a}'", p.anchor.span,
                   hint="use 'at start', 'at end', 'before OP' or 'after OP'")
    if a not in ops:
        raise _unknown(f"op of layer kind {kind}", p.anchor, ops)
    i = ops.index(a)
    return i if p.where == "before" else i + 1


def _validate_module_name(name: ast.Name) -> str:
    """The schedule's name becomes a Python module (`generated/NAME.py`): it must be importable
    and must not shadow the standard library, a builtin or what the module itself imports."""
    text = name.text
    taken = (keyword.iskeyword(text) or keyword.issoftkeyword(text)
             or text in sys.stdlib_module_names or text in dir(builtins)
             or text in ("mkc", "jax", "jaxlib", "numpy", "ml_dtypes", "generated"))
    if not _IDENT.match(text) or taken or len(text) > MAX_NAME:
        raise fail("E-NAME", f"'{text}' cannot name a schedule: it becomes the generated module's "
                   "name" + (", which would shadow a module or name Python already has" if taken
                             else ""), name.span,
                   hint=f"use at most {MAX_NAME} lower-case letters and digits joined by single "
                        "'_', starting with a letter, e.g. `schedule qwen_decode`")
    return text


def smallest_topology(sched: ast.Schedule, model_override: str | None = None) -> str | None:
    """The smallest standard slice of the spec's generation on which the spec, with its mesh
    over every rank, resolves (its shard rules divide) and its HBM per chip fits; None if no
    slice up to the pod does. A resolve costs milliseconds, so this is cheap on the failure
    paths that call it."""
    from mkc.checks.capacity import check_hbm
    tgt, mesh = sched.settings.get("target"), sched.settings.get("mesh")
    if tgt is None or mesh is None or tgt.value[0].text not in target.known_chips():
        return None
    gen = tgt.value[0].text
    for shape in target.standard_shapes(gen):
        dims = tuple(int(d) for d in shape.split("x"))
        ranks = target.topology(gen, dims).num_cores
        settings = dict(sched.settings)
        settings["target"] = ast.Setting((tgt.value[0], (ast.Name(shape, tgt.span), dims)),
                                         tgt.span)
        settings["mesh"] = ast.Setting((mesh.value[0], ranks), mesh.span)
        try:
            s = resolve(dataclasses.replace(sched, settings=settings), model_override,
                        suggest=False)
        except MkcError:
            continue
        if not check_hbm(s):
            return f"{gen} topology {shape} (mesh {mesh.value[0].text} = {ranks})"
    return None


def with_smallest_topology(hint: str, sched: ast.Schedule, model_override: str | None) -> str:
    found = smallest_topology(sched, model_override)
    return hint + (f"; the smallest slice that works: `{found}`" if found else
                   "; no slice of this generation fits the spec as written")


def resolve(sched: ast.Schedule, model_override: str | None = None, *,
            suggest: bool = True) -> ir.ScheduleIR:
    """The schedule IR; `suggest` lets a diagnostic about the slice's size name the smallest
    slice that would work (off inside that search)."""
    _validate_module_name(sched.name)
    spec_dir = Path(sched.source_file).parent
    model_setting = _require(sched, "model", 'model "qwen3_8_27b"')
    model_name = model_override or model_setting.value
    config_path = resolve_config_path(model_name, spec_dir if not model_override else None)
    config = read_config(config_path, model_setting.span)
    dims = dims_from_config(config, config_path, model_setting.span)

    tgt = _require(sched, "target", "target tpu7x topology 2x2x1")
    topo = _resolve_target(tgt)
    chip_name, topo_text = topo.chip.name, topo.shape

    mesh = _require(sched, "mesh", "mesh tp = 8")
    axis_name, ranks = mesh.value
    axis = _validate_identifier(axis_name, "mesh axis")
    if ranks != topo.num_cores:
        raise fail("E-MESH", f"mesh {axis} = {ranks} does not match the {topo.num_cores} "
                   f"TensorCores of {chip_name} {topo_text}", mesh.span,
                   hint=f"use `mesh {axis} = {topo.num_cores}` or a topology with {ranks} cores "
                        f"({topo.chip.cores_per_chip} per {chip_name} chip)")

    batch = _require(sched, "batch", "batch 1 to 8")
    b_lo, b_hi = batch.value
    if not 1 <= b_lo <= b_hi:
        raise fail("E-BATCH", f"batch range {b_lo} to {b_hi} is empty or starts below 1",
                   batch.span, hint="write `batch 1` or `batch 1 to 8`")
    context = _require(sched, "context", "context 4096")
    if context.value < 1:
        raise fail("E-CONTEXT", f"context {context.value} leaves no room for the token being "
                   "decoded", context.span, hint="the context is the KV cache length in tokens: "
                   "e.g. `context 4096`")
    verify_rows, verify_sequences = _resolve_verify(sched, b_lo, b_hi, context.value)
    vmem = _require(sched, "vmem", "vmem limit 64 MiB reserve 6 MiB")
    limit, reserve = vmem.value
    if limit.value > topo.chip.vmem_bytes:
        raise fail("E-VMEM-LIMIT", f"vmem limit {limit.value >> 20} MiB exceeds the "
                   f"{topo.chip.vmem_bytes >> 20} MiB of VMEM per {chip_name} TensorCore",
                   limit.span, hint=f"use at most {topo.chip.vmem_bytes >> 20} MiB")
    if reserve.value >= limit.value:
        raise fail("E-VMEM-LIMIT", "vmem reserve leaves no room under the limit", reserve.span,
                   hint="the reserve is headroom for compiler scratch: a few MiB")

    # --- sharding -------------------------------------------------------------------------
    family = families.get(dims.family)
    classes = family.shard_classes
    rules: dict[str, tuple[int, int]] = {}
    shard_span: dict[str, Span] = {}
    for s in sched.shards:
        if s.dim.text not in classes:
            raise _unknown(f"dimension class of {dims.family}", s.dim, list(classes))
        if s.dim.text in rules:
            raise fail("E-DUPLICATE", f"{s.dim.text} is sharded twice", s.span,
                       hint="keep one `shard` line per dimension class")
        rules[s.dim.text] = _group(s.group, axis, topo)
        shard_span[s.dim.text] = s.span
    unsharded = [c for c in classes if c not in rules]
    if unsharded:
        raise fail("E-SHARD", f"{', '.join(unsharded)} must be sharded: the {dims.family} "
                   "lowering places every dimension class", sched.name.span,
                   hint=f"add `shard {unsharded[0]} over {axis}`")
    shards = ShardTable.of(rules, ranks)
    formats = _resolve_formats(sched, family, chip_name)
    try:
        graph = build_graph(dims, family.build(dims, rules, ranks, formats), ranks)
    except ShardingError as e:
        span = shard_span.get(e.dim_class or "", next(iter(shard_span.values()), sched.name.span))
        valid = (_valid_spellings(e.dim_class, rules, family, dims, axis, topo, formats)
                 if e.dim_class in rules else [])
        hint = (f"on these {ranks} ranks, with the other rules as written, write "
                f"`shard {e.dim_class} over {valid[0]}`"
                + (f" (or over {', '.join(valid[1:])})" if valid[1:] else "")
                if valid else "choose a mesh whose size divides the model's head and width counts")
        raise fail("E-SHARD", f"cannot shard {dims.name} over {ranks} ranks: {e}", span,
                   hint=with_smallest_topology(hint, sched, model_override) if suggest
                   else hint) from None
    except FormatError as e:
        raise _format_error(e, sched) from None

    missing_kinds = [k for k in sorted(set(dims.layer_kinds))
                     if k not in {p.kind.text for p in sched.phases}]
    phase_by_kind: dict[str, ast.Phase] = {}
    for p in sched.phases:
        if p.kind.text not in graph.kinds:
            raise _unknown("layer kind", p.kind, sorted(graph.kinds))
        if p.kind.text in phase_by_kind:
            raise fail("E-DUPLICATE", f"phase {p.kind.text} is written twice", p.kind.span,
                       hint="merge the two phase blocks")
        phase_by_kind[p.kind.text] = p
    if missing_kinds:
        raise fail("E-MISSING", f"no phase for layer kind(s) {', '.join(missing_kinds)} of "
                   f"{dims.name}", sched.name.span,
                   hint=f"add `phase {missing_kinds[0]} {{ ... }}` with its allreduces and state copies")

    pools, pooled = _resolve_pools(sched, graph)
    stream = _resolve_stream(sched, graph, pooled)
    parity = _resolve_parity(sched, graph)

    B = b_hi
    H = dims.hidden_size
    buffers: list[ir.Buffer] = [
        ir.Buffer(stream.ring, "ring", (stream.slots, stream.tile_rows, stream.tile_cols),
                  stream.dtype, span=sched.rings[0].span),
        ir.Buffer("vectors", "parity", (2, parity.rows, parity.cols), "f32", span=parity.span),
        ir.Buffer("x", "activation", (B, H), "f32", batch_axis=0),
        # Embedding rows arrive as aligned 16-row bf16 blocks (the DMA granule for bf16).
        ir.Buffer("embed_rows", "activation", (B, ir.SUBLANE_TILE["bf16"], H), "bf16",
                  batch_axis=0),
        # The final norm weight, one row (padded to a full f32 tile so its DMA is aligned).
        ir.Buffer("head_norm", "parity", (8, H), "f32"),
    ]
    all_fams = [f for fs in stream.families.values() for f in fs] + stream.tail
    buffers.append(ir.Buffer("stage", "activation",
                             (max(f.row_tiles for f in all_fams), B, stream.tile_rows), "bf16",
                             batch_axis=1))
    buffers.append(ir.Buffer("acc", "activation",
                             (max(f.col_tiles for f in all_fams), B, stream.tile_cols), "f32",
                             batch_axis=1))

    for name, (shape, dtype) in sorted(graph.activations.items()):
        axis_b = shape.index(-1)
        buffers.append(ir.Buffer(name, "activation", tuple(B if d == -1 else d for d in shape),
                                 dtype, batch_axis=axis_b))
    for pool in pools:
        buffers.append(ir.Buffer(pool.name, "pool", (pool.nbytes // 256, ir.LANES), "bf16",
                                 span=pool.span))

    kinds: dict[str, ir.KindSchedule] = {}
    # Receive buffers per all-reduce stage shape, as wide as the widest payload.
    stage_width: dict[tuple[str, int, int], int] = {}
    for kname in sorted(graph.kinds):
        if kname not in dims.layer_kinds:
            continue
        ks, kbufs = _resolve_phase(phase_by_kind[kname], graph, topo, B, context.value, axis,
                                   shards, pools, pooled.get(kname, {}))
        kinds[kname] = ks
        buffers.extend(kbufs)
        for a in ks.allreduces:
            for size, stride in a.stages:
                key = (a.wire_dtype, size, stride)
                stage_width[key] = max(stage_width.get(key, 0), a.width)
    _check_view_copies(dims.layer_kinds, kinds, phase_by_kind, pools)
    unlowered = sorted({op for k in kinds.values() for op in k.ops} - family.lowered_ops)
    if unlowered:        # the family's graph and lowering disagree: a family's bug, not the spec's
        raise ValueError(f"the {family.name} lowering has no compute body for ops {unlowered}")
    # The vocab-sharded embedding lookup is an exact all-reduce over the vocab group (one rank
    # of it holds each row): it reuses the first all-reduce over that group (the first
    # layer's first, on a whole-mesh vocabulary), so it adds no receive buffer.
    vocab_group = shards.rule("vocab")
    same_group = [a for k in dict.fromkeys(dims.layer_kinds) for a in kinds[k].allreduces
                  if _group_of(a.stages) == vocab_group]
    embed_reduce = (dataclasses.replace(same_group[0], after_op="embed", width=H) if same_group
                    else ir.AllReduce("embed", "direct", "bf16", (vocab_group,), H))
    for size, stride in embed_reduce.stages:
        key = (embed_reduce.wire_dtype, size, stride)
        stage_width[key] = max(stage_width.get(key, 0), H)
    for (wire, size, stride), width in sorted(stage_width.items()):
        buffers.append(ir.Buffer(ir.AllReduce.buffer_name(wire, size, stride), "collective",
                                 (2, size, B, width), wire, batch_axis=2))
    buffers.append(ir.Buffer("logits", "output",
                             (stream.tail[0].col_tiles, B, stream.tail[0].tile_cols), "f32",
                             batch_axis=1))
    names = [b.name for b in buffers]
    dup = next((n for n in names if names.count(n) > 1), None)
    if dup:
        raise fail("E-DUPLICATE", f"buffer '{dup}' is declared twice", sched.name.span,
                   hint="give each VMEM buffer its own name")

    hbm = _hbm_bytes(graph, stream, parity, pools, B, context.value,
                     verify_rows * verify_sequences[1])
    return ir.ScheduleIR(
        name=sched.name.text, source=sched.source_file, model=dims.name,
        family=dims.family, dims=dims.__dict__ | {"layer_kinds": list(dims.layer_kinds)},
        model_config=config,
        chip=chip_name, topology=topo.spec, mesh_axis=axis, ranks=ranks,
        cores_per_chip=topo.chip.cores_per_chip, batch_min=b_lo, batch_max=b_hi,
        verify_rows=verify_rows, verify_sequences=verify_sequences,
        weight_formats=dict(graph.formats),
        family_package=family.package, dims_class=family.dims_import,
        compiler_scratch=family.compiler_scratch,
        vmem_inputs=tuple(family.vmem_inputs(dims, b_hi)),
        context=context.value, vmem_limit=limit.value, vmem_reserve=reserve.value,
        vmem_capacity=topo.chip.vmem_bytes, hbm_per_core=topo.chip.hbm_bytes,
        layer_kinds=list(dims.layer_kinds), kinds=kinds, buffers=buffers, stream=stream,
        parity=parity,
        globals={n: (t.shape, t.dtype) for n, t in graph.globals.items()},
        hbm_bytes_per_rank=hbm, per_rank=dict(graph.per_rank), pools=pools,
        shards={c: (w, st) for c, w, st in shards.rules},
        embed_reduce=embed_reduce,
        experts={n: (t.shape, t.dtype) for n, t in graph.experts.items()},
        top_k=graph.top_k, experts_total=graph.experts_total,
        setting_spans={k: v.span for k, v in sched.settings.items()},
        config_digest=hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest(),
        matrix_facts={f"{prefix}.{t.name}": t.mxu for prefix, tensors in
                      [(k, kd.tensors) for k, kd in graph.kinds.items()] + [("expert", graph.experts)]
                      for t in tensors.values() if t.mxu is not None})


def _pooled_bytes(rows: int, cols: int, dtype: str) -> int:
    """Bytes of a matrix in a pool; the layout (128-lane bf16 column panels of whole tiles,
    u8 data two rows per element) is defined once, in `mkc.runtime.pool`."""
    return ir.pooled_rows(rows, cols, dtype) * ir.POOL_ROW_BYTES


def _resolve_pools(sched: ast.Schedule, graph: DecodeGraph
                   ) -> tuple[list[ir.Pool], dict[str, dict[str, str]]]:
    """The pools and, per layer kind, which matrix family lives in which `pool.view`."""
    pools: list[ir.Pool] = []
    pooled: dict[str, dict[str, str]] = {}
    for p in sched.pools:
        pname = _validate_identifier(p.name, "pool", graph)
        if any(q.name == pname for q in pools):
            raise fail("E-DUPLICATE", f"pool '{pname}' is declared twice", p.name.span,
                       hint="give each pool its own name")
        views: list[ir.PoolView] = []
        for v in p.views:
            vname = _validate_identifier(v.name, "pool view")
            if any(w.name == vname for w in views):
                raise fail("E-DUPLICATE", f"view '{vname}' of pool {pname} is declared twice",
                           v.name.span, hint="give each view its own name")
            if v.slot_of is not None:
                if v.slot_of.text != "expert":
                    raise _unknown("slot content", v.slot_of, ["expert"])
                if not graph.experts:
                    raise fail("E-POOL", f"{graph.dims.name} has no routed experts to hold",
                               v.slot_of.span, hint="remove the slot view")
                if v.slots < 1:
                    raise fail("E-POOL", "a slot view needs at least one slot", v.span,
                               hint="e.g. `view experts: 4 slots of expert`")
                mats, off = [], 0
                for t in graph.experts.values():
                    mats.append(ir.PooledMatrix("expert", t.name, t.shape[0], t.shape[1],
                                                t.dtype, off))
                    off += _pooled_bytes(*t.shape, t.dtype)
                views.append(ir.PoolView(vname, pname, {"expert": mats}, v.slots, off,
                                         off * v.slots, v.span))
                continue
            matrices: dict[str, list[ir.PooledMatrix]] = {}
            for vk in v.kinds:
                kname = vk.kind.text
                if kname not in graph.kinds:
                    raise _unknown("layer kind", vk.kind, sorted(graph.kinds))
                if kname in matrices:
                    raise fail("E-DUPLICATE", f"{kname} is listed twice in view {vname}",
                               vk.kind.span, hint="list each kind's matrices once")
                kind = graph.kinds[kname]
                order = [t.name for t in kind.tensors.values() if t.role == "matrix"]
                mats, off = [], 0
                for n in vk.families:
                    if n.text not in order:
                        raise _unknown(f"matrix family of {kname}", n, order)
                    if n.text in pooled.get(kname, {}):
                        raise fail("E-DUPLICATE", f"{kname}.{n.text} is already held in "
                                   f"{pooled[kname][n.text]}", n.span,
                                   hint="a matrix lives in one view")
                    t = kind.tensors[n.text]
                    mats.append(ir.PooledMatrix(kname, t.name, t.shape[0], t.shape[1], t.dtype,
                                                off))
                    off += _pooled_bytes(*t.shape, t.dtype)
                    pooled.setdefault(kname, {})[n.text] = f"{pname}.{vname}"
                matrices[kname] = mats
            views.append(ir.PoolView(vname, pname, matrices, 0, 0,
                                     max(sum(_pooled_bytes(m.rows, m.cols, m.dtype) for m in ms)
                                         for ms in matrices.values()), v.span))
        pools.append(ir.Pool(pname, max(v.nbytes for v in views), views, p.span))
    return pools, pooled


def _resolve_stream(sched: ast.Schedule, graph: DecodeGraph,
                    pooled: dict[str, dict[str, str]]) -> ir.Stream:
    if len(sched.rings) != 1 or len(sched.streams) != 1:
        span = (sched.rings[1].span if len(sched.rings) > 1 else
                sched.streams[1].span if len(sched.streams) > 1 else sched.name.span)
        raise fail("E-STREAM", "a schedule needs exactly one weight ring and one stream through it",
                   span, hint="declare `ring NAME: N slots of bf16 tiles up to R x C` and "
                              "`stream NAME ahead A { kind: families... then lm_head }`")
    ring, st = sched.rings[0], sched.streams[0]
    _validate_identifier(ring.name, "ring", graph)
    if ring.dtype.text not in RING_DTYPES:
        raise _unknown("ring dtype", ring.dtype, list(RING_DTYPES))
    for what, v in (("rows", ring.max_rows), ("columns", ring.max_cols)):
        if v <= 0 or v % ir.LANES:
            raise fail("E-ALIGN", f"ring tile {what} {v} is not a multiple of {ir.LANES}",
                       ring.span, hint=f"TPU tiles are (16, 128) for bf16 and activations put tile "
                                       f"rows on lanes: use {max(128, v // 128 * 128)} or "
                                       f"{(v // 128 + 1) * 128}")
    if ring.slots < 1:
        raise fail("E-STREAM", "a ring needs at least one slot", ring.span, hint="use 2 or more")
    if st.ring.text != ring.name.text:
        raise _unknown("ring", st.ring, [ring.name.text])
    if st.ahead < 1:
        raise fail("E-STREAM", "stream distance must be at least 1 tile", st.span,
                   hint=f"`ahead {ring.slots}` keeps every slot busy")

    listed: dict[str, list[ast.Name]] = {}
    for sk in st.per_kind:
        if sk.kind.text not in graph.kinds:
            raise _unknown("layer kind", sk.kind, sorted(graph.kinds))
        if sk.kind.text in listed:
            raise fail("E-DUPLICATE", f"the stream lists {sk.kind.text} twice", sk.kind.span,
                       hint=f"keep one `{sk.kind.text}: ...` line")
        listed[sk.kind.text] = sk.families
    families: dict[str, list[ir.StreamFamily]] = {}
    mats: list[tuple[int, int, int]] = []
    used_kinds = sorted(set(graph.layer_kinds))
    for kname in used_kinds:
        kind = graph.kinds[kname]
        in_pool = pooled.get(kname, {})
        multiplied = {o.matmul for o in kind.ops if o.matmul}
        for t in kind.tensors.values():
            if t.role == "matrix" and t.name not in multiplied and t.name not in in_pool:
                readers = ", ".join(kind.ops[i].name for i in kind.readers(t.name))
                raise fail("E-POOL", f"{kname}.{t.name} is read whole by {readers}, so it cannot "
                           "stream through the ring in tiles", st.span,
                           hint="hold it in a pool view: `view NAME: "
                                f"{kname}({t.name}, ...)`")
        order = [t.name for t in kind.matrices() if t.name not in in_pool]
        names = listed.get(kname, [])
        if not order and not names:
            continue
        if kname not in listed:
            raise fail("E-STREAM", f"stream lists no weights for layer kind {kname}", st.span,
                       hint=f"add `{kname}: {', '.join(order)}`")
        for n in names:
            if n.text in in_pool:
                raise fail("E-STREAM", f"{kname}.{n.text} is held in pool view {in_pool[n.text]}; "
                           "it cannot also stream", n.span,
                           hint="list each matrix in one place")
            if n.text not in order:
                raise _unknown(f"matrix family of {kname}", n, order)
        got = [n.text for n in names]
        missing = [o for o in order if o not in got]
        if missing:
            raise fail("E-STREAM", f"{kname} matrices {', '.join(missing)} are not streamed",
                       names[-1].span, hint=f"list them in consumption order: {', '.join(order)}")
        if got != order:
            bad = next(n for n, o in zip(names, order) if n.text != o)
            raise fail("E-STREAM-ORDER", f"{kname} weights are listed out of consumption order",
                       bad.span, hint=f"the layer multiplies by them in this order: "
                                      f"{', '.join(order)}")
        count = graph.layer_kinds.count(kname)
        for t in kind.matrices():
            if t.name not in in_pool:
                mats.append((t.shape[0], t.shape[1], count))
    tail = graph.tail_matrices()
    if [n.text for n in st.tail] != [m.name for m in tail]:
        bad = st.tail[0] if st.tail else None
        then = ", ".join(m.name for m in tail)
        raise fail("E-STREAM", f"the stream must end with `then {then}`",
                   bad.span if bad else st.span, hint=f"add `then {then}` as the stream's last line")
    mats += [(m.shape[0], m.shape[1], 1) for m in tail]

    def fam(kname: str, t) -> ir.StreamFamily:
        tr, tc = _choose_tile(t.shape[0], t.shape[1], ring.max_rows, ring.max_cols)
        return ir.StreamFamily(kname, t.name, t.shape[0], t.shape[1], -(-t.shape[0] // tr),
                         -(-t.shape[1] // tc), t.partial_out, tr, tc)

    for kname in used_kinds:
        families[kname] = [fam(kname, t) for t in graph.kinds[kname].matrices()
                           if t.name not in pooled.get(kname, {})]
    tail_families = [fam("tail", m) for m in tail]
    offsets, t = [], 0
    for kname in graph.layer_kinds:
        offsets.append(t)
        t += sum(f.tiles for f in families[kname])
    tail_off = t
    total = t + sum(f.tiles for f in tail_families)
    useful = sum(r * c * n * 2 for r, c, n in mats)
    streamed = sum(f.tiles * f.tile_bytes * graph.layer_kinds.count(k)
                   for k, fs in families.items() for f in fs) + sum(f.tiles * f.tile_bytes
                                                                     for f in tail_families)
    every = [f for fs in families.values() for f in fs] + tail_families
    shapes = sorted({(f.tile_rows, f.tile_cols) for f in every})
    return ir.Stream(ring=ring.name.text, slots=ring.slots, ahead=st.ahead, dtype=ring.dtype.text,
                     tile_rows=max(f.tile_rows for f in every),
                     tile_cols=max(f.tile_cols for f in every), families=families, tail=tail_families,
                     layer_tile_offset=offsets, tail_tile_offset=tail_off, total_tiles=total,
                     useful_bytes=useful, streamed_bytes=streamed, tile_shapes=shapes,
                     span=st.span)


def _resolve_parity(sched: ast.Schedule, graph: DecodeGraph) -> ir.Parity:
    if len(sched.parities) != 1:
        span = sched.parities[1].span if sched.parities else sched.name.span
        raise fail("E-PARITY", "a schedule needs exactly one `parity` block for per-layer vectors",
                   span, hint="add `parity vectors ahead 1`")
    p = sched.parities[0]
    if p.name.text != "vectors":
        raise fail("E-NAME", f"the parity block must be called 'vectors', not '{p.name.text}'",
                   p.name.span, hint="write `parity vectors ahead 1`")
    if p.ahead < 0:
        raise fail("E-PARITY", "parity distance cannot be negative", p.span, hint="use 1")
    layout: dict[str, dict[str, tuple[int, int, int]]] = {}
    width = 0
    rows = 0
    for kname in sorted(set(graph.layer_kinds)):
        row = 0
        layout[kname] = {}
        for t in graph.kinds[kname].vectors():
            n_rows = t.shape[0] if len(t.shape) == 2 else 1
            w = t.shape[-1]
            layout[kname][t.name] = (row, n_rows, w)
            row += n_rows
            width = max(width, w)
        rows = max(rows, row)
    cols = -(-width // ir.LANES) * ir.LANES
    rows = -(-rows // ir.SUBLANE_TILE["f32"]) * ir.SUBLANE_TILE["f32"]
    return ir.Parity(name="vectors", ahead=p.ahead, rows=rows, cols=cols, layout=layout,
                     span=p.span)


def _two_level(size: int, stride: int, level_cores: int) -> tuple[tuple[int, int], ...] | None:
    """The stages of a two-level all-reduce over the group (size, stride) whose first level
    is the group's members within each `level_cores` consecutive ranks (a chip, a host), or
    None when that level would hold one member or the whole group."""
    if level_cores % stride:
        return None
    first = level_cores // stride
    if first <= 1 or first >= size or size % first:
        return None
    return ((first, stride), (size // first, level_cores))


def _stages(ar: ast.AllReduce, topo: target.Topology, group: tuple[int, int], op: str
            ) -> tuple[tuple[int, int], ...]:
    """The direct stages of `ar` reducing `op`'s partial sums over the rank group `group`."""
    n = topo.num_cores
    size, stride = group
    if ar.algorithm.text == "direct":
        if ar.level is not None:
            raise fail("E-COLLECTIVE", f"a direct all-reduce takes no group ('{ar.level.text}')",
                       ar.level.span, hint="write `direct wire bf16`, or `two_level chip`")
        return (group,)
    if ar.level is None or ar.level.text not in TWO_LEVEL_GROUPS:
        where = ar.level.span if ar.level else ar.algorithm.span
        raise fail("E-COLLECTIVE", "a two_level all-reduce needs its first-level group",
                   where, hint="write `two_level chip` or `two_level host`")
    if ar.level.text == "chip" and topo.chip.cores_per_chip == 1:
        raise fail("E-COLLECTIVE", f"two_level chip reduces over the sibling cores of a chip, "
                   f"but a {topo.chip.name} chip is one rank: there is no sibling level",
                   ar.level.span,
                   hint="use `direct`" + (" or `two_level host`" if 1 < topo.cores_per_host < n
                                          else ""))
    level_cores = (topo.chip.cores_per_chip if ar.level.text == "chip"
                   else topo.cores_per_host)
    stages = _two_level(size, stride, level_cores)
    if stages is None:
        valid = [lv for lv, c in (("chip", topo.chip.cores_per_chip),
                                  ("host", topo.cores_per_host)) if _two_level(size, stride, c)]
        where = (f"on this topology ({level_cores} of {n} cores per {ar.level.text})"
                 if group == (n, 1) else
                 f"for {op} on this topology: its parts are on {size} ranks"
                 + (f" of stride {stride}" if stride > 1 else "")
                 + f", {level_cores} cores per {ar.level.text}")
        raise fail("E-COLLECTIVE", f"two_level {ar.level.text} has a single level {where}",
                   ar.level.span,
                   hint="use `direct`" + "".join(f" or `two_level {lv}`" for lv in valid)
                   + (f"; or reduce {op} on a line of its own" if group != (n, 1) else ""))
    return stages


def _group_of(stages: tuple[tuple[int, int], ...]) -> tuple[int, int]:
    """The rank group (size, stride) a sequence of all-reduce stages reduces over."""
    size = 1
    for s, _ in stages:
        size *= s
    return (size, stages[0][1])


def _resolve_phase(phase: ast.Phase, graph: DecodeGraph, topo: target.Topology, B: int,
                   context: int, axis: str, shards: ShardTable,
                   pools: list[ir.Pool], pooled: dict[str, str]
                   ) -> tuple[ir.KindSchedule, list[ir.Buffer]]:
    kname = phase.kind.text
    kind = graph.kinds[kname]
    ops = kind.op_names()
    states = {t.name: t for t in kind.states() if t.role == "state"}
    buffers: dict[str, ir.Buffer] = {}
    bound: dict[str, str] = {}          # buffer -> state family
    transfers: list[ir.Transfer] = []
    for tr in phase.transfers:
        for b in tr.bindings:
            hbm_side, vmem_side = (b.src, b.dst) if tr.direction == "load" else (b.dst, b.src)
            if not hbm_side.text.startswith("state."):
                raise fail("E-TRANSFER", f"the HBM side of a {tr.direction} must name "
                           f"`state.<family>`, got '{hbm_side.text}'", hbm_side.span,
                           hint=f"{kname} state families: "
                                + ", ".join(f"state.{s}" for s in states))
            sname = hbm_side.text.split(".", 1)[1]
            if sname not in states:
                raise _unknown(f"state of layer kind {kname}",
                               ast.Name(sname, hbm_side.span), sorted(states))
            bname = _validate_identifier(vmem_side, "buffer")
            if bname in bound and bound[bname] != sname:
                raise fail("E-TRANSFER", f"buffer '{bname}' is bound to state.{bound[bname]} "
                           f"and state.{sname}", vmem_side.span,
                           hint="use one VMEM buffer per state family")
            bound[bname] = sname
            t = states[sname]
            # Leading dims of a state (conv taps) go first so the kernel indexes them cheaply.
            shape = (*t.shape[:t.lead_dims], B, *t.shape[t.lead_dims:])
            buffers[bname] = ir.Buffer(f"{kname}_{bname}", "state", shape, t.dtype,
                                       batch_axis=t.lead_dims, span=tr.span)
            if tr.start.where == "before next":
                raise fail("E-TRANSFER", "a copy cannot start `before next ...`",
                           tr.start.anchor.span, hint="start it at a point of this layer")
            points = [(w.where, w.anchor.text) for w in tr.waits]
            dup = next((w for i, w in enumerate(tr.waits)
                        if (w.where, w.anchor.text) in points[:i]), None)
            if dup is not None:
                raise fail("E-DUPLICATE", f"the {tr.direction} is waited twice at "
                           f"`{dup.where} {dup.anchor.text}`", dup.anchor.span,
                           hint="wait for each copy once: remove the repeated `wait`")
            drains = [w for w in tr.waits if w.where == "before next"]
            for w in drains:
                if w.anchor.text != kname:
                    raise fail("E-TRANSFER", f"phase {kname} can only drain before the next "
                               f"{kname} layer, not '{w.anchor.text}'", w.anchor.span,
                               hint=f"write `wait before next {kname}`")
            if any((t.direction, t.state, t.buffer) == (tr.direction, sname, f"{kname}_{bname}")
                   for t in transfers):
                raise fail("E-DUPLICATE", f"state.{sname} is "
                           f"{'loaded' if tr.direction == 'load' else 'stored'} "
                           f"{'into' if tr.direction == 'load' else 'from'} {bname} twice",
                           b.src.span, hint=f"keep one `{tr.direction}` of state.{sname}")
            transfers.append(ir.Transfer(
                tr.direction, sname, f"{kname}_{bname}", _point(tr.start, ops, kname),
                tuple(_point(w, ops, kname) for w in tr.waits if w.where != "before next"),
                drain=len(drains), span=tr.span))
    for sname in states:
        for direction in ("load", "store"):
            if not any(t.state == sname and t.direction == direction for t in transfers):
                raise fail("E-TRANSFER", f"state.{sname} of {kname} is never "
                           f"{'loaded' if direction == 'load' else 'stored'}",
                           phase.kind.span,
                           hint=f"add `{direction} ...` for state.{sname} in phase {kname}")
    ranges: list[tuple[int, int, ast.Scoped]] = []
    for sc in phase.scoped:
        first = 0 if sc.first.text == "start" else None
        last = len(ops) - 1 if sc.last.text == "end" else None
        if first is None:
            if sc.first.text not in ops:
                raise _unknown(f"op of layer kind {kname}", sc.first, ops)
            first = ops.index(sc.first.text)
        if last is None:
            if sc.last.text not in ops:
                raise _unknown(f"op of layer kind {kname}", sc.last, ops)
            last = ops.index(sc.last.text)
        if last < first:
            raise fail("E-SCOPE", f"scope ends at {sc.last.text} before it starts at "
                       f"{sc.first.text}", sc.span, hint="swap the two ends")
        for n in sc.buffers:
            if n.text not in buffers:
                raise _unknown(f"buffer of phase {kname}", n, sorted(buffers))
            b = buffers[n.text]
            if b.scope is not None:
                raise fail("E-DUPLICATE", f"{n.text} is scoped twice", n.span,
                           hint=f"the first `scoped` range of it is at line {b.span.line}")
            buffers[n.text] = dataclasses.replace(b, scope=(kname, first, last), span=sc.span)
        ranges.append((first, last, sc))
    _check_scopes_nest(ranges, ops)

    kv = None
    caches = kind.caches()
    if len(phase.kv_tiles) > 1:
        raise fail("E-DUPLICATE", "kv tiles declared twice", phase.kv_tiles[1].span,
                   hint="keep one `kv tiles` line")
    if phase.kv_tiles:
        k = phase.kv_tiles[0]
        if not caches:
            raise fail("E-KV", f"layer kind {kname} has no KV cache to tile", k.span,
                       hint="remove the `kv tiles` line")
        sub = ir.SUBLANE_TILE["bf16"]
        if k.tokens <= 0 or k.tokens % sub:
            raise fail("E-ALIGN", f"a KV tile of {k.tokens} tokens is not a multiple of the "
                       f"{sub}-row bf16 tile", k.span,
                       hint=f"use a multiple of {sub}, e.g. {max(sub, k.tokens // sub * sub)}")
        if context % k.tokens:
            raise fail("E-ALIGN", f"context {context} is not a whole number of {k.tokens}-token "
                       f"KV tiles", k.span, hint="make the context a multiple of the tile")
        if k.slots < 1 or k.ahead < 1:
            raise fail("E-KV", "kv tiles need at least one slot and ahead >= 1", k.span,
                       hint="e.g. `kv tiles 2 slots of 128 tokens ahead 1`")
        reader = kind.cache_reader()
        kv = ir.KvStream(k.slots, k.tokens, k.ahead, reader,
                         caches=tuple(c.name for c in caches),
                         tile_buffers=tuple(f"{kname}_kv_{c.name}" for c in caches),
                         rows_buffer=f"{kname}_kv_rows", span=k.span)
        a = ops.index(reader)
        width = 1
        for dim in caches[0].shape:
            width *= dim
        for c, name in zip(caches, kv.tile_buffers):
            buffers[f"kv_{c.name}"] = ir.Buffer(name, "kv",
                                                (k.slots, B, k.tokens, width), "bf16",
                                                (kname, a, a), batch_axis=1)
        # The new token's K/V rows are written by read-modify-write of an aligned bf16 tile.
        buffers["kv_rows"] = ir.Buffer(kv.rows_buffer, "kv",
                                       (2, B, ir.SUBLANE_TILE["bf16"], width), "bf16",
                                       batch_axis=1)
    elif caches:
        raise fail("E-KV", f"layer kind {kname} reads a KV cache but the phase does not say how",
                   phase.kind.span, hint="add `kv tiles 2 slots of 128 tokens ahead 1`")

    partial_over = {o.name: o.partial or (kind.tensors[o.matmul].partial_out if o.matmul else ())
                    for o in kind.ops}
    partial_ops = [o for o, classes in partial_over.items() if classes]
    width_of = {o.name: o.width or (kind.tensors[o.matmul].shape[1] if o.matmul else 0)
                for o in kind.ops}
    allreduces: list[ir.AllReduce] = []
    for ar in phase.allreduces:
        if ar.algorithm.text not in ALLREDUCE_ALGORITHMS:
            raise _unknown("all-reduce algorithm", ar.algorithm, list(ALLREDUCE_ALGORITHMS))
        if ar.wire_dtype.text not in WIRE_DTYPES:
            raise _unknown("wire dtype", ar.wire_dtype, list(WIRE_DTYPES))
        for n in ar.ops:
            if n.text not in ops:
                raise _unknown(f"op of layer kind {kname}", n, ops)
            if n.text not in partial_ops:
                raise fail("E-COLLECTIVE", f"{n.text} does not produce partial sums; nothing to "
                           "all-reduce", n.span,
                           hint=f"ops of {kname} with partial outputs: {', '.join(partial_ops)}")
            if any(a.after_op == n.text for a in allreduces):
                raise fail("E-DUPLICATE", f"{n.text} is all-reduced twice", n.span,
                           hint="list each op in one allreduce")
            try:
                group = shards.reduction_group(partial_over[n.text])
            except ShardingError as e:
                raise fail("E-SHARD", f"{kname}.{n.text}: {e}", n.span,
                           hint="shard those classes over nested groups (one `tp / N`, the "
                                "other `over N`)") from None
            allreduces.append(ir.AllReduce(n.text, ar.algorithm.text, ar.wire_dtype.text,
                                           _stages(ar, topo, group, n.text), width_of[n.text],
                                           ar.span))
    for p_op in partial_ops:
        if not any(a.after_op == p_op for a in allreduces):
            # Point at the allreduce line to extend, or the phase to add one to.
            raise fail("E-COLLECTIVE", f"{kname}.{p_op} leaves partial sums that nothing reduces",
                       phase.allreduces[0].span if phase.allreduces else phase.kind.span,
                       hint=f"add `allreduce {', '.join(partial_ops)} direct wire bf16`")

    gathers, exchanges, gather_bufs = _resolve_gathers(phase, kind, topo, axis, B,
                                                       dict((c, (w, st)) for c, w, st in shards.rules))
    fetch, prefetch = _resolve_view_copies(phase, kind, pools)
    # What an op passes and returns in registers: not a tensor, not a VMEM activation buffer.
    not_values = set(kind.tensors) | set(graph.activations) | {"x"}
    ks = ir.KindSchedule(
        name=kname, ops=ops, matmuls={o.name: o.matmul for o in kind.ops if o.matmul},
        transfers=transfers, kv=kv, allreduces=allreduces,
        vectors=[(t.name, t.shape) for t in kind.vectors()],
        states={n: (t.shape, t.dtype) for n, t in states.items()},
        op_reads={o.name: list(o.reads) for o in kind.ops},
        op_writes={o.name: list(o.writes) for o in kind.ops},
        op_values={o.name: ([n for n in o.reads if n not in not_values],
                            [n for n in o.writes if n not in not_values]) for o in kind.ops},
        allgathers=gathers, exchanges=exchanges, pooled=dict(pooled), prefetch=prefetch,
        fetch=fetch)
    return ks, list(buffers.values()) + gather_bufs


def _check_scopes_nest(ranges: list[tuple[int, int, ast.Scoped]], ops: list[str]) -> None:
    """Scoped ranges must nest or be disjoint: each lowers to one `pl.run_scoped` block, and
    blocks cannot cross. A range from op a to op b holds its buffers over points a..b+1."""
    for i, (f1, l1, a) in enumerate(ranges):
        for f2, l2, b in ranges[i + 1:]:
            if (f1, l1) == (f2, l2) or l1 < f2 or l2 < f1:
                continue
            if (f1 <= f2 and l2 <= l1) or (f2 <= f1 and l1 <= l2):
                continue
            first, second = (a, b) if f1 <= f2 else (b, a)
            raise fail("E-SCOPE", "two scoped ranges cross: each must lie inside the other or "
                       "end before the other starts", second.span,
                       notes=[f"the other range is at line {first.span.line}"],
                       hint=f"nest them, or end `{first.last.text}` range before "
                            f"`{second.first.text}` (ops in order: {', '.join(ops)})")


def _resolve_gathers(phase: ast.Phase, kind, topo: target.Topology, axis: str, B: int,
                     rules: dict[str, tuple[int, int]]
                     ) -> tuple[list[ir.AllGather], list[ir.Exchange], list[ir.Buffer]]:
    """All-gathers and sibling exchanges: every op whose product is column-split by a shard
    rule needs exactly one, over exactly that rule's group."""
    kname = kind.name
    ops = kind.op_names()
    split = {o.name: kind.tensors[o.matmul].split_out for o in kind.ops
             if o.matmul and kind.tensors[o.matmul].split_out}
    done: dict[str, Span] = {}
    gathers: list[ir.AllGather] = []
    exchanges: list[ir.Exchange] = []
    buffers: list[ir.Buffer] = []

    def check_op(n: ast.Name, span: Span) -> tuple[str, int]:
        if n.text not in ops:
            raise _unknown(f"op of layer kind {kname}", n, ops)
        if n.text not in split:
            raise fail("E-COLLECTIVE", f"{n.text} does not produce column shards; nothing to "
                       "gather", n.span, hint=f"ops of {kname} with split outputs: "
                       + (", ".join(split) or "none"))
        if n.text in done:
            raise fail("E-DUPLICATE", f"{n.text} is gathered twice", n.span,
                       hint=f"the first is at line {done[n.text].line}")
        done[n.text] = span
        op = kind.ops[ops.index(n.text)]
        return split[n.text], kind.tensors[op.matmul].shape[1]

    for ag in phase.allgathers:
        size, stride = _group(ag.group, axis, topo)
        for n in ag.ops:
            cls, width = check_op(n, ag.span)
            if (size, stride) != rules[cls]:
                raise fail("E-COLLECTIVE", f"{n.text} is split {rules[cls][0]} ways by "
                           f"`shard {cls}`, but this gathers over {size} ranks", ag.group.span,
                           hint="gather over the group the shard rule names")
            gathers.append(ir.AllGather(n.text, size, stride, width, ag.span))
            buffers.append(ir.Buffer(ir.AllGather.buffer_name(n.text), "collective",
                                     (2, size, B, width), "bf16", batch_axis=2, span=ag.span))
    for ex in phase.exchanges:
        if ex.peer.text != "sibling":
            raise _unknown("exchange peer", ex.peer, ["sibling"])
        if topo.chip.cores_per_chip == 1:
            raise fail("E-COLLECTIVE", f"a {topo.chip.name} chip is one rank: it has no sibling "
                       "core to exchange with", ex.peer.span,
                       hint="shard the op over a rank group and `allgather` it over that group")
        if ex.wire_dtype.text not in WIRE_DTYPES:
            raise _unknown("wire dtype", ex.wire_dtype, list(WIRE_DTYPES))
        for n in ex.ops:
            cls, width = check_op(n, ex.span)
            if rules[cls] != (topo.chip.cores_per_chip, 1):
                raise fail("E-COLLECTIVE", f"{n.text} is split {rules[cls][0]} ways by "
                           f"`shard {cls}`; a sibling exchange joins the "
                           f"{topo.chip.cores_per_chip} cores of a chip", ex.span,
                           hint=f"write `shard {cls} over chip`, or gather over the rule's group")
            exchanges.append(ir.Exchange(n.text, width, ex.wire_dtype.text, ex.span))
            buffers.append(ir.Buffer(ir.Exchange.buffer_name(n.text), "collective",
                                     (2, topo.chip.cores_per_chip, B, width), ex.wire_dtype.text,
                                     batch_axis=2, span=ex.span))
    for op_name, cls in split.items():
        if op_name not in done:
            ways = rules[cls][0]
            how = (f"exchange {op_name} with sibling wire f32"
                   if rules[cls] == (topo.chip.cores_per_chip, 1) else
                   f"allgather {op_name} over ...")
            lines = (phase.exchanges if rules[cls] == (topo.chip.cores_per_chip, 1)
                     else phase.allgathers)
            raise fail("E-COLLECTIVE", f"{kname}.{op_name} leaves its output split {ways} ways "
                       f"(`shard {cls}`) and nothing gathers it",
                       lines[0].span if lines else phase.kind.span,
                       hint=f"add `{how}`")
    return gathers, exchanges, buffers


def _resolve_view_copies(phase: ast.Phase, kind, pools: list[ir.Pool]
                         ) -> tuple[ir.ViewCopy | None, ir.ViewCopy | None]:
    """`fetch experts -> POOL.VIEW after OP` and `prefetch next POOL.VIEW at|after P`."""
    kname = kind.name
    ops = kind.op_names()

    def view_of(name: ast.Name, slots: bool) -> ir.PoolView:
        parts = name.text.split(".")
        views = [f"{p.name}.{v.name}" for p in pools for v in p.views
                 if (v.slots > 0) == slots]
        if len(parts) != 2 or name.text not in views:
            raise _unknown("slot view" if slots else "weight view", name, views)
        pool = next(p for p in pools if p.name == parts[0])
        return pool.view(parts[1])

    fetch = prefetch = None
    consumers = [o.name for o in kind.ops if o.runs_experts]
    if len(phase.fetches) > 1 or len(phase.prefetches) > 1:
        extra = (phase.fetches[1:] + phase.prefetches[1:])[0]
        raise fail("E-DUPLICATE", "a phase fetches experts or prefetches a view once", extra.span,
                   hint="keep one line")
    for f in phase.fetches:
        v = view_of(f.view, slots=True)
        if not consumers:
            raise fail("E-POOL", f"no op of {kname} reads routed experts", f.span,
                       hint="fetch experts in the phase of the layer kind that runs them")
        start = _point(f.start, ops, kname)
        picked = max(i for i, o in enumerate(kind.ops) if o.picks_experts)
        consumer = ops.index(consumers[0])
        if start <= picked:
            raise fail("E-POOL", f"experts are known only after {ops[picked]} picks them",
                       f.start.anchor.span, hint=f"write `after {ops[picked]}`")
        if start > consumer:
            raise fail("E-POOL", f"experts are fetched after {consumers[0]} reads them",
                       f.start.anchor.span, hint=f"fetch them before {consumers[0]}")
        fetch = ir.ViewCopy(v.pool, v.name, start, consumers[0], f.span)
    if consumers and fetch is None:
        raise fail("E-POOL", f"{kname}.{consumers[0]} reads routed experts that nothing fetches",
                   phase.kind.span,
                   hint="add a slot view (`view experts: 4 slots of expert`) and "
                        "`fetch experts -> POOL.VIEW after route`")
    for pf in phase.prefetches:
        v = view_of(pf.view, slots=False)
        if pf.start.where == "before next":
            raise fail("E-POOL", "a prefetch starts at a point of this layer",
                       pf.start.anchor.span, hint="e.g. `after routed_experts` or `at start`")
        prefetch = ir.ViewCopy(v.pool, v.name, _point(pf.start, ops, kname), span=pf.span)
    return fetch, prefetch


def _check_view_copies(layer_kinds: tuple[str, ...], kinds: dict[str, ir.KindSchedule],
                       phases: dict[str, ast.Phase], pools: list[ir.Pool]) -> None:
    """Every layer that reads a weight view finds it prefetched by the layer before it (the
    first layer's is copied in the prologue), and every prefetch has a reader next. The
    lowering serves one weight view and one slot view of routed experts per step."""
    weight_views = [v for p in pools for v in p.views if v.slots == 0]
    if len(weight_views) > 1:
        raise fail("E-POOL", f"{len(weight_views)} weight views; the lowering prefetches one per step",
                   weight_views[1].span, hint=f"hold every pooled matrix in {weight_views[0].pool}."
                                              f"{weight_views[0].name}")
    fetched = {(k.fetch.pool, k.fetch.view) for k in kinds.values() if k.fetch is not None}
    if len(fetched) > 1:
        second = next(k.fetch for k in kinds.values() if k.fetch is not None
                      and (k.fetch.pool, k.fetch.view) != min(fetched))
        raise fail("E-POOL", "experts are fetched into two slot views; the lowering serves one",
                   second.span, hint="fetch every kind's experts into the same view")
    def views(kname: str) -> set[str]:
        return set(kinds[kname].pooled.values())

    for i in range(1, len(layer_kinds)):
        prev, cur = kinds[layer_kinds[i - 1]], layer_kinds[i]
        for v in sorted(views(cur)):
            got = prev.prefetch and f"{prev.prefetch.pool}.{prev.prefetch.view}"
            if got != v:
                raise fail("E-POOL", f"layer {i} ({cur}) reads {v}, but phase {prev.name} before "
                           f"it does not prefetch it", phases[prev.name].kind.span,
                           hint=f"add `prefetch next {v} after OP` to phase {prev.name}")
    for kname, k in kinds.items():
        if k.prefetch is None:
            continue
        v = f"{k.prefetch.pool}.{k.prefetch.view}"
        nexts = {layer_kinds[i + 1] for i in range(len(layer_kinds) - 1)
                 if layer_kinds[i] == kname}
        if not any(v in views(n) for n in nexts):
            raise fail("E-POOL", f"phase {kname} prefetches {v}, but no layer after a {kname} "
                       "layer reads it", k.prefetch.span, hint="remove the prefetch")


def _resolve_verify(sched, b_lo: int, b_hi: int, context: int) -> tuple[int, tuple[int, int]]:
    """`verify R sequences S1 to S2` -> (R, (S1, S2)); (0, (0, 0)) without a verify step. The
    sequences must lie in the batch range: a commit hands the decode step their state."""
    setting = sched.settings.get("verify")
    if setting is None:
        return 0, (0, 0)
    rows, (s_lo, s_hi) = setting.value
    if rows < 2:
        raise fail("E-VERIFY", f"verify {rows} checks no drafts: a verify step takes an anchor "
                   "and at least one draft per sequence", setting.span,
                   hint="write `verify 8` (1 anchor + 7 drafts), or drop the line to decode only")
    window = ir.kv_window_tiles(rows) * ir.SUBLANE_TILE["bf16"]
    if rows >= context or window > context:
        # A sequence's new K/V rows are written through a window of aligned 16-token tiles.
        raise fail("E-VERIFY", f"verify {rows} rows do not fit the context of {context} tokens"
                   + (f" (their K/V rows are written through a {window}-token window)"
                      if rows < context else ""),
                   setting.span, hint=_verify_rows_hint(context, window))
    if not 1 <= s_lo <= s_hi:
        raise fail("E-VERIFY", f"verify sequences {s_lo} to {s_hi} is empty or starts below 1",
                   setting.span, hint=f"write `verify {rows} sequences 1`")
    if not (b_lo <= s_lo and s_hi <= b_hi):
        raise fail("E-VERIFY", f"verify sequences {s_lo} to {s_hi} leave the batch range "
                   f"{b_lo} to {b_hi}: the decode step continues from a verify step's state",
                   setting.span, hint=f"use sequences within {b_lo} to {b_hi}, or widen `batch`")
    return rows, (s_lo, s_hi)


def _verify_rows_hint(context: int, window: int) -> str:
    tile = ir.SUBLANE_TILE["bf16"]
    most = min(context - 1, tile * (context // tile - 1) + 1)    # the widest window that fits
    if most >= 2:
        return f"verify at most {most} rows, e.g. `verify {min(most, 8)}`"
    return f"a verify step needs a context of at least {window} tokens"


def _hbm_bytes(graph: DecodeGraph, stream: ir.Stream, parity: ir.Parity, pools: list[ir.Pool],
               B: int, context: int, verify_rows: int = 0) -> dict[str, int]:
    """HBM bytes one rank holds, by class (weights padded to ring slots, as packed); a verify
    step's output adds a recurrent state per row."""
    slot_bytes = stream.tile_rows * stream.tile_cols * 2
    n_layers = len(graph.layer_kinds)
    state = cache = row_state = 0
    for kname in graph.layer_kinds:
        for t in graph.kinds[kname].states():
            if t.role == "state":
                state += B * t.nbytes
                row_state += verify_rows * t.nbytes
            else:
                cache += B * context * t.nbytes
    out = {"streamed weights": stream.total_tiles * slot_bytes}
    pooled = sum(m.nbytes * graph.layer_kinds.count(kname) for p in pools for v in p.views
                 for kname, ms in v.matrices.items() if kname in graph.kinds for m in ms)
    if pooled:
        out["pooled weights"] = pooled
    if graph.experts:
        consumers = [k for k in set(graph.layer_kinds)
                     if any(o.runs_experts for o in graph.kinds[k].ops)]
        layers = sum(graph.layer_kinds.count(k) for k in consumers)
        out["routed experts"] = (layers * graph.per_rank["local_experts"]
                                 * sum(t.nbytes for t in graph.experts.values()))
    return out | {
        "embedding": graph.globals["embed"].nbytes,
        "vectors": n_layers * parity.rows * parity.cols * 4,
        "recurrent state": state,
        "kv cache": cache,
    } | ({"verify states": row_state} if row_state else {})
