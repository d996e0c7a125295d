"""The model graph of one decode step: ops as networkx nodes, each with the tensors it touches.

Layer kinds are op templates instantiated per layer. Shapes are per rank once shard rules
(dimension class -> (ways, stride)) are applied; each family's package (`mkc.families`)
builds its kinds, and `build_graph` strings them into one step.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mkc.ir import MatrixFacts

if TYPE_CHECKING:
    import networkx as nx


@dataclass(frozen=True)
class Tensor:
    """A weight, per-layer vector, state or cache an op reads or writes (per-rank shape)."""

    name: str              # family name, unique within a layer kind (e.g. "in_proj")
    role: str              # "matrix" | "vector" | "state" | "cache" | "table"
    shape: tuple[int, ...]  # matrices are [in, out] (HF Linear weights transposed)
    dtype: str
    # A row-parallel matrix: its product is a partial sum over the ranks holding the parts of
    # these shard classes (`ShardTable.reduction_group`); () for a whole product.
    partial_out: tuple[str, ...] = ()
    split_out: str | None = None    # the shard class that leaves its product column-split
    mxu: MatrixFacts | None = None  # how it enters the MXU, when not as plain bf16 values
    # A state's leading dims that go before the batch axis in its buffers (a conv state's
    # taps, so the kernel shifts the window by whole [B, channels] slices).
    lead_dims: int = 0
    # A routed expert's small matrix read whole (block scales): its column panels stacked in
    # the expert's slot without per-panel tile padding (`mkc.ir.stacked_rows`).
    stacked: bool = False
    # A matrix's dense class (`mkc.layers.dense_formats.CLASSES`: "attention", "mlp", ...),
    # whose `format` line may store it as 8-bit codes; "" for none (routers, matrices an op
    # reads whole).
    format_class: str = ""

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"bf16": 2, "f32": 4, "int32": 4, "fp8": 1, "u8": 1, "int8": 1}[self.dtype]


@dataclass(frozen=True)
class Op:
    """One compute step of a layer kind, in program order."""

    name: str
    reads: tuple[str, ...] = ()     # tensor families read
    writes: tuple[str, ...] = ()
    matmul: str | None = None       # the matrix family this op multiplies by, if any
    partial: tuple[str, ...] = ()   # a non-matmul op whose output is a partial sum over these classes
    width: int = 0                  # that output's columns
    picks_experts: bool = False     # the router step: routed experts are known after it
    runs_experts: bool = False      # reads the routed experts' weights (from expert slots)


@dataclass(frozen=True)
class ContextLimit:
    """The longest context a layer kind's lowering computes correctly, where a longer one needs
    a mechanism not built yet (GPT-OSS's sliding layers: a KV ring of the window's slots).
    Resolve refuses a spec whose `context` exceeds it, at that line, with `reason` and `hint`."""

    tokens: int
    reason: str
    hint: str


@dataclass(frozen=True)
class LayerKind:
    name: str
    ops: tuple[Op, ...]
    tensors: dict[str, Tensor] = field(hash=False)
    context_limit: ContextLimit | None = None
    # The attention window in tokens of a kind that attends to its last `window` positions
    # only (0: the whole context). Such a kind may keep its KV cache as a ring of the window
    # (`kv ring N slots`, `mkc.resolve.kv_ring`), which lifts its `context_limit`.
    window: int = 0

    def op_names(self) -> list[str]:
        return [o.name for o in self.ops]

    def matrices(self) -> list[Tensor]:
        """Matrix families multiplied by the activation (streamable), in consumption order."""
        return [self.tensors[o.matmul] for o in self.ops if o.matmul]

    def readers(self, family: str) -> list[int]:
        """Indices of the ops that multiply by or read a tensor family."""
        return [i for i, o in enumerate(self.ops) if o.matmul == family or family in o.reads]

    def vectors(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role == "vector"]

    def states(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role in ("state", "cache")]

    def caches(self) -> list[Tensor]:
        return [t for t in self.tensors.values() if t.role == "cache"]

    def cache_reader(self) -> str | None:
        """The op that reads the KV cache (KV tiles stream into it), if the kind has one."""
        caches = {t.name for t in self.caches()}
        return next((o.name for o in self.ops if caches & set(o.reads)), None)

    def cache_writer(self) -> str | None:
        """The op that writes the new rows into the KV cache, if the kind has one."""
        caches = {t.name for t in self.caches()}
        return next((o.name for o in self.ops if caches & set(o.writes)), None)


@dataclass(frozen=True)
class DecodeGraph:
    dims: Any                   # the family's dims: family, name, hidden_size, layer_kinds... are shared
    ranks: int
    kinds: dict[str, LayerKind]
    globals: dict[str, Tensor]
    graph: nx.DiGraph
    per_rank: dict[str, int]     # per-rank sizes the kernel's compute bodies index by
    experts: dict[str, Tensor] = field(default_factory=dict)   # one routed expert's families
    # Model-specific VMEM activations: name -> (shape with -1 for the batch dim, dtype).
    activations: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)

    experts_total: int = 0       # routed experts of the model (0: none)
    top_k: int = 0               # experts each row picks
    formats: dict = field(default_factory=dict)   # class -> mkc.ir.WeightFormat, as built
    # A kind whose routed experts are held in another layout (`FamilyGraph.kind_experts`)
    kind_experts: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    kind_formats: dict[str, dict] = field(default_factory=dict)

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.dims.layer_kinds

    def experts_of(self, kind: str) -> dict[str, Tensor]:
        """One routed expert's tensors as layer kind `kind` holds them."""
        return self.kind_experts.get(kind, self.experts)

    def tail_matrices(self) -> list[Tensor]:
        """Matrices after the last layer (the lm_head), in the order the step multiplies."""
        return [t for t in self.globals.values() if t.role == "matrix"]


