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
