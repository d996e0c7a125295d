"""The schedule IR: the resolved, typed, serialisable form every later stage reads.

Program points inside a layer kind are integers: point p sits before op p (p == len(ops) is
the end of the layer). At one point the order is: waits of copies started earlier, starts,
then waits of copies started at that same point.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field

from mkc.diagnostics import Span

DTYPE_BYTES = {"bf16": 2, "f32": 4, "int32": 4, "int8": 1, "u8": 1, "u32": 4, "fp8": 1}
# The (sublanes, 128) tile each dtype's aligned DMA and full-tile access uses: the granule the
# kernels lay rows out by (embedding rows, KV row blocks, pool panels). How much VMEM an array
# takes is a different question: see `padded_bytes`.
SUBLANE_TILE = {"f32": 8, "int32": 8, "bf16": 16, "int8": 32, "u8": 32, "u32": 8, "fp8": 32}
LANES = 128
SUBLANES = 8                     # TPU7x vreg sublanes: the normal tile height for 32-bit data
# Mosaic's "large" second-minor tile per element width, used when the row count is a multiple
# of it: (16, 128) for 16-bit data (TPU7x allows it for kernel arguments and scoped buffers
# alike), (32, 128) for 8-bit. Measured with benchmarks/vmem_probe.py.
LARGE_TILE_ROWS = {4: 8, 2: 16, 1: 32}


ALLOC_GRANULE = 512              # bytes: a scratch operand's size is a multiple of this
WINDOW_GRANULE = 1024            # bytes: a run_scoped buffer or an in/out window rounds to this


def tile_rows(rows: int, dtype: str) -> int:
    """The sublane tile height Mosaic (TPU7x) gives an array whose second-minor dim is `rows`.

    Learned from libtpu (benchmarks/vmem_probe.py, data in benchmarks/data/vmem_probe.json):
    - rows a multiple of the large tile (f32 8, bf16 16, int8/u8 32): that tile;
    - else rows >= 8: (8, 128) tiles, so rows pad to a multiple of 8;
    - else the smallest power of two >= rows, but at least the packing (elements per 32-bit
      word: f32 1, bf16 2, int8 4): f32 [1, W] takes one row, bf16 [1, W] two, f32 [3, W]
      four, u8 [3, W] four.
    So a bf16 [8, W] batch-row block takes 8 rows, not 16, and f32 [1, W] one row, not 8."""
    size = DTYPE_BYTES[dtype]
    large = LARGE_TILE_ROWS[size]
    if rows % large:
        large = SUBLANES
    if large <= rows:
        return large
    tile = 4 // size
    while tile < min(rows, SUBLANES):
        tile *= 2
    return tile


def kv_window_tiles(rows: int) -> int:
    """Aligned bf16 row tiles (16 tokens) that `rows` consecutive positions of one sequence can
    touch: what a KV row write reads and writes back (`mkc.runtime.kv.write_rows`)."""
    return 1 + -(-(rows - 1) // SUBLANE_TILE["bf16"])


def round_up(n: int, m: int) -> int:
    """`n` rounded up to a multiple of `m`."""
    return -(-n // m) * m


def padded_bytes(shape: tuple[int, ...], dtype: str, *, scoped: bool = False) -> int:
    """VMEM bytes Mosaic allocates for an array: a scratch operand, or with `scoped` a
    `pl.run_scoped` buffer. The minor dim pads to 128 lanes, the second-minor to the tile
    height of `tile_rows`; leading dims multiply. A 1-D array pads to 512 bytes. A scoped
    buffer's size then rounds up to 1 KiB, and a 32-bit scoped buffer at most 128 lanes wide
    is not tiled at all (f32 [2, 3, 128] scoped takes 3 KiB, as a scratch operand 4 KiB)."""
    dims = list(shape) or [1]
    size = DTYPE_BYTES[dtype]
    if len(dims) == 1:
        n = round_up(dims[0] * size, ALLOC_GRANULE)
    else:
        # A 32-bit scoped buffer no wider than one 128-lane row is left untiled (1-row tiles).
        tile = 1 if scoped and size == 4 and dims[-1] <= LANES else tile_rows(dims[-2], dtype)
        n = size * round_up(dims[-1], LANES) * round_up(dims[-2], tile)
        for d in dims[:-2]:
            n *= d
    return round_up(n, WINDOW_GRANULE) if scoped else n


def window_bytes(shape: tuple[int, ...], dtype: str) -> int:
    """VMEM bytes of a kernel input or output held in VMEM (a `memory_space=VMEM` BlockSpec):
    a window of the array in XLA's layout, whose tiles follow the same rule, rounded up to
    1 KiB."""
    return padded_bytes(shape, dtype, scoped=True)


@dataclass(frozen=True)
class Buffer:
    """A VMEM allocation. `scope` is None for kernel-lifetime buffers, else (kind, first, last)
    op indices (inclusive) within which it exists."""

    name: str
    cls: str                     # budget class: ring, parity, state, kv, collective, activation
    shape: tuple[int, ...]
    dtype: str
    scope: tuple[str, int, int] | None = None
    batch_axis: int | None = None   # the dim that is the batch (sized per compiled batch)
    span: Span = field(compare=False, default_factory=Span.unknown)   # where the spec made it
    # The name as the spec writes it, when the IR's differs (a phase's `conv_buf` is
    # `gdn_conv_buf`): what diagnostics and hovers say.
    written: str = field(compare=False, default="")
    # The kernel widths (rows, inclusive) whose kernels allocate it; None: every kernel.
    rows: tuple[int, int] | None = None

    @property
    def label(self) -> str:
        return self.written or self.name

    def exists_at(self, rows: int) -> bool:
        """Whether the kernel of `rows` rows allocates it."""
        return self.rows is None or self.rows[0] <= rows <= self.rows[1]

    def shape_expr(self, batch: str = "B") -> str:
        """The shape as Python source with the batch dim as a variable."""
        dims = [batch if i == self.batch_axis else str(d) for i, d in enumerate(self.shape)]
        return "(" + ", ".join(dims) + ("," if len(dims) == 1 else "") + ")"

    @property
    def vmem_bytes(self) -> int:
        """What Mosaic allocates for it: a scratch operand, a `pl.run_scoped` buffer (scoped),
        or the window of a kernel output held in VMEM (class "output")."""
        if self.cls == "output":
            return window_bytes(self.shape, self.dtype)
        return padded_bytes(self.shape, self.dtype, scoped=self.scope is not None)

    def at_batch(self, batch: int) -> "Buffer":
        """This buffer as the kernel compiled for `batch` allocates it."""
        if self.batch_axis is None:
            return self
        shape = list(self.shape)
        shape[self.batch_axis] = batch
        return dataclasses.replace(self, shape=tuple(shape))


@dataclass(frozen=True)
class StreamFamily:
    """A streamed matrix family of one layer kind (or the tail): its per-rank tiling."""

    kind: str                    # layer kind or "tail"
    name: str
    rows: int
    cols: int
    row_tiles: int
    col_tiles: int
    partial_out: bool
    tile_rows: int               # this family's tile: a sub-block of a ring slot
    tile_cols: int
    # How its values sit in the ring's bf16 slots: "bf16", or 8-bit codes ("fp8", "int8":
    # `format CLASS FORMAT channel rounded`, `mkc.layers.dense_formats`) two input rows a bf16
    # element, a column block's last row tile followed by its scale rows (`ring_tile_shape`).
    codes: str = "bf16"
    fp8_operand: bool = True     # FP8 codes fed to the MXU as they are (else converted first)
    format_class: str = ""       # the dense class whose `format` line stores it as codes

    @property
    def tiles(self) -> int:
        return self.row_tiles * self.col_tiles

    @property
    def tile_bytes(self) -> int:
        """Bytes of one tile without scale rows (every tile of a bf16 family)."""
        return ring_tile_shape(self.tile_rows, self.tile_cols, self.codes, False)[0] \
            * self.tile_cols * DTYPE_BYTES["bf16"]

    def slot_shape(self, k: int) -> tuple[int, int]:
        """The slot rows and columns tile k of its run takes (k: tiles run column blocks outer,
        rows inner): a column block's last row tile carries its scale rows."""
        return ring_tile_shape(self.tile_rows, self.tile_cols, self.codes,
                               k % self.row_tiles == self.row_tiles - 1)

    def bytes_of(self, k: int) -> int:
        """Bytes the copy of tile k of its run moves."""
        rows, cols = self.slot_shape(k)
        return rows * cols * DTYPE_BYTES["bf16"]

    @property
    def run_bytes(self) -> int:
        """Bytes every copy of its run moves."""
        return sum(self.bytes_of(k) for k in range(self.tiles))

    @property
    def slot_shapes(self) -> set[tuple[int, int]]:
        return {self.slot_shape(k) for k in range(self.row_tiles)}

    @property
    def read_cols(self) -> int:
        """The slot columns its matmul reads: its tile's, or for codes whole dots'."""
        return self.tile_cols if self.codes == "bf16" else code_read_cols(self.tile_cols)


