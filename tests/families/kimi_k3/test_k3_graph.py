"""K3 per-rank families reproduce the reference kernel's per-rank bytes (where mkc's layout is
the same), and infeasible shardings are rejected with the rule to blame."""
import pytest

from mkc.ir import WeightFormat
from mkc.model.family import FormatError
from mkc import target
from mkc.model.config import CONFIG_DIR
from mkc.model.graph import ShardingError, build_graph
from mkc.families.kimi_k3.config import KimiDims
from mkc.families.kimi_k3.graph import build
from mkc.model.graph import Tensor

FULL = KimiDims.load(CONFIG_DIR / "kimi_k3.json")
RULES = {"heads": (32, 1), "mlp": (32, 1), "vocab": (32, 1), "latent_down": (32, 1),
         "experts": (8, 4), "expert_mlp": (4, 1), "latent_up": (8, 1), "router": (2, 1)}


def family_bytes(families: dict[str, Tensor]) -> int:
    return sum(t.nbytes for t in families.values() if t.role == "matrix")


def kimi_k3_families(formats: dict[str, WeightFormat] | None = None, rules=RULES, ranks: int = 32
                     ) -> dict[str, dict[str, Tensor]]:
    """Each sublayer kind's per-rank tensors and one routed expert's ("expert")."""
    g = build(FULL, rules, ranks, formats)
    return {kind: k.tensors for kind, k in g.kinds.items()} | {"expert": g.experts}


def hbm_bytes_per_rank(rules=RULES, ranks: int = 32) -> int:
    """Weight bytes one rank holds in HBM (states and caches come with a batch)."""
    g, kinds = build(FULL, rules, ranks), FULL.layer_kinds
    fam = kimi_k3_families(rules=rules, ranks=ranks)
    return (sum(family_bytes(fam[k]) for k in kinds)
            + kinds.count("moe") * g.per_rank["local_experts"] * family_bytes(fam["expert"])
            + 2 * g.per_rank["vocab"] * FULL.hidden_size * 2)


def test_layer_plan():
    plan = list(zip(FULL.layer_kinds[::2], FULL.layer_kinds[1::2]))
    assert len(plan) == 93 and plan[0] == ("kda", "dense")
    assert sum(a == "mla" for a, _ in plan) == 24 and plan[92] == ("mla", "moe")
    assert all(m == "moe" for _, m in plan[1:])
    assert len(FULL.layer_kinds) == 186 and FULL.layer_kinds[6:8] == ("mla", "moe")


def test_per_rank_bytes_match_the_reference_kernel():
    """MODELS.md: KDA ~31.3 MB, MLA ~45.4 MB per rank per layer; fixed MoE ~24.8 MB there. mkc
    does not pad q_up's heads to 256 (MLA 0.6 MB less) nor latent_up to 8192 (0.9 MB less), and
    keeps gate/up MXFP4 instead of re-blocking to FP8 (an expert 4.4 MB instead of 7.0)."""
    fam = kimi_k3_families()
    assert family_bytes(fam["kda"]) / 1e6 == pytest.approx(31.3, abs=0.1)
    assert family_bytes(fam["mla"]) / 1e6 == pytest.approx(45.4 - 0.59, abs=0.1)
    assert family_bytes(fam["moe"]) / 1e6 == pytest.approx(24.8 - 0.92, abs=0.1)
    # MXFP4: half a byte per weight plus one byte per 32: 3 * 3584 * 768 * (1/2 + 1/32).
    assert family_bytes(fam["expert"]) == 3 * 3584 * 768 * 17 // 32
    assert fam["dense"]["down"].shape == (1152, 7168)      # 33792 / 32 = 1056, padded


