"""The model graph of one decode step: ops as networkx nodes, each with the tensors it touches.

Layer kinds are op templates instantiated per layer. Shapes are per rank once shard rules
(dimension class -> (ways, stride)) are applied; `build_graph` dispatches on the model family
(Qwen 3.5 here, Kimi K3 in `kimi_k3_graph`).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import networkx as nx

from mkc.ir import MatrixFacts, OpFacts
from mkc.model.config import ModelDims


@dataclass(frozen=True)
class Tensor:
    """A weight, per-layer vector, state or cache an op reads or writes (per-rank shape)."""

    name: str              # family name, unique within a layer kind (e.g. "in_proj")
    role: str              # "matrix" | "vector" | "state" | "cache" | "table"
    shape: tuple[int, ...]  # matrices are [in, out] (HF Linear weights transposed)
    dtype: str
    partial_out: bool = False   # a row-parallel matrix: its product is a partial sum over tp
    split_out: str | None = None    # the shard class that leaves its product column-split
    mxu: MatrixFacts | None = None  # how it enters the MXU, when not as plain bf16 values

    @property
    def nbytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * {"bf16": 2, "f32": 4, "int32": 4, "fp8": 1, "u8": 1}[self.dtype]


@dataclass(frozen=True)
class Op:
    """One compute step of a layer kind, in program order."""

    name: str
    reads: tuple[str, ...] = ()     # tensor families read
    writes: tuple[str, ...] = ()
    matmul: str | None = None       # the matrix family this op multiplies by, if any
    partial: bool = False           # a non-matmul op whose output is a partial sum over ranks
    width: int = 0                  # that output's columns
    facts: OpFacts = OpFacts()      # compute work beyond its matrix (for the step-time model)


@dataclass(frozen=True)
class LayerKind:
    name: str
    ops: tuple[Op, ...]
    tensors: dict[str, Tensor] = field(hash=False)

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


@dataclass(frozen=True)
class DecodeGraph:
    dims: ModelDims             # or KimiDims: the fields every family shares are used generically
    ranks: int
    kinds: dict[str, LayerKind]
    globals: dict[str, Tensor]
    graph: nx.DiGraph
    per_rank: dict[str, int]     # per-rank sizes the kernel's compute bodies index by
    experts: dict[str, Tensor] = field(default_factory=dict)   # one routed expert's families
    # Model-specific VMEM activations: name -> (shape with -1 for the batch dim, dtype).
    activations: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
    tail_facts: dict[str, OpFacts] = field(default_factory=dict)   # embed, final_norm, lm_head

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        return self.dims.layer_kinds


class ShardingError(ValueError):
    """A dimension does not divide over the requested ways; the message says which."""

    def __init__(self, message: str, dim_class: str | None = None):
        super().__init__(message)
        self.dim_class = dim_class      # the shard rule to point at, when one is to blame


def with_facts(kind: LayerKind, facts: dict[str, OpFacts]) -> LayerKind:
    """The kind with each named op's compute facts filled in (estimates of the work each op's
    body does per rank: element operations per batch row and per cached token)."""
    ops = tuple(dataclasses.replace(o, facts=facts.get(o.name, o.facts)) for o in kind.ops)
    return dataclasses.replace(kind, ops=ops)


def lane_pad(n: int) -> int:
    return -(-n // 128) * 128


def _split(total: int, ways: int, what: str) -> int:
    if total % ways:
        raise ShardingError(f"{what} = {total} does not divide over {ways} ranks")
    return total // ways


def _qwen35_kinds(d: ModelDims, heads: int, mlp: int
                  ) -> tuple[dict[str, LayerKind], dict[str, int]]:
    H = d.hidden_size
    nk = _split(d.linear_num_key_heads, heads, "linear_num_key_heads")
    nv = _split(d.linear_num_value_heads, heads, "linear_num_value_heads")
    dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
    conv_ch = 2 * nk * dk + nv * dv
    inter = _split(d.intermediate_size, mlp, "intermediate_size")
    nq = _split(d.num_attention_heads, heads, "num_attention_heads")
    # KV heads split when there are enough, else each rank holds a replica of its group's head.
    if d.num_key_value_heads >= heads:
        nkv = _split(d.num_key_value_heads, heads, "num_key_value_heads")
    else:
        _split(heads, d.num_key_value_heads, "ranks per num_key_value_heads")
        nkv = 1
    hd = d.head_dim

    def mlp_tensors() -> dict[str, Tensor]:
        return {
            "gate_up": Tensor("gate_up", "matrix", (H, 2 * inter), "bf16"),
            "down": Tensor("down", "matrix", (inter, H), "bf16", partial_out=True),
            "input_norm": Tensor("input_norm", "vector", (H,), "f32"),
            "post_norm": Tensor("post_norm", "vector", (H,), "f32"),
        }

    mlp_ops = (
        Op("post_norm", reads=("x", "post_norm"), writes=("h",)),
        Op("gate_up", reads=("h",), writes=("act",), matmul="gate_up"),
        Op("down", reads=("act",), writes=("mlp_out",), matmul="down"),
        Op("mlp_residual", reads=("mlp_out", "x"), writes=("x",)),
    )
    gdn = LayerKind("gdn", ops=(
        Op("input_norm", reads=("x", "input_norm"), writes=("h",)),
        Op("in_proj", reads=("h",), writes=("proj",), matmul="in_proj"),
        Op("conv", reads=("proj", "conv_weight", "conv"), writes=("qkv", "conv")),
        Op("delta_rule", reads=("qkv", "proj", "A_log", "dt_bias", "recurrent"),
           writes=("core", "recurrent")),
        Op("gated_norm", reads=("core", "proj", "norm"), writes=("core",)),
        Op("out_proj", reads=("core",), writes=("attn_out",), matmul="out_proj"),
        Op("attn_residual", reads=("attn_out", "x"), writes=("x",)),
    ) + mlp_ops, tensors={
        # Columns [q | k | v | z | b | a]; b and a each padded to a lane tile so every
        # section starts on a 128-lane boundary in the kernel.
        "in_proj": Tensor("in_proj", "matrix", (H, conv_ch + nv * dv + 2 * lane_pad(nv)), "bf16"),
        "out_proj": Tensor("out_proj", "matrix", (nv * dv, H), "bf16", partial_out=True),
        "conv_weight": Tensor("conv_weight", "vector", (d.linear_conv_kernel_dim, conv_ch), "f32"),
        "A_log": Tensor("A_log", "vector", (nv,), "f32"),
        "dt_bias": Tensor("dt_bias", "vector", (nv,), "f32"),
        "norm": Tensor("norm", "vector", (dv,), "f32"),
        "conv": Tensor("conv", "state", (d.linear_conv_kernel_dim - 1, conv_ch), "f32"),
        "recurrent": Tensor("recurrent", "state", (nv, dk, dv), "f32"),
        **mlp_tensors(),
    })
    gqa = LayerKind("gqa", ops=(
        Op("input_norm", reads=("x", "input_norm"), writes=("h",)),
        Op("qkv_gate", reads=("h",), writes=("proj",), matmul="qkv_gate"),
        Op("qk_norm_rope", reads=("proj", "q_norm", "k_norm"), writes=("q", "k_new")),
        Op("kv_write", reads=("k_new", "proj"), writes=("key", "value")),
        Op("attention", reads=("q", "key", "value"), writes=("core",)),
        Op("out_gate", reads=("core", "proj"), writes=("core",)),
        Op("o_proj", reads=("core",), writes=("attn_out",), matmul="o_proj"),
        Op("attn_residual", reads=("attn_out", "x"), writes=("x",)),
    ) + mlp_ops, tensors={
        "qkv_gate": Tensor("qkv_gate", "matrix", (H, 2 * nq * hd + 2 * nkv * hd), "bf16"),
        "o_proj": Tensor("o_proj", "matrix", (nq * hd, H), "bf16", partial_out=True),
        "q_norm": Tensor("q_norm", "vector", (hd,), "f32"),
        "k_norm": Tensor("k_norm", "vector", (hd,), "f32"),
        "key": Tensor("key", "cache", (nkv, hd), "bf16"),      # per token; [ctx, ...] in HBM
        "value": Tensor("value", "cache", (nkv, hd), "bf16"),
        **mlp_tensors(),
    })
    norm = OpFacts(vector_per_row=4 * H)
    mlp_facts = {"post_norm": norm, "gate_up": OpFacts(vector_per_row=8 * inter),   # SiLU * up
                 "mlp_residual": OpFacts(vector_per_row=2 * H)}
    state = nv * dk * dv
    gdn = with_facts(gdn, mlp_facts | {
        "input_norm": norm,
        "conv": OpFacts(vector_per_row=(2 * d.linear_conv_kernel_dim + 6) * conv_ch),
        # decay and rank-1 update on the state (VPU); k.S and q.S through the MXU
        "delta_rule": OpFacts(vector_per_row=4 * state + 16 * (nk * dk + nv * dv),
                              mxu_per_row=2 * state),
        "gated_norm": OpFacts(vector_per_row=10 * nv * dv),
        "attn_residual": OpFacts(vector_per_row=2 * H)})
    gqa = with_facts(gqa, mlp_facts | {
        "input_norm": norm,
        "qk_norm_rope": OpFacts(vector_per_row=10 * (nq + nkv) * hd),
        "kv_write": OpFacts(vector_per_row=2 * nkv * hd),
        "attention": OpFacts(cache_per_token=2 * nkv * hd, vector_per_token=6 * nq),
        "out_gate": OpFacts(vector_per_row=6 * nq * hd),
        "attn_residual": OpFacts(vector_per_row=2 * H)})
    per_rank = {"nk": nk, "nv": nv, "dk": dk, "dv": dv, "conv_ch": conv_ch, "nq": nq,
                "nkv": nkv, "inter": inter,
                # lane offsets of in_proj's b and a sections ([q | k | v | z | b | a])
                "b_off": conv_ch + nv * dv, "a_off": conv_ch + nv * dv + lane_pad(nv)}
    return {"gdn": gdn, "gqa": gqa}, per_rank


QWEN_SHARD_CLASSES = ("heads", "mlp", "vocab")


def shard_classes(family: str) -> tuple[str, ...]:
    """The dimension classes a family's spec must place with `shard CLASS over GROUP`."""
    from mkc.model.kimi_k3_graph import KIMI_SHARD_CLASSES
    return KIMI_SHARD_CLASSES if family == "kimi_k3" else QWEN_SHARD_CLASSES


