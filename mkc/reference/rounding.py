"""Where a compiled kernel rounds: the facts a reference needs to emulate it, and the math.

A family's reference (``mkc.families.<family>.reference``) computes in f32 by default.
Given a ``Rounding`` it instead rounds where the generated kernel does, so that the kernel and
the reference agree to about f32 rounding rather than bf16 rounding:

* every matmul's activation input is rounded to ``matmul_input`` (bf16: the kernels stage
  activations as bf16 for the MXU; the weights are bf16 already), and the product is the dot
  of those operands the kernel issues (``Rounding.linear``), not an f32 dot of their values,
  with the weight as the kernel's dot reads it: ``[in, out]``, a buffer the host wrote
  (``in_out``; XLA on CPU picks its dot routine by shape and operand layout, and on an
  AVX512-BF16 host a one-row dot of an ``[out, in]`` weight sums in another order);
* a row-parallel matmul (the contraction split over ranks) becomes per-rank partial sums, each
  all-reduced through the stages the spec gives: a stage ``(size, stride)`` sums, in f32 and in
  group order, the group members' values rounded to the wire dtype (``allreduce``);
* all-gathers and sibling exchanges round what travels to their buffer's dtype;
* states and caches are stored in their storage dtype;
* a contraction the kernel splits is summed as it sums it: a streamed matrix of several ring
  tiles of ``tiles`` input rows each, one f32 dot per tile added in order
  (``chunked_linear``), and a KV cache read in tiles of ``kv_tiles`` tokens (the family's
  reference runs its online softmax tile by tile);
* a streamed matrix stored as 8-bit codes with a scale per output column (``codes``:
  ``mkc.layers.dense_formats``) is multiplied as its codes, the sum times the scales
  (``Rounding.matrix``, ``row_parallel``), the codes and scales read back from the weight as
  the kernel holds it (``channel_codes``).

The facts come from the schedule IR (``mkc.numerics.rounding_from_ir``); this module only holds
them and the arithmetic, and knows nothing of a family's layout: each reference says which of
its matmuls is which op of which layer kind.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mkc.model.sharding import ShardTable

_DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


def round_to(x: jax.Array, dtype: str | None) -> jax.Array:
    """x rounded to ``dtype`` ("bf16" or "f32") and back to f32; None leaves x as is."""
    if dtype is None or dtype == "f32":
        return x
    return x.astype(_DTYPES[dtype]).astype(jnp.float32)


@dataclass(frozen=True)
class Reduce:
    """An all-reduce: direct stages ``(size, stride)`` in order, partial sums on a ``wire``;
    from ``rounded_from`` rows on (a scattered form gathering its sums in bf16) the result
    rounded once to ``gather``."""

    stages: tuple[tuple[int, int], ...]
    wire: str
    gather: str = "f32"
    rounded_from: int | None = None


@dataclass(frozen=True)
class Rounding:
    """Where one compiled schedule rounds (hashable, so it can be a static jit argument).

    ``reduces``/``gathers``/``exchanges`` are keyed by (layer kind, op) as the schedule IR names
    them (``embed`` is the embedding lookup's exact all-reduce); ``storage`` by
    (kind, state family) with ``"kv"`` for a KV cache; ``shard`` holds the per-rank sizes of
    the model graph (``ir.per_rank``: heads, widths, expert groups); ``tiles`` the input rows
    of one ring tile per streamed matrix family (kind, family; ``"tail"`` for the lm_head), and
    ``kv_tiles`` the tokens of one KV cache tile per layer kind.
    """

    ranks: int
    reduces: tuple[tuple[str, str, Reduce], ...]
    shards: ShardTable | None = None     # which part of each shard class every rank holds
    gathers: tuple[tuple[str, str, str], ...] = ()
    exchanges: tuple[tuple[str, str, str], ...] = ()
    storage: tuple[tuple[str, str, str], ...] = ()
    shard: tuple[tuple[str, int], ...] = ()
    matmul_input: str = "bf16"
    tiles: tuple[tuple[str, str, int], ...] = ()
    kv_tiles: tuple[tuple[str, int], ...] = ()
    # (matrix class, mkc.ir.WeightFormat): how the classes with a choice are stored
    formats: tuple[tuple[str, Any], ...] = ()
    # (layer kind, its (class, format) pairs): a kind holding its routed experts in another
    # layout (`ScheduleIR.kind_weight_formats`)
    kind_formats: tuple[tuple[str, tuple[tuple[str, Any], ...]], ...] = ()
    # (kind, family, codes, operands): streamed matrices stored as 8-bit codes ("fp8",
    # "int8") with a scale per output column, and the dot the kernel feeds them to
    codes: tuple[tuple[str, str, str, str], ...] = ()

    def reduce(self, kind: str, op: str) -> Reduce:
        for k, o, r in self.reduces:
            if (k, o) == (kind, op):
                return r
        raise KeyError(f"the schedule all-reduces no {kind}.{op} (its partial sums need one)")

    def gather_wire(self, kind: str, op: str) -> str:
        for k, o, w in self.gathers:
            if (k, o) == (kind, op):
                return w
        raise KeyError(f"the schedule all-gathers no {kind}.{op}")

    def exchange_wire(self, kind: str, op: str) -> str | None:
        """The wire dtype in which the cores of a chip share op's split columns, or None when op
        is not split between them."""
        for k, o, w in self.exchanges:
            if (k, o) == (kind, op):
                return w
        return None

    def stored(self, kind: str, state: str) -> str:
        for k, s, d in self.storage:
            if (k, s) == (kind, state):
                return d
        raise KeyError(f"no storage dtype for {kind}.{state}")

    def size(self, name: str) -> int:
        return dict(self.shard)[name]

    def part(self, cls: str, rank: int) -> int:
        """The part of shard class `cls` rank `rank` holds (its rank, with no shard table)."""
        return rank if self.shards is None else self.shards.part(cls, rank)

    def rank_ranges(self, cls: str, total: int, width: int) -> list[tuple[int, int]]:
        """Each rank's contiguous range of a `total`-long dimension of shard class `cls` split
        in `width`-wide parts (replicas of a part hold the same range)."""
        parts = chunks(total, width)
        return [parts[p] if p < len(parts) else (0, 0)
                for p in (self.part(cls, r) for r in range(self.ranks))]

    def tile_rows(self, kind: str, family: str) -> int | None:
        """Input rows of one ring tile of streamed matrix ``kind.family`` (the kernel sums its
        contraction tile by tile in f32), or None when the family is not streamed (a pooled
        matrix: one dot over the whole contraction)."""
        for k, f, rows in self.tiles:
            if (k, f) == (kind, family):
                return rows
        return None

    def kv_tile(self, kind: str) -> int:
        for k, tokens in self.kv_tiles:
            if k == kind:
                return tokens
        raise KeyError(f"the schedule streams no KV cache tiles for {kind}")

    def weight_format(self, cls: str, kind: str | None = None):
        """The ``mkc.ir.WeightFormat`` of matrix class `cls` (in layer kind `kind`: its own,
        where it holds its experts in another layout), or None where there is no choice."""
        own = dict(dict(self.kind_formats).get(kind, ()))
        return own.get(cls) or dict(self.formats).get(cls)

    def channel(self, kind: str, family: str) -> tuple[str, str] | None:
        """(codes, dot operands) of streamed matrix ``kind.family`` where it is stored as 8-bit
        codes with a scale per output column, else None."""
        for k, f, codes, operands in self.codes:
            if (k, f) == (kind, family):
                return codes, operands
        return None

    def matrix(self, x: jax.Array, w: jax.Array, kind: str, family: str,
               rows: int | None = None) -> jax.Array:
        """``x @ w.T`` (PyTorch ``[out, in]`` w as the kernel holds it) as the kernel multiplies
        its matrix family ``kind.family`` (``"tail"`` for the lm_head): stored as codes, the
        codes' dot ring tile by ring tile, the sum times each column's scale; else ``linear``
        (by chunks of ``rows`` inputs)."""
        channel = self.channel(kind, family)
        if channel is None:
            return self.linear(x, w, rows)
        codes, scale = channel_codes(w, channel[0])
        return code_linear(self.mm_in(x), codes, self.tile_rows(kind, family), channel[1]) * scale

    def mm_in(self, x: jax.Array) -> jax.Array:
        """A matmul's activation input as the kernel feeds it to the MXU."""
        return round_to(x, self.matmul_input)

    def linear(self, x: jax.Array, w: jax.Array, rows: int | None = None,
               operands: str | None = None, scales: jax.Array | None = None) -> jax.Array:
        """``x @ w.T`` (PyTorch ``[out, in]`` w, bf16 values) as the kernel multiplies an
        activation by a weight: the input rounded for the MXU, the dot of those operands
        (``chunked_linear``, by chunks of ``rows`` inputs when the matrix streams in tiles;
        ``operands`` "mixed_fp8" where the kernel feeds the weight as FP8 codes; ``scales``
        [chunks, out] where each chunk's partial product is multiplied by its own)."""
        return chunked_linear(self.mm_in(x), w, rows, operands or self.matmul_input, scales)


def bf16_weights(w: np.ndarray) -> np.ndarray:
    """Weights drawn in f64, as bf16 values that are the same on every ml_dtypes version: rounded
    through f32. ml_dtypes 0.7 rounds f64 to bf16 directly, earlier versions through f32; the
    two differ in about 5 of 10**6 values, and a MINI model's weights must not move with a
    dependency's patch release (the exact emulation checks were measured on these values)."""
    return np.asarray(w, np.float32).astype(ml_dtypes.bfloat16)


def allreduce(partials: list[jax.Array], reduce: Reduce) -> jax.Array:
    """The all-reduced value every rank ends with, from rank r's partial sum ``partials[r]``.

    Stage (size, stride): rank r is member ``(r // stride) % size`` of the group
    ``base + i * stride``; it receives every member's value rounded to the wire dtype and adds
    them in f32 in member order (member 0 first), as ``mkc.runtime.collectives.allreduce_stage``
    does, so the emulation is exact up to the f32 rounding of the partial sums themselves. A
    scattered form adds the same values in the same order; gathering its sums in bf16 rounds
    the result once (``Reduce.rounded_from``).
    """
    values = [p.astype(jnp.float32) for p in partials]
    ranks = len(values)
    for size, stride in reduce.stages:
        wire = [round_to(v, reduce.wire) for v in values]
        new = []
        for r in range(ranks):
            local = (r // stride) % size
            base = r - local * stride
            total = wire[base]
            for i in range(1, size):
                total = total + wire[base + i * stride]
            new.append(total)
        values = new
    if reduce.rounded_from is not None and int(np.prod(values[0].shape[:-1])) >= reduce.rounded_from:
        return round_to(values[0], reduce.gather)
    return values[0]


def chunks(total: int, width: int) -> list[tuple[int, int]]:
    """Contiguous per-rank ranges of ``width`` over ``total`` (the last ones may be short or
    empty: a padded split holds zeros there)."""
    n = -(-total // width)
    return [(r * width, min((r + 1) * width, total)) for r in range(n)]


def in_out(w: jax.Array) -> jax.Array:
    """PyTorch ``[out, in]`` w as the kernel's dot reads it: ``[in, out]`` with rows contiguous,
    a buffer the host wrote (in interpret mode every weight tile a kernel loads comes from a
    host callback), so that XLA compiles the emulation's dot to the kernel's op.

    XLA on CPU picks a dot's routine by its shapes and its operands' layouts. On an AVX512-BF16
    host a bf16 dot of two or more rows runs in YNNPACK whatever the weight's layout, but a
    one-row dot runs as an f32 matrix-vector product whose order follows the layout: with the
    ``[out, in]`` weight, 1e-5 from the kernel's on a [1, 256] x [256, 512] product. A transpose
    inside the program does not fix the layout, even behind ``optimization_barrier``: XLA lays
    the transposed value out as it likes (there, as the ``[out, in]`` bytes, and it fused the
    dot into a loop: equal to the kernel's one-row dot, not to its two-row dot (the operands
    converted to f32 first), nor to its one-row dot of several ring tiles). A callback's
    result has the row-major layout the kernel's tile has (outside a trace, where a callback
    costs a dispatch, the host transposes the value itself: the same bytes)."""
    if not isinstance(w, jax.core.Tracer):     # a value: the host writes it now
        return jnp.asarray(np.ascontiguousarray(np.asarray(w).T))
    if _HELD_IN_OUT.get():
        return w.T
    return jax.pure_callback(lambda a: np.ascontiguousarray(np.asarray(a).T),
                             jax.ShapeDtypeStruct(w.shape[::-1], w.dtype), w)


_HELD_IN_OUT = contextvars.ContextVar("held_in_out", default=False)


@contextlib.contextmanager
def held_in_out():
    """While tracing under it, ``in_out`` of a traced weight is its transpose in the program: for a
    caller that passes each weight as its ``[in, out]`` buffer (host-written, rows contiguous)
    and hands the reference that buffer's transpose, so the two transposes cancel and the dot
    reads the parameter's own row-major bytes, the layout ``in_out``'s callback returns, without
    a host round trip of every weight per call (`mkc.serve.emulation`). Exact only where every
    weight reaching ``in_out`` is a slice of such a parameter (not a value computed from one:
    codes, FP8 block values, a stacked expert's matrix)."""
    token = _HELD_IN_OUT.set(True)
    try:
        yield
    finally:
        _HELD_IN_OUT.reset(token)


def _dot(x: jax.Array, w: jax.Array, operands: str) -> jax.Array:
    """``x @ w.T`` with f32 accumulation, as one dot of ``operands`` ("bf16": the dot a kernel
    issues to the MXU, bf16 operands accumulated in f32; x and w must hold bf16 values;
    "mixed_fp8" / "mixed_fp4": a kernel's bf16 x fp8 (fp4) dot, w holding the fp8 (e2m1)
    values times a power of two)."""
    if operands == "mixed_fp4" and x.size > x.shape[-1]:
        # A bf16 x fp4 dot: interpret mode unpacks the codes (``pltpu.bitcast``) by moving the
        # input axis last, a view XLA lays out [out, in]; with two or more rows XLA's CPU dot of
        # that weight sums as the f32 dot of the [out, in] values (measured bit-equal at 2, 3,
        # 8 and 16 rows, 128 to 1024 inputs: tests/families/kimi_k3/test_k3_fp4.py), and one
        # row as the matrix-vector product of the [in, out] weight (below).
        return jnp.einsum("...i,oi->...o", x.astype(jnp.float32), w.astype(jnp.float32),
                          precision=jax.lax.Precision.HIGHEST)
    if operands in ("mixed_fp8", "mixed_fp4", "mixed_int8"):
        # XLA's CPU runs a bf16 x fp8 dot (and a one-row bf16 x fp4 dot) as an f32 dot of the
        # weight as the kernel holds it, [in, out] (``in_out``), and w's power of two scales
        # every partial sum exactly.
        return jnp.dot(x.astype(jnp.float32), in_out(w.astype(jnp.float32)),
                       precision=jax.lax.Precision.HIGHEST)
    if operands == "bf16":
        return jnp.dot(x.astype(jnp.bfloat16), in_out(w.astype(jnp.bfloat16)),
                       preferred_element_type=jnp.float32)
    return jnp.einsum("...i,oi->...o", x, w, precision=jax.lax.Precision.HIGHEST)


CODE_MAX = {"fp8": 448.0, "int8": 127.0}     # `mkc.model.channel_codes.QMAX`


def channel_codes(w: jax.Array, codes: str) -> tuple[jax.Array, jax.Array]:
    """A weight ``[out, in]`` whose rows are 8-bit codes times one scale each (held values,
    `mkc.layers.dense_formats`) -> (the codes' values f32 ``[out, in]``, the scales ``[out]``).
    A row's largest code is the code's largest, so its scale is its largest magnitude over
    that (a bf16 value: rounding the quotient to bf16 makes it exact), and each code the
    value over the scale, rounded to the code (exact already, kept so whatever the division)."""
    w = jnp.asarray(w, jnp.float32)
    top = jnp.max(jnp.abs(w), axis=-1)
    scale = (top / CODE_MAX[codes]).astype(jnp.bfloat16).astype(jnp.float32)
    safe = jnp.where(scale > 0, scale, 1.0)[:, None]
    values = jnp.where(scale[:, None] > 0, w / safe, 0.0)
    if codes == "int8":
        values = jnp.round(values)
    else:
        values = values.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    return values, scale


@functools.partial(jax.jit, static_argnums=(2, 3))     # pltpu.bitcast lowers; it does not run eagerly
def code_linear(x: jax.Array, w: jax.Array, rows: int | None, operands: str) -> jax.Array:
    """``x @ w.T`` for a weight of 8-bit codes' values (PyTorch ``[out, in]``) as the kernel
    multiplies a matrix stored as codes (`mkc.runtime.ring.codes_dot`), in its formulation:
    its inputs in ring tiles of ``rows`` (the last zero padded to them), each tile's codes as
    the ring holds them (two input rows a bf16 element) reinterpreted in place
    (``pltpu.bitcast``), its dots 256 columns wide (`mkc.ir.CODE_DOT_COLUMNS`), the tiles'
    products added in order. ``operands``: "mixed_fp8" / "mixed_int8" (the codes fed as they
    are) or "bf16" (FP8 converted first).

    XLA's CPU sums an f32 dot in an order that depends on its shape and on its operands'
    layouts: a 256-column dot sums every column alike wherever it sits (measured for 1 to 16
    rows and 128 to 2048 inputs), and the codes reinterpreted as the kernel does reach it in
    the kernel's layout (from a plain ``[in, out]`` array a 256 x 256 tile's dot sums in
    another order). So these dots give the kernel's values whatever the layout put where."""
    from jax.experimental.pallas import tpu as pltpu
    n = 256
    out, width = w.shape
    rows = rows or width
    pad_in, pad_out = -width % rows, -out % n
    code_type = jnp.int8 if operands == "mixed_int8" else jnp.float8_e4m3fn
    # [in, out] codes as their bytes, two rows a bf16 element (row 2a low, 2a + 1 high)
    codes = jnp.pad(in_out(w), ((0, pad_in), (0, pad_out))).astype(code_type)
    pairs = jax.lax.bitcast_convert_type(codes, jnp.uint8).reshape((width + pad_in) // 2, 2, -1)
    packed = jax.lax.bitcast_convert_type(jnp.transpose(pairs, (0, 2, 1)), jnp.bfloat16)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, pad_in)]).astype(jnp.bfloat16)
    total = None
    def codes_of(tile: jax.Array) -> jax.Array:
        if code_type == jnp.int8:
            return pltpu.bitcast(tile, jnp.int8)
        tw = jax.lax.bitcast_convert_type(pltpu.bitcast(tile, jnp.uint8), jnp.float8_e4m3fn)
        return tw if operands == "mixed_fp8" else tw.astype(jnp.bfloat16)
    for lo in range(0, width + pad_in, rows):
        part = jnp.concatenate([jnp.dot(x[..., lo:lo + rows],
                                        codes_of(packed[lo // 2:(lo + rows) // 2, c:c + n]),
                                        preferred_element_type=jnp.float32)
                                for c in range(0, out + pad_out, n)], axis=-1)
        total = part if total is None else total + part
    return total[..., :out]


def chunked_linear(x: jax.Array, w: jax.Array, rows: int | None = None,
                   operands: str = "f32", scales: jax.Array | None = None) -> jax.Array:
    """``x @ w.T`` (PyTorch ``[out, in]`` w) accumulated in f32, summed as a kernel that splits
    the contraction into consecutive chunks of ``rows`` inputs (ring tiles, MXFP4 pack groups)
    sums it: one dot per chunk, added in order. None, or one chunk: a single dot.

    ``operands`` "bf16" multiplies as the kernel's bf16 dot does. XLA need not sum that dot in
    the order of the f32 dot of the same values: on a CPU with AVX512-BF16 it does not (1e-5
    apart on a [2, 256] x [256, 512] product), and the flips that follow grow to the size of a
    1 % op error within a few layers.

    ``scales`` [chunks, out] (an FP8 checkpoint's f32 block scales, `fp8 block R x C`): each
    chunk's dot times its row of them, summed as the kernel sums them (``_scaled_sum``)."""
    width = x.shape[-1]
    if scales is not None:
        step = rows or width
        return _scaled_sum([_dot(x[..., lo:lo + step], w[:, lo:lo + step], operands)
                            for lo in range(0, width, step)], scales)
    if rows is None or rows >= width:
        return _dot(x, w, operands)
    total = None
    for lo in range(0, width, rows):
        part = _dot(x[..., lo:lo + rows], w[:, lo:lo + rows], operands)
        total = part if total is None else total + part
    return total


@jax.jit
def _scaled_sum(parts: list[jax.Array], scales: jax.Array) -> jax.Array:
    """``sum_i parts[i] * scales[i]`` in the kernel's expression, jitted: each partial product
    times its scales, added to the sum in order. XLA's CPU contracts a multiply feeding an add
    into one FMA, so the kernel's sum is ``fma(p0, s0, p1 s1)``, then ``fma(p_i, s_i, sum)``
    (measured in interpret mode); this is the same expression, so XLA makes the same
    contractions of it."""
    total = None
    for i, part in enumerate(parts):
        scaled = part * scales[i:i + 1]
        total = scaled if total is None else total + scaled
    return total


def row_parallel(x: jax.Array, w: jax.Array, ranges: list[tuple[int, int]], ranks: int,
                 rounding: Rounding, reduce: Reduce, tile_rows: int | None = None,
                 channel: tuple[str, str] | None = None) -> jax.Array:
    """``x @ w.T`` (PyTorch ``[out, in]`` w) with the contraction split over ranks: rank r holds
    input range ``ranges[r]`` (ranks past the list hold nothing), computes its partial sum from
    bf16 inputs (tile by tile when the matrix streams in ring tiles of ``tile_rows`` rows), and
    the partials are all-reduced as the schedule says. ``channel`` (codes, operands): w is
    held as 8-bit codes with a scale per output row (``Rounding.channel``), every rank's partial
    sum of the codes times the scales."""
    xin = rounding.mm_in(x)
    zero = jnp.zeros((*x.shape[:-1], w.shape[0]), jnp.float32)
    operands, scale = rounding.matmul_input, None
    if channel is not None:
        (w, scale), operands = channel_codes(w, channel[0]), channel[1]
    partials = []
    for r in range(ranks):
        lo, hi = ranges[r] if r < len(ranges) else (0, 0)
        if hi <= lo:
            partials.append(zero)
            continue
        if scale is None:
            partials.append(chunked_linear(xin[..., lo:hi], w[:, lo:hi], tile_rows, operands))
        else:
            partials.append(code_linear(xin[..., lo:hi], w[:, lo:hi], tile_rows, operands) * scale)
    return allreduce(partials, reduce)
