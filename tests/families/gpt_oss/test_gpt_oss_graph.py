"""The GPT-OSS graph (mkc.families.gpt_oss.graph): the layer pattern strung into one step, every
op's inputs produced before it, per-rank shapes that add up to the checkpoint's tensors, KV
heads replicated when there are fewer than head parts, the window's cache slots, the expert
formats, and the shard rules it refuses."""
from __future__ import annotations

import math

import pytest

from mkc.families.gpt_oss import graph as g
from mkc.families.gpt_oss import reference as ref
from mkc.ir import WeightFormat
from mkc.model.config import CONFIG_DIR
from mkc.model.family import FormatError
from mkc.model.graph import ShardingError, build_graph

MINI = ref.load_config(CONFIG_DIR / "gpt_oss_mini.json")
BIG = ref.load_config(CONFIG_DIR / "gpt_oss_120b.json")
SMALL = ref.load_config(CONFIG_DIR / "gpt_oss_20b.json")


def rules(ranks: int, heads: int | None = None) -> dict[str, tuple[int, int]]:
    return {"heads": (heads or ranks, 1), "vocab": (ranks, 1), "experts": (ranks, 1)}


def test_the_step_alternates_sliding_and_full_attention_each_followed_by_the_moe():
    graph = build_graph(MINI, g.build(MINI, rules(2), 2), 2)
    assert MINI.layer_kinds == ("swa", "moe", "gqa", "moe") * 2
    assert sorted(graph.kinds) == ["gqa", "moe", "swa"]
    # the attention kinds differ only in what their caches hold (cache_slots), not in ops
    swa, gqa = graph.kinds["swa"], graph.kinds["gqa"]
    assert swa.ops == gqa.ops and swa.tensors == gqa.tensors
    nodes = list(graph.graph.nodes)
    assert nodes[0] == "embed" and nodes[-2:] == ["final_norm", "lm_head"]
    assert nodes[1:3] == ["layers.0.input_norm", "layers.0.qkv"]
    assert "layers.1.route" in nodes and "layers.2.attention" in nodes
    assert len(nodes) == 3 + MINI.num_hidden_layers * (len(swa.ops) + len(graph.kinds["moe"].ops))
    assert swa.cache_reader() == "attention"
    assert [o.name for o in graph.kinds["moe"].ops if o.picks_experts] == ["route"]
    assert [o.name for o in graph.kinds["moe"].ops if o.runs_experts] == ["routed_experts"]


@pytest.mark.parametrize("kind", ["swa", "gqa", "moe"])
def test_every_op_reads_what_a_tensor_or_an_earlier_op_gives(kind):
    """Each read is a tensor of the kind, the residual stream, or written before in the kind;
    biases and sinks are read by the ops that apply them."""
    k = g.build(MINI, rules(2), 2).kinds[kind]
    written = {"x"}
    for op in k.ops:
        missing = [r for r in op.reads if r not in k.tensors and r not in written]
        assert not missing, (op.name, missing)
        written |= set(op.writes)
        if op.matmul:
            assert k.tensors[op.matmul].role == "matrix"
    readers = {r: op.name for op in k.ops for r in op.reads}
    want = ({"qkv_bias": "qkv", "sinks": "attention", "o_bias": "attn_residual"}
            if kind != "moe" else {"router_bias": "router"})
    assert {t: readers[t] for t in want} == want
    assert all(t in readers or any(o.matmul == t for o in k.ops) for t in k.tensors), k.tensors