def build_graph(dims, rules: dict[str, tuple[int, int]], ranks: int) -> DecodeGraph:
    """Instantiate the decode-step graph. `rules` maps each dimension class to (ways, stride):
    rank r holds shard (r // stride) % ways, replicated over the other ranks."""
    if dims.family == "kimi_k3":
        from mkc.model.kimi_k3_graph import (KimiSharding, kimi_k3_activations, kimi_k3_kinds,
                                             kimi_k3_tail_facts)
        sharding = KimiSharding.from_rules(rules, ranks)
        kinds, experts, glob, per_rank = kimi_k3_kinds(dims, sharding)
        activations = kimi_k3_activations(dims, sharding)
        tail_facts = kimi_k3_tail_facts(dims, sharding)
    else:
        for cls in QWEN_SHARD_CLASSES:
            if rules[cls] != (ranks, 1):
                raise ShardingError(f"the {dims.family} lowering is tensor parallel over the whole "
                                    f"mesh: write `shard {cls} over tp`")
        kinds, per_rank = _qwen35_kinds(dims, ranks, ranks)
        experts, activations = {}, {}
        v_local = _split(dims.vocab_size, ranks, "vocab_size")
        per_rank["vocab"] = v_local
        H = dims.hidden_size
        glob = {
            "embed": Tensor("embed", "table", (v_local, H), "bf16"),
            "final_norm": Tensor("final_norm", "vector", (H,), "f32"),
            "lm_head": Tensor("lm_head", "matrix", (H, v_local), "bf16"),
        }
        tail_facts = {"embed": OpFacts(vector_per_row=2 * H),
                      "final_norm": OpFacts(vector_per_row=4 * H),
                      "lm_head": OpFacts(vector_per_row=4 * v_local)}   # logits, argmax
    g = nx.DiGraph()
    g.add_node("embed", op="embed", layer=None, kind=None, reads=("embed",), writes=("x",))
    prev = "embed"
    for i, kind_name in enumerate(dims.layer_kinds):
        kind = kinds[kind_name]
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
    return DecodeGraph(dims=dims, ranks=ranks, kinds=kinds, globals=glob, graph=g,
                       per_rank=per_rank, experts=experts, activations=activations,
                       tail_facts=tail_facts)