# ---- 8-bit codes in the ring's bf16 slots (`mkc.layers.dense_formats`) ------------------------
CODE_DTYPES = ("fp8", "int8")
# A column block's per-column scale: one bf16 row after its last row tile's codes, in a whole
# bf16 (16, 128) tile of rows (the DMA and load granule).
SCALE_ROWS = SUBLANE_TILE["bf16"]
# Codes are multiplied 256 columns a dot (tpu7x's MXU width: libtpu schedules a wider dot's
# the same, benchmarks/format_probe.py --dense): a codes tile of 128-column steps has its last
# dot read on past its columns, to a whole 256, in its slot (`code_read_cols`). On a CPU
# (interpret mode) XLA's f32 dot of 256 columns sums each column alike wherever it sits, so
# the references' emulation can make the same dots (`mkc.reference.rounding`).
CODE_DOT_COLUMNS = 256


def code_read_cols(tile_cols: int) -> int:
    """The slot columns a codes tile's dots read: its columns to a whole `CODE_DOT_COLUMNS`."""
    return round_up(tile_cols, CODE_DOT_COLUMNS)


def ring_tile_shape(tile_rows: int, tile_cols: int, codes: str, last: bool) -> tuple[int, int]:
    """(slot rows, columns) of a ring tile of `tile_rows` input rows: bf16 values one row a
    slot row; 8-bit codes two rows a slot row (`mkc.runtime.pool`'s pairing), and after a
    column block's last row tile its `SCALE_ROWS` of scales."""
    if codes == "bf16":
        return tile_rows, tile_cols
    return tile_rows // 2 + (SCALE_ROWS if last else 0), tile_cols


