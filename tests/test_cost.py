import pytest

from mkc import cost, target
from mkc.compiler import check_spec
from tests_support import SPEC


def test_step_floor_is_bandwidth_bound_and_grows_with_batch_and_context():
    s = check_spec(SPEC).ir
    bw = target.chip(s.chip).hbm_bytes_per_s
    t1 = cost.step_floor_seconds(s, bw, 1, 128)
    t8 = cost.step_floor_seconds(s, bw, 8, 128)
    t8_long = cost.step_floor_seconds(s, bw, 8, s.context)
    assert t1 < t8 < t8_long
    traffic = cost.hbm_traffic(s, 1, 128)
    assert traffic["weights"] == s.stream.streamed_bytes
    # Qwen 3.8 27B over 8 cores moves about 6.5-7 GB of weights per rank per step.
    assert 6.0e9 < traffic["weights"] < 7.5e9
    assert 1.5e-3 < t1 < 2.5e-3


def test_k3_floor_counts_pooled_attention_and_expected_experts():
    from tests_support import K3_SPEC
    s = check_spec(K3_SPEC).ir
    t1, t8 = cost.hbm_traffic(s, 1, 128), cost.hbm_traffic(s, 8, 128)
    # The attention matrices the view holds whole pass through the pool, about 23 MB a layer
    # and rank, and each MoE's latent_down (1.8 MB) and router (whole on every core: 12.8 MB);
    # the rest stream through the ring with the other matrices: 6.1 GB in all, wherever the
    # spec places them.
    assert 3.3e9 < t1["pooled weights"] < 3.5e9
    assert 6.0e9 < t1["pooled weights"] + t1["weights"] < 6.3e9
    # Uniform routing: 16 of 896 experts per row, 112 in this rank's group -> 2 at batch 1.
    assert cost.expected_local_experts(s, 1) == pytest.approx(2.0)
    # MXFP4 codes, two values a byte, and a scale per 32 rows of gate|up and of down
    per_expert = 3 * 3584 * 768 // 2 + 3584 // 32 * 1536 + 768 // 32 * 3584
    assert t1["routed experts (uniform routing)"] == pytest.approx(92 * 2 * per_expert)
    assert t1["routed experts (uniform routing)"] < t8["routed experts (uniform routing)"]