def test_fp8_experts_hold_a_byte_a_value_and_the_same_scales():
    """`format expert.gate_up fp8` (the reference kernel's choice): FP8 gate/up and MXFP4 down
    make an expert of ~7.0 MB per rank, as MODELS.md gives once the scales are counted as that
    kernel keeps them (one per 256 rows of gate/up; mkc keeps the checkpoint's per 32); all
    FP8 a byte a value."""
    gate_up = kimi_k3_families({"expert.gate_up": WeightFormat("fp8")})["expert"]
    assert gate_up["gate_up_codes"].shape == (3584, 2 * 768)
    assert gate_up["gate_up_scales"].shape == (3584 // 32, 2 * 768)
    assert gate_up["gate_up_codes"].mxu.values_per_byte == 1.0
    finer_scales = 3584 // 32 * 1536 - 3584 // 256 * 1536
    assert (family_bytes(gate_up) - finer_scales) / 1e6 == pytest.approx(7.0, abs=0.05)
    both = kimi_k3_families(dict.fromkeys(("expert.gate_up", "expert.down"),
                                                                WeightFormat("fp8")))
    assert family_bytes(both["expert"]) == 3 * 3584 * 768 * 33 // 32
    blocked = kimi_k3_families({"expert.gate_up": WeightFormat("fp8", 512),
                                                      "expert.down": WeightFormat("fp8", 1 << 20)})
    assert blocked["expert"]["gate_up_scales"].shape == (3584 // 512, 1536)
    assert blocked["expert"]["down_scales"].shape == (1, 3584)       # a block past the rows: one


def test_a_block_must_be_whole_pack_groups():
    for cls, block in (("expert.gate_up", 256), ("expert.down", 192), ("expert.down", 64)):
        with pytest.raises(FormatError, match="does not tile"):
            kimi_k3_families({cls: WeightFormat("fp8", block)})
    with pytest.raises(FormatError, match="MXFP4 keeps"):
        kimi_k3_families({"expert.down": WeightFormat("mxfp4", 128)})


def test_hbm_per_chip_fits_16_chips_but_not_4():
    chip = target.chip("tpu7x")
    per_chip = hbm_bytes_per_rank() * chip.cores_per_chip
    assert per_chip < chip.hbm_bytes * chip.cores_per_chip
    small = {**dict.fromkeys(("heads", "mlp", "vocab", "latent_down"), (8, 1)), "experts": (2, 4),
             "expert_mlp": (4, 1), "latent_up": (8, 1), "router": (2, 1)}
    per_chip_small = hbm_bytes_per_rank(small, 8) * chip.cores_per_chip
    assert per_chip_small > chip.hbm_bytes * chip.cores_per_chip


def test_graph_from_rules_has_four_sublayer_kinds():
    g = build_graph(FULL, build(FULL, RULES, 32), 32)
    assert sorted(g.kinds) == ["dense", "kda", "mla", "moe"]
    assert g.per_rank["local_experts"] == 112 and g.per_rank["expert_width"] == 768
    assert g.kinds["moe"].tensors["latent_up"].shape == (3584, 896)
    assert g.kinds["mla"].readers("key_up") == [g.kinds["mla"].op_names().index("absorb_query")]


@pytest.mark.parametrize("change, words, cls", [
    ({"experts": (4, 8)}, "must tile the 32 ranks", "experts"),
    ({"heads": (16, 2)}, "splits heads over consecutive ranks", "heads"),
    ({"latent_up": (8, 4)}, "latent_up must split over consecutive ranks", "latent_up"),
    ({"expert_mlp": (32, 1), "experts": (1, 32)}, "width slice of 96 is not a multiple of 64",
     "expert_mlp"),
])
def test_infeasible_rules_name_the_rule(change, words, cls):
    with pytest.raises(ShardingError) as e:
        build_graph(FULL, build(FULL, RULES | change, 32), 32)
    assert words in str(e.value)
    if cls:
        assert e.value.dim_class == cls


def _over(ranks: int, tp: int) -> dict[str, tuple[int, int]]:
    """Rules splitting K3 over `ranks` cores, each expert's width over `tp`."""
    return {**dict.fromkeys(("heads", "mlp", "vocab", "latent_down"), (ranks, 1)),
            "experts": (ranks // tp, tp), "expert_mlp": (tp, 1), "latent_up": (4, 1), "router": (2, 1)}


@pytest.mark.parametrize("ranks, tp, words", [
    (20, 4, "kda_num_heads = 96 does not divide into 20 parts"),
    (12, 4, "num_experts = 896 does not divide into 3 parts"),
])
def test_infeasible_shardings_name_the_dimension(ranks, tp, words):
    with pytest.raises(ShardingError) as e:
        build(FULL, _over(ranks, tp), ranks)
    assert words in str(e.value)