def max_code_cols(slot_cols: int) -> int:
    """Columns of the widest 8-bit tile whose dots (`code_read_cols`) a slot of `slot_cols`
    columns holds."""
    return slot_cols // CODE_DOT_COLUMNS * CODE_DOT_COLUMNS


def max_code_rows(slot_rows: int) -> int:
    """Input rows of the largest 8-bit tile a slot of `slot_rows` bf16 rows holds with its
    scale rows, in whole 128-row steps."""
    return (2 * (slot_rows - SCALE_ROWS)) // LANES * LANES


@dataclass(frozen=True)
class Stream:
    """All streamed matrices of the step, in consumption order, through one ring of slots.

    Each family has its own tile shape (chosen to waste little bandwidth on padding); a slot
    holds the largest, and a copy moves only its family's sub-block."""

    ring: str
    slots: int
    ahead: int
    dtype: str
    tile_rows: int               # slot shape: the largest family tile
    tile_cols: int
    families: dict[str, list[StreamFamily]]      # per kind, in consumption order
    tail: list[StreamFamily]
    layer_tile_offset: list[int]           # first global tile index of each layer
    tail_tile_offset: int
    total_tiles: int
    useful_bytes: int                      # unpadded matrix bytes
    streamed_bytes: int                    # bytes the copies move, tile padding included
    tile_shapes: list[tuple[int, int]]     # distinct family tile shapes ("tile classes")
    span: Span = field(compare=False, default_factory=Span.unknown)

    def tile_sequence(self, layer_kinds: list[str]) -> list[StreamFamily]:
        """The family of every tile of the step, in stream order."""
        seq: list[StreamFamily] = []
        for kind in layer_kinds:
            for f in self.families[kind]:
                seq += [f] * f.tiles
        for f in self.tail:
            seq += [f] * f.tiles
        return seq


@dataclass(frozen=True)
class Transfer:
    """A state copy between HBM and a VMEM buffer inside one layer kind."""

    direction: str               # "load" (HBM->VMEM) | "store" (VMEM->HBM)
    state: str                   # state family, e.g. "recurrent"
    buffer: str
    start: int                   # program point
    waits: tuple[int, ...]       # program points (a correct schedule has exactly one wait)
    drain: int = 0               # waits at the start of the next layer of this kind (or at exit)
    span: Span = field(compare=False, default_factory=Span.unknown)


@dataclass(frozen=True)
class KvStream:
    slots: int
    tokens: int
    ahead: int
    op: str                      # the op that consumes the tiles (scope of the tile buffers)
    caches: tuple[str, ...] = ()         # the kind's cache families, in graph order
    tile_buffers: tuple[str, ...] = ()   # each cache's scoped tile buffer
    rows_buffer: str = ""                # the new rows' read-modify-write tiles
    span: Span = field(compare=False, default_factory=Span.unknown)
    # `at layer start`: the first `ahead` tiles' copies start at point 0 into tile buffers
    # scoped from there to `op`; `writer` (the op writing the new rows) waits them and writes
    # its rows into the tiles holding them too (`mkc.runtime.kv.write_rows`).
    at_start: bool = False
    writer: str = ""
    # `kv ring N slots` (`mkc.resolve.kv_ring`): the cache in HBM is a ring of N token slots,
    # position p in slot p % N, holding the kind's attention window of `window` positions;
    # 0: one slot per token of the context.
    ring: int = 0
    window: int = 0
    ring_span: Span = field(compare=False, default_factory=Span.unknown)

    def cache_tokens(self, context: int) -> int:
        """Token slots of the cache in HBM: the ring's, or the context."""
        return self.ring or context


