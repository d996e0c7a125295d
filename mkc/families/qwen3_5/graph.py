"""The Qwen3.5 text decode graph: gated delta net (`gdn`) and gated attention (`gqa`) layers,
each followed by a SwiGLU MLP, tensor parallel. Each class (attention heads, MLP width,
vocabulary) splits over its own rank group and is replicated across the rest
(`mkc.model.sharding`): 24 heads over 8 ranks of a 16-rank mesh, the MLP over all 16."""
from __future__ import annotations

from mkc.model.graph import FamilyGraph, LayerKind, Op, Tensor, lane_pad, split
from mkc.families.qwen3_5.config import Qwen35Dims

SHARD_CLASSES = ("heads", "mlp", "vocab")


def attention_kinds(d: Qwen35Dims, heads: int, mlp: int, with_mlp: bool = True
                    ) -> tuple[dict[str, LayerKind], dict[str, int]]:
    """The gdn and gqa kinds with their dense SwiGLU MLP, or (with_mlp=False) the attention
    half alone, up to the residual add, for a family whose MLP is its own sublayer kind;
    `heads` and `mlp` are the ways those classes split."""
    H = d.hidden_size
    nk = split(d.linear_num_key_heads, heads, "linear_num_key_heads", "heads")
    nv = split(d.linear_num_value_heads, heads, "linear_num_value_heads", "heads")
    dk, dv = d.linear_key_head_dim, d.linear_value_head_dim
    conv_ch = 2 * nk * dk + nv * dv
    inter = split(d.intermediate_size, mlp, "intermediate_size", "mlp") if with_mlp else 0
    nq = split(d.num_attention_heads, heads, "num_attention_heads", "heads")
    nkv = kv_heads_per_part(d, heads)
    hd = d.head_dim

    def mlp_tensors() -> dict[str, Tensor]:
        if not with_mlp:
            return {"input_norm": Tensor("input_norm", "vector", (H,), "f32")}
        return {
            "gate_up": Tensor("gate_up", "matrix", (H, 2 * inter), "bf16"),
            "down": Tensor("down", "matrix", (inter, H), "bf16", partial_out=("mlp",)),
            "input_norm": Tensor("input_norm", "vector", (H,), "f32"),
            "post_norm": Tensor("post_norm", "vector", (H,), "f32"),
        }

    mlp_ops = (
        Op("post_norm", reads=("x", "post_norm"), writes=("h",)),
        Op("gate_up", reads=("h",), writes=("act",), matmul="gate_up"),
        Op("down", reads=("act",), writes=("mlp_out",), matmul="down"),
        Op("mlp_residual", reads=("mlp_out", "x"), writes=("x",)),
    ) if with_mlp else ()
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
        "out_proj": Tensor("out_proj", "matrix", (nv * dv, H), "bf16", partial_out=("heads",)),
        "conv_weight": Tensor("conv_weight", "vector", (d.linear_conv_kernel_dim, conv_ch), "f32"),
        "A_log": Tensor("A_log", "vector", (nv,), "f32"),
        "dt_bias": Tensor("dt_bias", "vector", (nv,), "f32"),
        "norm": Tensor("norm", "vector", (dv,), "f32"),
        "conv": Tensor("conv", "state", (d.linear_conv_kernel_dim - 1, conv_ch), "f32", lead_dims=1),
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
        "o_proj": Tensor("o_proj", "matrix", (nq * hd, H), "bf16", partial_out=("heads",)),
        "q_norm": Tensor("q_norm", "vector", (hd,), "f32"),
        "k_norm": Tensor("k_norm", "vector", (hd,), "f32"),
        "key": Tensor("key", "cache", (nkv, hd), "bf16"),      # per token; [ctx, ...] in HBM
        "value": Tensor("value", "cache", (nkv, hd), "bf16"),
        **mlp_tensors(),
    })
    per_rank = {"nk": nk, "nv": nv, "dk": dk, "dv": dv, "conv_ch": conv_ch, "nq": nq,
                "nkv": nkv, "inter": inter,
                # lane offsets of in_proj's b and a sections ([q | k | v | z | b | a])
                "b_off": conv_ch + nv * dv, "a_off": conv_ch + nv * dv + lane_pad(nv)}
    return {"gdn": gdn, "gqa": gqa}, per_rank


def kv_heads_per_part(d: Qwen35Dims, heads: int) -> int:
    """KV heads each heads part holds: a split when there are enough, else one, the replica of
    the KV head its query heads share (`kv_heads_of`)."""
    if d.num_key_value_heads >= heads:
        return split(d.num_key_value_heads, heads, "num_key_value_heads", "heads")
    split(heads, d.num_key_value_heads, "heads parts per num_key_value_heads", "heads")
    return 1


def kv_heads_of(d: Qwen35Dims, part: int, heads: int) -> list[int]:
    """The KV heads heads part `part` of `heads` holds."""
    n = kv_heads_per_part(d, heads)
    if d.num_key_value_heads >= heads:
        return list(range(part * n, (part + 1) * n))
    return [part * d.num_key_value_heads // heads]


def vocab_globals(d, ways: int) -> tuple[dict[str, Tensor], int]:
    """Embedding, final norm and the lm_head split `ways` ways over the vocabulary."""
    v_local = split(d.vocab_size, ways, "vocab_size", "vocab")
    H = d.hidden_size
    glob = {
        "embed": Tensor("embed", "table", (v_local, H), "bf16"),
        "final_norm": Tensor("final_norm", "vector", (H,), "f32"),
        "lm_head": Tensor("lm_head", "matrix", (H, v_local), "bf16"),
    }
    return glob, v_local


def build(d: Qwen35Dims, rules: dict[str, tuple[int, int]], ranks: int,
          formats: dict | None = None) -> FamilyGraph:
    kinds, per_rank = attention_kinds(d, rules["heads"][0], rules["mlp"][0])
    glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
    return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank)
