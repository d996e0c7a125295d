"""K3 per-rank families reproduce the reference kernel's per-rank bytes, and infeasible
shardings are rejected with the dimension that does not divide or the HBM that does not fit."""
import pytest

from mkc import target
from mkc.model.config import CONFIG_DIR
from mkc.model.graph import ShardingError
from mkc.model.kimi_k3_graph import (KimiDims, KimiSharding, family_bytes, hbm_bytes_per_rank,
                                     kimi_k3_families)

FULL = KimiDims.load(CONFIG_DIR / "kimi_k3.json")


def test_layer_plan():
    kinds = FULL.layer_kinds()
    assert len(kinds) == 93 and kinds[0] == ("kda", "dense")
    assert sum(a == "mla" for a, _ in kinds) == 24 and kinds[92] == ("mla", "moe")
    assert all(m == "moe" for _, m in kinds[1:])


def test_per_rank_bytes_match_the_reference_kernel():
    """MODELS.md: KDA ~31.3 MB, MLA ~45.4 MB, one routed expert ~7.0 MB per rank per layer;
    fixed MoE ~24.8 MB there, ~0.9 MB less here because latent_up is not padded to 8192."""
    fam = kimi_k3_families(FULL, KimiSharding())
    assert family_bytes(fam["kda"]) / 1e6 == pytest.approx(31.3, abs=0.1)
    assert family_bytes(fam["mla"]) / 1e6 == pytest.approx(45.4, abs=0.1)
    assert family_bytes(fam["expert"]) / 1e6 == pytest.approx(7.0, abs=0.05)
    assert family_bytes(fam["moe"]) / 1e6 == pytest.approx(24.8 - 0.92, abs=0.1)
    assert fam["dense"]["down"].shape == (1152, 7168)      # 33792 / 32 = 1056, padded


def test_full_model_fits_16_chips_but_not_8():
    chip = target.chip("tpu7x")
    per_chip = sum(hbm_bytes_per_rank(FULL, KimiSharding()).values()) * chip.cores_per_chip
    assert per_chip < chip.hbm_bytes * chip.cores_per_chip
    half = KimiSharding(ranks=16, expert_tp=2)
    per_chip_half = sum(hbm_bytes_per_rank(FULL, half).values()) * chip.cores_per_chip
    assert per_chip_half > chip.hbm_bytes * chip.cores_per_chip


@pytest.mark.parametrize("sharding, words", [
    (KimiSharding(ranks=20, expert_tp=4), "attention heads = 96 does not divide over 20"),
    (KimiSharding(ranks=32, expert_tp=5), "do not form groups of expert_tp = 5"),
    (KimiSharding(ranks=12, expert_tp=4), "routed experts = 896 does not divide over 3"),
])
def test_infeasible_shardings_name_the_dimension(sharding, words):
    with pytest.raises(ShardingError) as e:
        kimi_k3_families(FULL, sharding)
    assert words in str(e.value)
