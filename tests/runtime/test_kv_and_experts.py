"""``mkc.runtime.kv`` and ``mkc.runtime.experts`` in small grid-less kernels in TPU interpret mode
(both DMA modes and with race detection), against numpy: the KV row writes land at each row's
position inside aligned tiles (a verify step's rows of one sequence sharing and straddling
tiles) and the tile fold visits exactly the tokens up to each row's position; the expert
slots list the distinct picked experts of this rank's group in ascending order and cycle more
experts than slots through them."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec as P

from mkc.runtime import experts, kv, pool

F32, BF16 = jnp.float32, jnp.bfloat16
MODES = {"on_wait": dict(dma_execution_mode="on_wait"), "eager": dict(dma_execution_mode="eager"),
         "races": dict(dma_execution_mode="on_wait", detect_races=True, vector_clock_size=64)}


def _races_found() -> bool:
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    return bool(ipc.races.races_found)


# (sequences, rows per sequence, each sequence's first position): decoding; and verifying, with
# rows that share a 16-row tile, cross into the next, and end at the context's last token.
LAYOUTS = {"decode": (2, 1, [21, 40]), "verify": (2, 3, [14, 61])}


@pytest.mark.parametrize("early", [False, True], ids=["at_the_fold", "at_layer_start"])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("mode", MODES)
def test_kv_rows_are_written_and_the_fold_sees_tokens_up_to_each_position(mode, layout, early):
    S, R, starts = LAYOUTS[layout]
    B, T, W, layers, si = S * R, 64, 128, 2, 1
    # at layer start, the first 3 tiles (tokens 0-47) are copied before any row is written:
    # rows at 14-16, 21 and 40 land in them, 61-63 in a tile streamed after the writes
    tiles = (kv.KvTiles(tokens=16, slots=4, ahead=3, at_start=True) if early
             else kv.KvTiles(tokens=16, slots=2, ahead=1))
    # row r * S + s: sequence s at starts[s] + r
    positions = np.array([starts[s] + r for r in range(R) for s in range(S)], np.int32)
    seq = [b % S for b in range(B)]
    rng = np.random.default_rng(0)
    keys = rng.standard_normal((layers, S, T, W)).astype(ml_dtypes.bfloat16)
    values = rng.standard_normal((layers, S, T, W)).astype(ml_dtypes.bfloat16)
    new = rng.standard_normal((2, B, W)).astype(np.float32)

    def kernel(pos_ref, new_ref, k_in, v_in, sums_ref, k_out, v_out, rows_buf, sem, *tile_scratch):
        caches = (k_out, v_out)
        first = kv.Early(tile_scratch[:2], tile_scratch[2:]) if early else None
        if early:
            kv.start_first(tiles, caches, si, kv.tile_count(tiles, pos_ref, B), first)
        kv.write_rows(caches, rows_buf, sem, si, pos_ref, [new_ref[0], new_ref[1]], S, R,
                      early=(tiles, first) if early else None)

        def body(t, tile_refs, tokens, carry):
            k_tile, v_tile = tile_refs
            out = []
            for b in range(B):
                visible = (tokens <= pos_ref[b]).astype(F32)          # [1, tokens]
                tile = k_tile[seq[b]].astype(F32) + v_tile[seq[b]].astype(F32)
                out.append(carry[b] + jnp.dot(visible, tile, preferred_element_type=F32))
            return tuple(out)

        sums = kv.stream(tiles, caches, si, pos_ref, B, body, tuple(jnp.zeros((1, W), F32) for _ in range(B)),
                         first)
        sums_ref[...] = jnp.concatenate(sums, axis=0)

    any_spec = pl.BlockSpec(memory_space=pl.ANY)
    call = pl.pallas_call(
        kernel,
        out_shape=(jax.ShapeDtypeStruct((B, W), F32), jax.ShapeDtypeStruct(keys.shape, BF16),
                   jax.ShapeDtypeStruct(values.shape, BF16)),
        in_specs=[pl.BlockSpec(memory_space=pltpu.SMEM), pl.BlockSpec(memory_space=pltpu.VMEM),
                  any_spec, any_spec],
        out_specs=(pl.BlockSpec(memory_space=pltpu.VMEM), any_spec, any_spec),
        scratch_shapes=[pltpu.VMEM((2, B, 16, W), BF16), pltpu.SemaphoreType.DMA(()),
                        *([pltpu.VMEM((tiles.slots, S, 16, W), BF16)] * 2 if early else []),
                        *([pltpu.SemaphoreType.DMA((tiles.slots,))] * 2 if early else [])],
        input_output_aliases={2: 1, 3: 2},
        interpret=pltpu.InterpretParams(**MODES[mode]))
    sums, k_after, v_after = call(jnp.asarray(positions), jnp.asarray(new), jnp.asarray(keys),
                                  jnp.asarray(values))

    want_k, want_v = keys.astype(np.float32), values.astype(np.float32)
    for b in range(B):
        want_k[si, seq[b], positions[b]] = new[0, b].astype(ml_dtypes.bfloat16)
        want_v[si, seq[b], positions[b]] = new[1, b].astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(np.asarray(k_after, np.float32), want_k)   # only those rows changed
    np.testing.assert_array_equal(np.asarray(v_after, np.float32), want_v)
    want = np.stack([(want_k[si, seq[b]] + want_v[si, seq[b]])[:positions[b] + 1].sum(axis=0)
                     for b in range(B)])
    np.testing.assert_allclose(np.asarray(sums), want, rtol=1e-5, atol=1e-3)
    if mode == "races":
        assert not _races_found()


@pytest.mark.parametrize("mode", MODES)
def test_expert_slots_cycle_the_picked_experts_of_this_group(mode):
    """Rank 0 of two, one rank per group, 4 experts per group, 2 slots: the rows pick 3 of this
    group's experts (and some of the other group's), so the third cycles into slot 0. Each
    expert is two matrices of different widths, fetched by one copy of its slot image."""
    B, H, local, slots = 2, 128, 4, 2
    widths = {"a": 256, "b": 128}
    rows_a = pool.pooled_rows(H, widths["a"], "bf16")
    es = experts.ExpertSlots(pool="pool", slots=slots, slot_rows=rows_a + pool.pooled_rows(H, 128, "bf16"),
                             matrices={"a": (0, H, widths["a"]), "b": (rows_a, H, widths["b"])},
                             local_experts=local, group_size=1, top_k=3)
    ids = np.array([[3, 5, 0], [0, 6, 2]], np.int32)    # experts 5 and 6 are the other group's
    rng = np.random.default_rng(1)
    w = {n: rng.standard_normal((local, H, c)).astype(ml_dtypes.bfloat16) for n, c in widths.items()}
    x = rng.standard_normal((B, H)).astype(np.float32)
    hbm = np.stack([np.stack([experts.pack_expert(es, {n: w[n][e] for n in w}) for e in range(local)])])

    def kernel(ids_ref, x_ref, w_hbm, out_ref, order_ref, pool_ref, expert_sem, expert_list, expert_count):
        refs = type("Refs", (), {"pool": pool_ref, "expert_sem": expert_sem, "expert_list": expert_list,
                                 "expert_count": expert_count, experts.HBM: w_hbm})
        experts.select_local(es, refs, ids_ref[...], "ranks", B)
        experts.start_first(es, refs, 0)

        def body(k, acc):
            scale = (experts.global_id(es, refs, k, "ranks") + 1).astype(F32)
            outs = [pool.pooled_matmul(x_ref[...], pool_ref, *experts.matrix(es, refs, k, n))
                    for n in widths]
            return acc + scale * jnp.concatenate(outs, axis=1)

        out_ref[...] = experts.fold(es, refs, 0, body, jnp.zeros((B, sum(widths.values())), F32))
        for i in range(local):
            order_ref[i] = jnp.where(i < expert_count[0], expert_list[i], -1)

    vmem, smem = pl.BlockSpec(memory_space=pltpu.VMEM), pl.BlockSpec(memory_space=pltpu.SMEM)
    call = pl.pallas_call(
        kernel, out_shape=(jax.ShapeDtypeStruct((B, sum(widths.values())), F32),
                           jax.ShapeDtypeStruct((local,), jnp.int32)),
        in_specs=[vmem, vmem, pl.BlockSpec(memory_space=pl.ANY)], out_specs=(vmem, smem),
        scratch_shapes=[pltpu.VMEM((slots * es.slot_rows, 128), BF16), pltpu.SemaphoreType.DMA((slots,)),
                        pltpu.SMEM((local,), jnp.int32), pltpu.SMEM((1,), jnp.int32)],
        interpret=pltpu.InterpretParams(**MODES[mode]))
    mesh = Mesh(np.array(jax.devices()[:1]), ("ranks",))
    step = jax.shard_map(lambda *a: call(*a), mesh=mesh, in_specs=(P(),) * 3, out_specs=(P(), P()),
                         check_vma=False)
    out, order = step(jnp.asarray(ids), jnp.asarray(x), jnp.asarray(hbm))

    assert np.asarray(order).tolist() == [0, 2, 3, -1]       # distinct, ascending, ours only
    xb = x.astype(ml_dtypes.bfloat16).astype(np.float32)
    want = sum((e + 1) * np.concatenate([xb @ w[n][e].astype(np.float32) for n in widths], axis=1)
               for e in (0, 2, 3))
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-4, atol=1e-2)
    if mode == "races":
        assert not _races_found()
