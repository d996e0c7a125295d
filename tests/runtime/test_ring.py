"""Ring streaming's host side: a matrix cut into tiles in stream order comes back whole, and
every tile's class names its family's tile shape."""
import numpy as np

from mkc.runtime import ring


def test_put_tiles_round_trip_and_tile_classes():
    m = ring.StreamedMatrix("w", rows=300, cols=500, row_tiles=3, col_tiles=2, tile_rows=128,
                            tile_cols=256)
    tail = ring.StreamedMatrix("lm", rows=128, cols=128, row_tiles=1, col_tiles=1, tile_rows=128,
                               tile_cols=128)
    r = ring.Ring(slots=3, ahead=2, total_tiles=m.tiles + tail.tiles, tile_shapes=((128, 128), (128, 256)))
    hbm = np.zeros((r.total_tiles, *r.slot_shape), np.float32)
    w = np.random.default_rng(0).normal(size=(300, 500)).astype(np.float32)
    assert ring.put_tiles(hbm, 0, w, m) == m.tiles
    # tiles run column blocks outer, rows inner; zero padding past the matrix
    back = np.zeros((3 * 128, 2 * 256), np.float32)
    for t in range(m.tiles):
        j, i = divmod(t, m.row_tiles)
        back[i * 128:(i + 1) * 128, j * 256:(j + 1) * 256] = hbm[t]
    np.testing.assert_array_equal(back[:300, :500], w)
    assert not back[300:].any() and not back[:, 500:].any()
    assert ring.tile_classes(r, [m, tail]).tolist() == [1] * m.tiles + [0]
