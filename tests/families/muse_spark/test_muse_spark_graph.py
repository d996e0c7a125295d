"""The Muse Spark graph (`mkc.families.muse_spark.graph`): the layer pattern strung into one
step, each attention kind's and the MoE's ops between the gated residuals' pre-norm and update,
what a sliding kind declares, the shard rules it takes and refuses, and the MINI compiled from
the shipped spec."""
from __future__ import annotations

from pathlib import Path

import pytest

from mkc import compiler
from mkc.diagnostics import MkcError
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


def test_the_nvfp4_releases_bf16_layers_are_a_kind_holding_their_experts_bf16():
    """The NVFP4 MINI keeps layer 0's experts bf16 (its quantization's excluded modules): that
    layer's MoE is kind `moe_bf16`, whose experts the shipped spec holds bf16 as stored, in a
    slot view of their own and an HBM input of their own (the others NVFP4 as released);
    `nvfp4 rounded` requantizes them instead, one layout for both kinds."""
    nvfp4 = ref.load_config(CONFIG_DIR / "muse_spark_mini_nvfp4.json")
    assert nvfp4.expert_checkpoint_bf16_layers == (0,)
    assert nvfp4.layer_kinds[:4] == ("swa", "moe_bf16", "full", "moe")
    s = compiler.check_spec(SPEC, "muse_spark_mini_nvfp4").ir
    assert s.experts_of("moe") == s.experts and set(s.experts) == {
        "gate_up_codes", "gate_up_scales", "down_codes", "down_scales"}
    assert {n: d for n, (_, d) in s.experts_of("moe_bf16").items()} == {"gate_up": "bf16", "down": "bf16"}
    assert {c: f.spelled for c, f in s.weight_formats_of("moe_bf16").items()
            if c.startswith("expert.")} == {"expert.gate_up": "bf16", "expert.down": "bf16"}
    assert s.weight_formats["expert.down"].spelled == "nvfp4 block 16"       # exact: not rounded
    views = {k: (s.kinds[k].fetch.view, s.pool_view(f"staging.{s.kinds[k].fetch.view}").slots)
             for k in s.expert_kinds()}
    assert views == {"moe": ("experts", 3), "moe_bf16": ("experts_bf16", 1)}
    module = compiler.compile_spec(SPEC, "muse_spark_mini_nvfp4").module_source
    assert "hbm='experts_hbm__moe_bf16'" in module and '"experts_hbm": ((len(KIND_LAYERS["moe"])' in module
    text = SPEC.read_text().replace("nvfp4\n", "nvfp4 rounded\n")
    text = text.replace("staging.experts_bf16", "staging.experts")
    rounded = compiler.check_source(text, str(SPEC), "muse_spark_mini_nvfp4").ir
    assert rounded.kind_experts == {} and rounded.experts_of("moe_bf16") == rounded.experts


def test_one_slot_view_holds_one_layout():
    """Two kinds holding their experts in different layouts cannot share a slot view."""
    text = SPEC.read_text().replace("staging.experts_bf16", "staging.experts")
    with pytest.raises(MkcError) as e:
        compiler.check_source(text, str(SPEC), "muse_spark_mini_nvfp4")
    assert ("holds the routed experts of moe, moe_bf16, whose experts are held in different layouts"
            in str(e.value))
