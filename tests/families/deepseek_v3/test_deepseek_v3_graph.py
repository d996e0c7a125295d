"""The DeepSeek-V3 graph under shard rules: the per-rank sizes of the shipped layout (8 heads,
routed experts EP2 x TP8: a 256-wide slice of 128 experts a core), one expert's slot tensors
(from the published FP8 checkpoint its codes and f32 block scales, from a bf16 one its bf16
values), whole experts on every core too, and the rules it refuses, named."""
from __future__ import annotations

import pytest

import json

from mkc.families.deepseek_v3.graph import build
from mkc.ir import WeightFormat
from mkc.model.config import CONFIG_DIR
from mkc.families.deepseek_v3 import reference as ref
from mkc.model.graph import ShardingError

FULL = ref.load_config(CONFIG_DIR / "deepseek_v3.json")
BF16 = ref.load_config({k: v for k, v in json.loads((CONFIG_DIR / "deepseek_v3.json").read_text()).items()
                        if k != "quantization_config"})
RULES = {"heads": (16, 1), "mlp": (16, 1), "vocab": (16, 1), "experts": (2, 8), "expert_mlp": (8, 1)}


def test_the_shipped_layout_s_per_rank_sizes():
    g = build(FULL, RULES, 16)
    assert {k: g.per_rank[k] for k in ("heads", "cache_width", "inter", "shared", "local_experts",
                                       "expert_width", "expert_tp", "vocab")} == \
        {"heads": 8, "cache_width": 640, "inter": 1152, "shared": 128, "local_experts": 128,
         "expert_width": 256, "expert_tp": 8, "vocab": 8080}
    # the checkpoint's codes, and its f32 scale per 128 x 128 block as 4 bytes a scale: 56 row
    # groups x 4 column groups of gate|up's [7168, 512], 2 (padded to 8) x 56 of down's
    assert {n: t.shape for n, t in g.experts.items()} == {
        "gate_up_codes": (7168, 512), "gate_up_scales": (4 * 56, 4),
        "down_codes": (256, 7168), "down_scales": (4 * 8, 56)}
    assert set(g.formats.values()) == {WeightFormat("fp8", 128, cols=128)}
    bf16 = build(BF16, RULES, 16)
    assert {n: t.shape for n, t in bf16.experts.items()} == {"gate_up": (7168, 512), "down": (256, 7168)}
    assert {f.name for f in bf16.formats.values()} == {"bf16"}
    routed = next(op for op in g.kinds["moe"].ops if op.name == "routed_experts")
    assert routed.partial == ("experts", "expert_mlp")
    mla = g.kinds["mla"].tensors
    assert (mla["q_up"].shape, mla["key_up"].shape, mla["value_up"].shape, mla["o_proj"].shape) == \
        ((1536, 8 * 192), (8 * 128, 512), (512, 8 * 128), (8 * 128, 7168))
    assert "gate" not in mla and mla["latent"].shape == (640,)


def test_whole_experts_on_every_core():
    g = build(FULL, RULES | {"experts": (16, 1), "expert_mlp": (1, 16)}, 16)
    assert (g.per_rank["local_experts"], g.per_rank["expert_width"], g.per_rank["expert_tp"]) == (16, 2048, 1)
    assert (g.experts["down_codes"].shape, g.experts["down_scales"].shape) == ((2048, 7168), (4 * 16, 56))


@pytest.mark.parametrize("change", [{"experts": (4, 8)}, {"experts": (2, 1)}, {"expert_mlp": (8, 2)}])
def test_expert_rules_that_do_not_tile_the_ranks_are_refused(change):
    with pytest.raises(ShardingError, match="experts") as e:
        build(FULL, RULES | change, 16)
    assert e.value.dim_class == "experts"
