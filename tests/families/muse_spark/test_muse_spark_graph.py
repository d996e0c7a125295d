"""The Muse Spark graph (`mkc.families.muse_spark.graph`): the layer pattern strung into one
step, each attention kind's and the MoE's ops between the gated residuals' pre-norm and update,
what a sliding kind declares, the shard rules it takes and refuses, and the MINI compiled from
the shipped spec."""
from __future__ import annotations

from pathlib import Path

import pytest

from mkc import compiler
from mkc.families.muse_spark import graph as g
from mkc.families.muse_spark import reference as ref
from mkc.model.config import CONFIG_DIR
from mkc.model.graph import ShardingError, build_graph
from tests_support import ROOT

MINI = ref.load_config(CONFIG_DIR / "muse_spark_mini.json")
SPEC = ROOT / "schedules" / "muse_spark.sched"
ATTENTION_OPS = ["input_norm", "qkv_gate", "attention", "out_gate", "o_proj", "attn_residual"]
MOE_OPS = ["pre_ffn_norm", "router", "route", "latent_down", "latent_norm", "routed_experts",
           "expert_norm", "latent_up", "mlp_residual"]


def rules(ranks: int, expert_tp: int) -> dict[str, tuple[int, int]]:
    return {"heads": (ranks, 1), "vocab": (ranks, 1), "experts": (ranks // expert_tp, expert_tp),
            "expert_mlp": (expert_tp, 1), "latent_down": (ranks, 1), "latent_up": (ranks, 1)}


def test_each_layer_is_its_attention_then_the_latent_moe_under_gated_residuals():
    graph = build_graph(MINI, g.build(MINI, rules(8, 8), 8), 8)
    assert MINI.layer_kinds == ("swa", "moe", "full", "moe", "swa", "moe", "swa", "moe")
    swa, full, moe = ([o.name for o in graph.kinds[k].ops] for k in ("swa", "full", "moe"))
    assert [o for o in swa if o in ATTENTION_OPS] == ATTENTION_OPS == [o for o in full if o in ATTENTION_OPS]
    # rotary embedding on the sliding layers only, after the weightless q/k norm
    assert "qk_norm_rope" in swa and "qk_norm" in full and "qk_norm_rope" not in full
    assert moe == MOE_OPS
    assert graph.kinds["swa"].window == MINI.sliding_window and not graph.kinds["full"].window
    assert graph.kinds["full"].context_limit is None
    nodes = list(graph.graph.nodes)
    assert nodes[0] == "embed" and nodes[-2:] == ["final_norm", "lm_head"]


@pytest.mark.parametrize("kind", ["swa", "full", "moe"])
def test_every_op_reads_what_a_tensor_or_an_earlier_op_gives(kind):
    k = g.build(MINI, rules(8, 8), 8).kinds[kind]
    written = {"x"}
    for op in k.ops:
        missing = [r for r in op.reads if r not in k.tensors and r not in written]
        assert not missing, (op.name, missing)
        written |= set(op.writes)


def test_each_expert_is_split_by_width_over_every_core_as_the_hand_kernel_holds_it():
    """Every rank a width slice of every expert (512 of 4096 at full size); the router whole
    (its f32 weight as a bf16 pair), the latent projections' columns split."""
    big = ref.load_config(CONFIG_DIR / "muse_spark.json")
    graph = g.build(big, rules(8, 8), 8)
    assert graph.per_rank["expert_width"] == 512 and graph.per_rank["local_experts"] == 256
    moe = graph.kinds["moe"].tensors
    assert moe["router"].shape == (8192, 2 * 256)
    assert moe["latent_down"].shape == (8192, 512) and moe["latent_up"].shape == (4096, 1024)
    assert graph.experts["gate_up"].shape[0] == 4096


def test_experts_that_do_not_tile_the_ranks_are_refused():
    bad = rules(8, 8) | {"experts": (4, 1)}
    with pytest.raises(ShardingError, match="expert_mlp"):
        g.build(MINI, bad, 8)


def test_the_mini_compiles_from_the_shipped_spec(tmp_path):
    spec = tmp_path / "mini.sched"
    spec.write_text(SPEC.read_text().replace('model   "muse_spark_nvfp4"', 'model   "muse_spark_mini_nvfp4"'))
    c = compiler.compile_spec(Path(spec))
    assert 'logits = lower.final_logits(k, logits, SHARDS.rule("vocab"))' in c.module_source
    assert "lower.prologue(k)" in c.module_source
