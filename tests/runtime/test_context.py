"""`mkc.runtime.context`: how a kernel's rows map onto sequences, state entries and waves
(decoding: every row its own sequence, updated in place; verifying: R consecutive rows per
sequence, each starting from the previous row's state)."""
from mkc.runtime.context import Kernel, Layer, spread_on_host


def _layer(B: int, R: int) -> Layer:
    kernel = Kernel(refs=None, B=B, axis="tp", dims=None, per_rank={}, kinds={}, ring=None,
                    ring_refs=None, parity=None, vector_refs=None, R=R, verify=R > 1)
    return Layer(kernel, None, "gdn", None, index=0, si=0, first_tile=0)


def test_decode_rows_are_sequences_updated_in_place():
    c = _layer(B=4, R=1)
    assert c.S == 4
    assert [c.sequence(b) for b in range(4)] == [0, 1, 2, 3]
    assert [c.state_source(b) for b in range(4)] == [0, 1, 2, 3]
    assert c.waves() == [(slice(0, 4), slice(0, 4))]


def test_verify_rows_are_wave_major_and_chain_through_the_previous_row():
    c = _layer(B=6, R=3)                       # 2 sequences of 3 rows: row r * 2 + s
    assert c.S == 2
    assert [c.sequence(b) for b in range(6)] == [0, 1, 0, 1, 0, 1]
    # the first wave starts from the loaded states (entries 0, 1), then row b from row b - S
    assert [c.state_source(b) for b in range(6)] == [0, 1, 0, 1, 2, 3]
    assert c.waves() == [(slice(0, 2), slice(0, 2)), (slice(2, 4), slice(0, 2)),
                         (slice(4, 6), slice(2, 4))]


def test_states_whose_rows_are_a_tiled_dim_come_spread():
    assert spread_on_host(batch_axis=1, ndim=3)          # conv [taps - 1, B, channels]
    assert not spread_on_host(batch_axis=0, ndim=4)      # recurrent [B, heads, dk, dv]