def test_120b_per_rank_shapes_on_eight_cores():
    fg = g.build(BIG, rules(8), 8)
    att, moe = fg.kinds["swa"].tensors, fg.kinds["moe"].tensors
    # 64 query heads and 8 KV heads of 64 over 8 parts: 8 and 1 each
    assert att["qkv"].shape == (2880, (8 + 2) * 64) and att["qkv_bias"].shape == (640,)
    assert att["o_proj"].shape == (512, 2880) and att["o_proj"].partial_out == ("heads",)
    assert att["sinks"].shape == (8,) and att["o_bias"].shape == (2880,)
    assert att["key"].shape == att["value"].shape == (1, 64)
    assert moe["router"].shape == (2880, 128) and moe["router_bias"].shape == (128,)
    assert fg.per_rank["local_experts"] == 16 and (fg.experts_total, fg.top_k) == (128, 4)
    assert fg.globals["lm_head"].shape == (2880, 201088 // 8)
    # one expert: gate|up halves of 2944 (2880 lane padded), MXFP4 two values a byte and a
    # scale per 32 input rows, the biases a bf16 row each
    e = {n: (t.shape, t.dtype) for n, t in fg.experts.items()}
    assert e == {"gate_up_codes": ((1440, 5888), "u8"), "gate_up_scales": ((90, 5888), "u8"),
                 "gate_up_bias": ((1, 5888), "bf16"), "down_codes": ((1472, 2880), "u8"),
                 "down_scales": ((92, 2880), "u8"), "down_bias": ((1, 2880), "bf16")}
    assert fg.experts["gate_up_codes"].mxu.values_per_byte == 2.0
    assert fg.experts["down_scales"].mxu.values_per_byte == 0.0


@pytest.mark.parametrize("dims,ranks", [(BIG, 8), (SMALL, 2), (MINI, 2)])
def test_split_tensors_add_up_to_the_checkpoints_and_the_rest_is_whole(dims, ranks):
    """The parts of every split tensor make the checkpoint's (heads, vocab, experts); the
    router, norms and o_proj's bias are whole on every rank; one expert's bytes are the
    checkpoint's, plus only the lane padding of its width."""
    fg = g.build(dims, rules(ranks), ranks)
    shapes = {n.removeprefix("model.layers.0."): s for n, (s, _) in ref.param_shapes(dims).items()}
    att, moe = fg.kinds["gqa"].tensors, fg.kinds["moe"].tensors
    q, k = shapes["self_attn.q_proj.weight"][0], shapes["self_attn.k_proj.weight"][0]
    assert att["qkv"].shape == (dims.hidden_size, (q + 2 * k) // ranks)
    assert att["qkv_bias"].shape[0] * ranks == q + 2 * k
    assert att["o_proj"].shape[0] * ranks == shapes["self_attn.o_proj.weight"][1]
    assert att["sinks"].shape[0] * ranks == shapes["self_attn.sinks"][0]
    assert att["o_bias"].shape == shapes["self_attn.o_proj.bias"]
    assert att["input_norm"].shape == shapes["input_layernorm.weight"]
    assert moe["router"].shape == shapes["mlp.router.weight"][::-1]
    assert moe["router_bias"].shape == shapes["mlp.router.bias"]
    assert fg.globals["embed"].shape[0] * ranks == shapes["model.embed_tokens.weight"][0]
    assert fg.globals["lm_head"].shape[1] * ranks == shapes["lm_head.weight"][0]
    assert fg.per_rank["local_experts"] * ranks == shapes["mlp.experts.gate_up_proj_blocks"][0]
    stored = sum(math.prod(shapes[f"mlp.experts.{m}_{part}"][1:]) * (2 if part == "bias" else 1)
                 for m in ("gate_up_proj", "down_proj") for part in ("blocks", "scales", "bias"))
    h, i = dims.hidden_size, dims.intermediate_size
    pad = -(-i // 128) * 128 - i
    # two padded halves of gate|up (codes, scales, bias lanes), padded input rows of down
    padding = 2 * pad * h * 17 // 32 + 2 * pad * 2 + pad * h * 17 // 32
    assert sum(t.nbytes for t in fg.experts.values()) == stored + padding
    assert (pad == 0) == (dims is MINI)


def test_kv_heads_are_replicated_when_fewer_than_the_head_parts():
    """MINI's 2 KV heads over 4 head parts: each part holds the one its query head reads."""
    fg = g.build(MINI, rules(4), 4)
    assert (fg.per_rank["nq"], fg.per_rank["nkv"]) == (1, 1)
    assert fg.kinds["swa"].tensors["qkv"].shape == (256, 3 * 64)
    with pytest.raises(ShardingError, match="num_attention_heads") as e:
        g.build(MINI, rules(8), 8)          # 4 query heads do not split 8 ways
    assert e.value.dim_class == "heads"


def test_a_sliding_layer_caches_its_window_a_full_layer_the_context():
    assert g.cache_slots(BIG, "swa", 4096) == 128 and g.cache_slots(BIG, "gqa", 4096) == 4096
    assert g.cache_slots(MINI, "swa", 5) == 128 == MINI.sliding_window
    assert ref.init_cache(MINI, 1, 5)["layers.0.key_cache"].shape[2] == 128   # as the reference
    assert g.build(BIG, rules(8), 8).per_rank["window"] == 128
    with pytest.raises(KeyError):
        g.cache_slots(BIG, "moe", 4096)


def test_experts_must_be_whole_and_over_every_core():
    for bad in ({"experts": (4, 2)}, {"experts": (4, 1)}):
        with pytest.raises(ShardingError, match="experts over tp") as e:
            g.build(BIG, rules(8) | bad, 8)
        assert e.value.dim_class == "experts"
    with pytest.raises(ShardingError, match="num_local_experts"):
        g.build(MINI, rules(16, heads=2), 16)              # 8 experts over 16 cores


def test_expert_formats_and_the_blocks_they_take():
    """FP8 codes a byte a value; a block of whole pack groups (320 rows of gate|up's 2880)
    that tiles the rows; MXFP4 only at its own 32-row scales."""
    fp8 = {"expert.gate_up": WeightFormat("fp8"), "expert.down": WeightFormat("fp8", 1 << 20)}
    fg = g.build(BIG, rules(8), 8, fp8)
    assert fg.experts["gate_up_codes"].shape == (2880, 5888)
    assert fg.experts["gate_up_codes"].mxu.values_per_byte == 1.0
    assert fg.experts["gate_up_scales"].shape == (2880 // 32, 5888)
    assert fg.experts["down_scales"].shape == (1, 2880)     # a block past the rows: one
    assert fg.formats["expert.gate_up"] == WeightFormat("fp8", 32)
    assert g.pack_groups(BIG) == {"gate_up": 320, "down": 128}
    assert g.pack_groups(MINI) == {"gate_up": 256, "down": 256}
    ok = g.expert_formats(BIG, {"expert.gate_up": WeightFormat("fp8", 960)})
    assert ok["expert.gate_up"].block == 960 and ok["expert.down"] == WeightFormat("mxfp4", 32)
    for cls, fmt in (("expert.gate_up", WeightFormat("fp8", 640)),      # 2880 / 640 no
                     ("expert.gate_up", WeightFormat("fp8", 480)),      # not whole groups
                     ("expert.down", WeightFormat("fp8", 256)),         # 2944 / 256 no
                     ("expert.down", WeightFormat("mxfp4", 64))):
        with pytest.raises(FormatError) as e:
            g.expert_formats(BIG, {cls: fmt})
        assert e.value.cls == cls and e.value.hint