def scatter_chunk(width: int, size: int) -> int:
    """Columns of a scattered all-reduce's chunk: `width` over the first group's `size` ranks,
    rounded up to whole lane tiles (a remote copy moves whole tiles); the columns past `width`
    travel as zeros, so every sum is the one-shot stages' and the result is cut back to
    `width`."""
    return -(-width // (size * LANES)) * LANES


@dataclass(frozen=True)
class AllReduce:
    after_op: str
    algorithm: str               # "direct" | "two_level"
    wire_dtype: str
    # Direct all-reduces run in order; a stage (size, stride) reduces over the ranks
    # base + i * stride, i < size (ranks are numbered core-fastest, then chip, then host).
    stages: tuple[tuple[int, int], ...]
    width: int = 0               # columns of the partial sums
    span: Span = field(compare=False, default_factory=Span.unknown)
    # `scatter [from N rows]`: kernels of at least this many rows run the scattered form
    # (`scattered`); None: the one-shot stages at every width.
    scatter_from: int | None = None
    # `overlap`: the first op reading its result (resolve's), before which it finishes; it
    # starts after its op (`mkc.program`) and uses buffers of its own (`owner`). None: run at once.
    finish_before: str | None = None
    # `scatter nested`: every stage reduce-scatters the chunk the stage before left, and the
    # sums are gathered back stage by stage in reverse (`scatter_stages`)
    nested: bool = False
    # `scatter gather DTYPE`: the dtype the scattered form gathers its sums back in ("f32":
    # exact; "bf16": the result rounded once)
    gather_dtype: str = "f32"

    @property
    def overlap(self) -> bool:
        return self.finish_before is not None

    @property
    def owner(self) -> str | None:
        """Whose buffers its stages use: its op's own when it overlaps ops (a use in flight
        must meet no other use of its buffers), else None, the group's shared ones."""
        return self.after_op if self.overlap else None

    def scattered(self, rows: int) -> bool:
        """Whether the kernel of `rows` rows runs the scattered form: the first stage's group
        reduce-scatters the columns (member j sums chunk j), the other stages reduce the
        chunk (`nested`: each reduce-scatters it again), and the sums are all-gathered back in
        `gather_dtype`."""
        return self.scatter_from is not None and rows >= self.scatter_from

    @property
    def chunk(self) -> int:
        """Columns of the scattered form's chunk (`scatter_chunk`)."""
        return scatter_chunk(self.width, self.stages[0][0])

    def scatter_stages(self) -> tuple[tuple[int, int, int], ...]:
        """The scattered form's reduce-scatters as (size, stride, columns of the chunk each
        member sums): the first group's alone, or with `nested` every stage's, each on the
        chunk the one before left. The sums are gathered back over the same groups in reverse;
        the stages after the last reduce-scatter reduce its chunk one-shot."""
        out, width = [], self.width
        for size, stride in (self.stages if self.nested else self.stages[:1]):
            width = scatter_chunk(width, size)
            out.append((size, stride, width))
        return tuple(out)

    @staticmethod
    def buffer_name(wire: str, size: int, stride: int, span: tuple[int, int] | None = None,
                    owner: str | None = None) -> str:
        """The receive buffer of one-shot stages over one group: each group structure has its
        own, so the parity argument for reusing it holds within one fixed set of peers. Where
        all-reduces scatter from some rows, each span of kernel widths between those rows
        (`row_spans`) has its own, as wide as the one-shot payloads of that span: `span` for
        one below the widest kernels' (None). An overlapping all-reduce's are its own
        (`owner`, its op)."""
        spanned = "" if span is None else f"_{span[0]}to{span[1]}"
        return f"recv{spanned}__{wire}_{size}x{stride}{_owned(owner)}"

    @staticmethod
    def role_buffer_name(role: str, wire: str, size: int, stride: int,
                         owner: str | None = None) -> str:
        """A buffer of the scattered form over the group (size, stride): `scatter`, the
        reduce-scatter's slots `[2, size, B, chunk]` (slot [p, i]: member i's copy of this
        rank's chunk); `chunk`, a later stage's slots for chunks; `sums`, the all-gather of the
        chunk sums (in the gather dtype, `wire`). Each in the kernels whose rows run the
        scattered form."""
        return f"{role}__{wire}_{size}x{stride}{_owned(owner)}"

    @staticmethod
    def staging_name(wire: str, size: int, stride: int, owner: str | None = None) -> str:
        """The reduce-scatter's send staging `[size, B, chunk]`: the partial sums' chunk j,
        in the wire dtype, for member j (no semaphores or use counter of its own)."""
        return f"{STAGING}{wire}_{size}x{stride}{_owned(owner)}"


def _owned(owner: str | None) -> str:
    return "" if owner is None else f"__{owner}"


STAGING = "send__"                # a reduce-scatter's send staging buffer (`staging_name`)


def row_spans(reduces: list[AllReduce], rows_max: int) -> list[tuple[int, int]]:
    """The spans of kernel widths (rows, inclusive) cut at every row count an all-reduce
    scatters from: within a span each all-reduce runs one form."""
    cuts = sorted({a.scatter_from for a in reduces if a.scatter_from and a.scatter_from > 1})
    return list(zip([1, *cuts], [c - 1 for c in cuts] + [rows_max]))


def is_staging(buffer: str) -> bool:
    """Whether a collective buffer is a send staging buffer, which no remote copy targets."""
    return buffer.startswith(STAGING)


@dataclass(frozen=True)
class AllGather:
    """Column shards of an op's output gathered over a group (size, stride) of ranks."""

    after_op: str
    size: int
    stride: int
    width: int                   # columns each rank contributes
    wire_dtype: str              # what each share travels (and is received) in
    span: Span = field(compare=False, default_factory=Span.unknown)
    finish_before: str | None = None     # as `AllReduce.finish_before` (its buffer is always its own)

    @property
    def overlap(self) -> bool:
        return self.finish_before is not None

    @staticmethod
    def buffer_name(op: str) -> str:
        return f"gather__{op}"


@dataclass(frozen=True)
class Exchange:
    """Each core of a chip computes a share of an op's columns; siblings swap shares."""

    after_op: str
    width: int
    wire_dtype: str
    span: Span = field(compare=False, default_factory=Span.unknown)

    @staticmethod
    def buffer_name(op: str) -> str:
        return f"exchange__{op}"


@dataclass(frozen=True)
class PooledMatrix:
    """A whole matrix held in a pool view, at a byte offset from the view's start. Pools are
    bf16 [rows, 128]: a matrix is stored as 128-lane column panels, and u8 data (MXFP4 codes
    and scales) packs two rows per bf16 element, read back with a value bitcast."""

    kind: str
    name: str
    rows: int
    cols: int
    dtype: str
    offset: int
    stacked: bool = False        # its panels stacked without tile padding (`stacked_rows`)

    @property
    def nbytes(self) -> int:
        return self.rows * self.cols * DTYPE_BYTES[self.dtype]


@dataclass(frozen=True)
class PoolView:
    """A weight view (whole matrices per layer kind) or a slot view (N routed experts, each
    the same set of matrices at the same offsets within its slot)."""

    name: str
    pool: str
    matrices: dict[str, list[PooledMatrix]]    # kind -> matrices (slot view: "expert")
    slots: int                                 # 0 for a weight view
    slot_bytes: int
    nbytes: int
    span: Span = field(compare=False, default_factory=Span.unknown)


@dataclass(frozen=True)
class Pool:
    name: str
    nbytes: int                  # the largest view
    views: list[PoolView]
    span: Span = field(compare=False, default_factory=Span.unknown)

    def view(self, name: str) -> PoolView:
        return next(v for v in self.views if v.name == name)


@dataclass(frozen=True)
class ViewCopy:
    """Copies into a pool view: `prefetch next` (the next layer's weights, from a point of this
    layer) or `fetch experts` (routed experts as routing picks them)."""

    pool: str
    view: str
    start: int                   # program point in this layer kind
    consumer: str = ""           # fetch: the op that reads the experts
    span: Span = field(compare=False, default_factory=Span.unknown)


def rows_within(rows: int, from_rows: int, to_rows: int) -> bool:
    """Whether a kernel of `rows` rows lies in from_rows .. to_rows (0: no upper bound)."""
    return from_rows <= rows and (not to_rows or rows <= to_rows)


def held_refills(tiles: int, ahead: int) -> range:
    """The layer's tiles, among its first `tiles`, whose refills a `refill` holds back: those
    whose refill is a tile read after them (`ahead` on, past the first `tiles`); the earlier
    ones refill a tile the same ops read, as each is consumed."""
    return range(max(0, tiles - ahead), tiles)


@dataclass(frozen=True)
class RingRefill:
    """`refill RING after OP [from N rows | up to N rows]`: in kernels of `from_rows` to
    `to_rows` rows (0: any), the ring refills for tiles read after `after_op` that consuming
    the layer's first `tiles` tiles (those its ops read up to `after_op`, a prefix of the kind's
    stream) would start (`held_refills`) begin right after `after_op`, before its collectives,
    so the copies the ops up to it wait on have HBM to themselves."""

    after_op: str
    tiles: int
    from_rows: int = 1
    to_rows: int = 0
    span: Span = field(compare=False, default_factory=Span.unknown)

    def applies(self, rows: int) -> bool:
        """Whether the kernel of `rows` rows holds the refills back."""
        return rows_within(rows, self.from_rows, self.to_rows)


@dataclass(frozen=True)
class ScratchMeasure:
    """VMEM libtpu allocates for one compiled kernel beyond what mkc counts (the register
    allocator's spill slots, Mosaic's internal scratch, allocation rounding): its use read from
    the compiled HLO minus mkc's peak of buffers and windows, for the kernel of `rows` rows of
    a geometry (`key`: `mkc.checks.capacity.scratch_key`). Measured by
    benchmarks/compiler_scratch.py; a family ships its measures in `compiler_scratch.json`."""

    key: tuple[tuple[str, str], ...]
    model: str                   # the measured model, for people (the key's dims digest decides)
    kernel: str                  # "decode" or "verify R x S"
    rows: int
    kv_tokens: int               # the longest KV tile of the measured spec
    bytes: int                   # libtpu's use minus mkc's count (at least the spill slots)
    spill_bytes: int             # the spill slots' peak in libtpu's LLO (-1: not read)
    used_bytes: int              # libtpu's VMEM use of the kernel
    libtpu: str                  # libtpu version measured with


# How a rounded block format stores its scale (`format CLASS fp4|fp8 block N rounded [scale S]`):
# "e8m0", a power of two, the smallest holding the block's largest magnitude; "bf16", a bf16
# value searched per block for the least squared error (`mkc.model.mxfp4.searched_bf16_scales`).
BLOCK_SCALES = ("e8m0", "bf16")


@dataclass(frozen=True)
class WeightFormat:
    """How a matrix class is stored (`format CLASS NAME [block ROWS [x COLS]] [rounded [scale
    S]]`): the format, the input rows one scale covers (0: the format's own), the output
    columns it covers (0: one column, a scale each; COLS: an FP8 checkpoint's f32 scale per
    ROWS x COLS block of its `[out, in]` matrix, DeepSeek-V3's 128 x 128) and whether the target's MXU takes
    FP8 values as a matmul operand (`mkc.target.Generation.fp8_operand`), so codes can reach it
    as they are. FP4 codes always reach it as they are: resolve refuses `fp4` on a target
    whose MXU does not take them (`mkc.target.Generation.fp4_operand`)."""

    name: str
    block: int = 0
    fp8_operand: bool = True
    # `rounded`: packing may round values the format cannot hold exactly (an fp4 block's
    # e2m1 codes under one scale) to the nearest it holds; without it it refuses them.
    rounded: bool = False
    # The spec's `format` line ("kimi_k3.sched:40"), for what packing refuses or reports.
    where: str = ""
    cols: int = 0
    # `channel`: one scale per output column (the dense classes' FP8 and int8 codes,
    # `mkc.layers.dense_formats`) rather than per block of input rows.
    channel: bool = False
    # `scale bf16`: a rounded block's scale is a searched bf16 value, not a power of two.
    scale: str = "e8m0"

    @property
    def spelled(self) -> str:
        """The format as a spec writes it after the class: `fp4 block 512 rounded`, `fp8 block
        128 x 128`, `int8 channel rounded`."""
        block = f"block {self.block}" + (f" x {self.cols}" if self.cols else "")
        return " ".join([self.name, *([block] if self.block else []),
                         *(["channel"] if self.channel else []),
                         *(["rounded"] if self.rounded else []),
                         *([f"scale {self.scale}"] if self.scale != "e8m0" else [])])


@dataclass(frozen=True)
class MatrixFacts:
    """How a stored matrix's bytes count as matrix values: `values_per_byte` logical values per
    stored byte (0: not multiplied, e.g. MXFP4 scales). What multiplying by them costs is
    counted from the emitted kernel (`mkc.perf.work`)."""

    values_per_byte: float = 0.5


@dataclass(frozen=True)
class KindSchedule:
    name: str
    ops: list[str]
    matmuls: dict[str, str]      # op -> matrix family
    transfers: list[Transfer]
    kv: KvStream | None
    allreduces: list[AllReduce]
    vectors: list[tuple[str, tuple[int, ...]]]   # (family, per-rank shape) in the parity block
    states: dict[str, tuple[tuple[int, ...], str]]
    op_reads: dict[str, list[str]]     # op -> tensor families it reads (from the model graph)
    op_writes: dict[str, list[str]]
    # op -> (values it reads, values it writes): graph reads and writes held in registers (not
    # tensors, not VMEM activation buffers), in graph order; the generated code's locals.
    op_values: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    allgathers: list[AllGather] = field(default_factory=list)
    exchanges: list[Exchange] = field(default_factory=list)
    pooled: dict[str, str] = field(default_factory=dict)   # matrix family -> "pool.view"
    prefetch: ViewCopy | None = None
    fetch: ViewCopy | None = None
    refill: RingRefill | None = None


@dataclass(frozen=True)
class Parity:
    name: str
    ahead: int
    rows: int                    # rows of the per-layer f32 vector block
    cols: int
    layout: dict[str, dict[str, tuple[int, int, int]]]   # kind -> family -> (row, rows, width)
    span: Span = field(compare=False, default_factory=Span.unknown)


# What `expect RESOURCE headroom` can name: VMEM under the budget (at every kernel width),
# HBM per chip.
EXPECTABLE = ("vmem", "hbm")


@dataclass(frozen=True)
class Expectation:
    """`expect RESOURCE headroom at least N`: bytes the spec promises to leave free."""

    resource: str                # one of EXPECTABLE
    at_least: int
    span: Span = field(compare=False, default_factory=Span.unknown)


@dataclass(frozen=True)
class ScheduleIR:
    name: str
    source: str
    model: str
    family: str
    dims: dict                   # ModelDims as a dict (the numbers codegen and checks need)
    chip: str
    topology: str                # jax topology string, e.g. "tpu7x=2x2x1"
    mesh_axis: str
    ranks: int
    cores_per_chip: int
    batch_min: int
    batch_max: int
    context: int
    vmem_limit: int
    vmem_reserve: int
    vmem_capacity: int
    hbm_per_core: int
    layer_kinds: list[str]       # one per iteration of the layer loop (K3: per sublayer)
    kinds: dict[str, KindSchedule]
    buffers: list[Buffer]
    stream: Stream
    parity: Parity
    globals: dict[str, tuple[tuple[int, ...], str]]
    hbm_bytes_per_rank: dict[str, int]
    per_rank: dict[str, int] = field(default_factory=dict)          # from the model graph
    # Shard rules: dimension class -> (ways, stride); rank r holds part (r // stride) % ways.
    shards: dict[str, tuple[int, int]] = field(default_factory=dict)
    embed_reduce: AllReduce | None = None      # the embedding lookup's exact all-reduce
    pools: list[Pool] = field(default_factory=list)
    experts: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # per expert
    # Layer kinds whose routed experts are held in another layout (`FamilyGraph.kind_experts`):
    # kind -> one expert's matrices, and its expert classes' formats
    kind_experts: dict[str, dict[str, tuple[tuple[int, ...], str]]] = field(default_factory=dict)
    kind_weight_formats: dict[str, dict[str, WeightFormat]] = field(default_factory=dict)
    top_k: int = 0               # experts each row picks (0: no routed experts)
    experts_total: int = 0       # the model's routed experts
    setting_spans: dict[str, Span] = field(default_factory=dict)   # header lines, for diagnostics
    config_digest: str = ""      # sha256 of the model config's JSON, canonicalised
    # "kind.family" (or "kind.expert.family") -> MXU facts, for matrices that are not plain bf16
    matrix_facts: dict[str, MatrixFacts] = field(default_factory=dict)
    # The config.json object the model was read from: a module checks the HF weights it packs
    # against its family's tensor table of this config (mkc.runtime.inputs.check_hf_weights).
    model_config: dict = field(default_factory=dict)
    # The checkpoint directory the config is in ("": a config alone): `mkc check` reads its
    # headers (`mkc.checks.checkpoint`) and, with `rounded` formats, its values.
    checkpoint: str = ""
    verify_rows: int = 0         # rows per sequence of the verify step (0: none)
    verify_sequences: tuple[int, int] = (0, 0)
    # Matrix classes with a choice of format -> the format chosen (`format` lines, else the
    # checkpoint's): how they sit in HBM and VMEM and reach the MXU.
    weight_formats: dict[str, WeightFormat] = field(default_factory=dict)
    # What the family contributes past resolve, copied here so that no later stage goes back
    # to the family registry: its package (lowering, weights), the module and name of its
    # dims class, libtpu's measured scratch (every geometry the family measured), and the kernel inputs
    # its module passes in VMEM (at batch_max; `Buffer.at_batch` for others).
    family_package: str = ""
    dims_class: tuple[str, str] = ("", "")
    compiler_scratch: tuple[ScratchMeasure, ...] = ()
    vmem_inputs: tuple[Buffer, ...] = ()
    expectations: tuple[Expectation, ...] = ()
    # Whether the module passes the lm_head's logits through the lowering's `final_logits`
    # (`Family.final_logits`).
    final_logits: bool = False

    @property
    def rows_max(self) -> int:
        """Rows of the widest kernel: the largest decode batch or verify step. A verify
        kernel's buffers are those of a decode kernel of as many rows, or smaller (its KV
        tiles hold one entry per sequence), so capacity is checked at this width."""
        return max(self.batch_max, self.verify_rows * self.verify_sequences[1])

    @property
    def rows_min(self) -> int:
        """Rows of the narrowest kernel: the smallest decode batch or verify step."""
        verify = self.verify_rows * self.verify_sequences[0]
        return min(self.batch_min, verify) if verify else self.batch_min

    @property
    def hbm_bytes_per_chip(self) -> int:
        """HBM the kernel holds on each chip: every core's share (`hbm_bytes_per_rank`)."""
        return sum(self.hbm_bytes_per_rank.values()) * self.cores_per_chip

    @property
    def hbm_capacity_per_chip(self) -> int:
        return self.hbm_per_core * self.cores_per_chip

    @property
    def fits_hbm(self) -> bool:
        """Whether each chip's HBM holds what the kernel keeps there (`mkc check` reports it
        when not; the smallest-slice search tries slices until it does)."""
        return self.hbm_bytes_per_chip <= self.hbm_capacity_per_chip

    def to_json(self) -> str:
        """Deterministic JSON of the whole IR (spans included, so tools can point at the spec)."""
        return json.dumps(dataclasses.asdict(self), indent=1, sort_keys=True)

    def buffer(self, name: str) -> Buffer:
        return next(b for b in self.buffers if b.name == name)

    def experts_of(self, kind: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """One routed expert's matrices as layer kind `kind` holds them."""
        return self.kind_experts.get(kind, self.experts)

    def weight_formats_of(self, kind: str) -> dict[str, WeightFormat]:
        """The matrix classes' formats in layer kind `kind` (its experts' own, where it holds
        them in another layout)."""
        return {**self.weight_formats, **self.kind_weight_formats.get(kind, {})}

    def expert_kinds(self) -> list[str]:
        """The layer kinds that run routed experts (fetch them into a slot view), sorted."""
        return sorted(k for k, ks in self.kinds.items() if ks.fetch is not None)

    def label(self, name: str) -> str:
        """A buffer's name as the spec writes it (any other name as it is)."""
        return next((b.label for b in self.buffers if b.name == name), name)

    def pool_view(self, dotted: str) -> PoolView:
        pool, view = dotted.split(".")
        return next(p for p in self.pools if p.name == pool).view(view)


# ---- pool geometry: time-shared VMEM regions of bf16 rows of 128 lanes (mkc.runtime.pool) ----
POOL_TILE_ROWS = SUBLANE_TILE["bf16"]    # bf16 pool rows per (16, 128) tile
POOL_ROW_BYTES = LANES * 2               # bytes per pool row


def pool_itemsize(dtype: object) -> int:
    """Bytes per element of an IR dtype name ("bf16", "u8", ...) or a numpy/jax dtype."""
    if isinstance(dtype, str):
        size = DTYPE_BYTES[dtype]
    else:       # a numpy or jax dtype (from the runtime); numpy loads only then
        import numpy as np
        size = np.dtype(dtype).itemsize
    if size not in (1, 2):
        raise ValueError(f"a pool holds bf16 or 1-byte (uint8) matrices, not {dtype}")
    return size


def panel_rows(rows: int, dtype: object) -> int:
    """Pool (bf16) rows of one column panel of a [rows, *] matrix: 1-byte data two rows per
    pool row, rounded up to whole (16, 128) tiles."""
    return round_up(-(-rows * pool_itemsize(dtype) // 2), POOL_TILE_ROWS)


def stacked_rows(rows: int, cols: int, dtype: object) -> int:
    """Pool rows of a matrix stored stacked: its column panels one under another with no
    padding between them (1-byte data two rows per pool row), rounded up to whole tiles once.
    For small matrices read whole (block scales: a few rows, many panels), whose panels would
    each be mostly tile padding."""
    return round_up(-(-(-(-cols // LANES) * rows * pool_itemsize(dtype)) // 2), POOL_TILE_ROWS)


def pooled_rows(rows: int, cols: int, dtype: object, stacked: bool = False) -> int:
    """Pool rows a [rows, cols] matrix occupies (its bytes / 256): whole-tile panels, or
    `stacked_rows`."""
    if stacked:
        return stacked_rows(rows, cols, dtype)
    return -(-cols // LANES) * panel_rows(rows, dtype)