class ShardingError(ValueError):
    """A dimension does not divide over the requested ways; the message says which."""

    def __init__(self, message: str, dim_class: str | None = None):
        super().__init__(message)
        self.dim_class = dim_class      # the shard rule to point at, when one is to blame


def lane_pad(n: int) -> int:
    return -(-n // 128) * 128


def split(total: int, ways: int, what: str, dim_class: str | None = None) -> int:
    """total / ways, or a ShardingError naming the dimension that does not divide."""
    if ways <= 0 or total % ways:
        raise ShardingError(f"{what} = {total} does not divide into {ways} parts", dim_class)
    return total // ways


@dataclass(frozen=True)
class FamilyGraph:
    """What a family's graph builder returns: its layer kinds and globals, per rank."""

    kinds: dict[str, LayerKind]
    globals: dict[str, Tensor]           # embed, final_norm, lm_head
    per_rank: dict[str, int]             # sizes its compute bodies index by
    experts: dict[str, Tensor] = field(default_factory=dict)   # one routed expert's families
    # Model-specific VMEM activations: name -> (shape with -1 for the batch dim, dtype).
    activations: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    experts_total: int = 0               # routed experts of the model (0: none)
    top_k: int = 0                       # experts each row picks
    # Matrix classes with a choice of format -> the format, its block resolved to rows.
    formats: dict = field(default_factory=dict)
    # Layer kinds whose routed experts are held in another layout than `experts` (Muse
    # Spark's layers an NVFP4 checkpoint keeps bf16): kind -> one expert's tensors, and its
    # expert classes' formats.
    kind_experts: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    kind_formats: dict[str, dict] = field(default_factory=dict)


def build_graph(dims: Any, fg: FamilyGraph, ranks: int) -> DecodeGraph:
    """The decode-step graph: the family's layer kinds instantiated per layer, between the
    embedding and the final norm and lm_head."""
    import networkx as nx     # loaded once a graph is built: a spec's early errors need none
    g = nx.DiGraph()
    g.add_node("embed", op="embed", layer=None, kind=None, reads=("embed",), writes=("x",))
    prev = "embed"
    for i, kind_name in enumerate(dims.layer_kinds):
        kind = fg.kinds[kind_name]
        for op in kind.ops:
            node = f"layers.{i}.{op.name}"
            g.add_node(node, op=op.name, layer=i, kind=kind_name, reads=op.reads,
                       writes=op.writes, matmul=op.matmul)
            g.add_edge(prev, node)
            prev = node
    g.add_node("final_norm", op="final_norm", layer=None, kind=None,
               reads=("x", "final_norm"), writes=("h",))
    g.add_node("lm_head", op="lm_head", layer=None, kind=None, reads=("h",), writes=("logits",),
               matmul="lm_head")
    g.add_edge(prev, "final_norm")
    g.add_edge("final_norm", "lm_head")
    return DecodeGraph(dims=dims, ranks=ranks, kinds=fg.kinds, globals=fg.globals, graph=g,
                       per_rank=fg.per_rank, experts=fg.experts, activations=fg.activations,
                       experts_total=fg.experts_total, top_k=fg.top_k, formats=fg.formats,
                       kind_experts=fg.kind_experts, kind_formats=fg.kind_formats)
