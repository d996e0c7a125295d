"""The KDA layer kind on its own (Kimi K3 composes it without its residual: tests/families/
kimi_k3 and the K3 MINI interpret runs): with `residual`, its graph part adds its pre-norm and
residual add and its reference `forward` is the residual around the block; a heads part's
matrices and vectors are the upstream tensors' rows of its heads; the kernel's per-rank states
and the reference's layouts convert both ways."""
from __future__ import annotations

import types

import jax.numpy as jnp
import numpy as np

from mkc.layers.kda import KDA
from mkc.layers.kda import reference as kda_reference
from mkc.layers.kda import weights as kda_weights
from mkc.layers.reference import rms_norm
from mkc.layers.sublayer import body_table
from mkc.model.sharding import ShardTable

DIMS = types.SimpleNamespace(hidden_size=64, rms_norm_eps=1e-5, kda_num_heads=4, kda_head_dim=16,
                             conv_kernel_size=4, gate_lower_bound=-5.0)
PREFIX = "model.layers.0."


def _params(s: KDA, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    out = {}
    for name, (shape, _) in kda_reference.param_shapes(s, DIMS, PREFIX).items():
        w = kda_reference.init_weight(s, name, shape, rng)
        out[name] = (rng.normal(0.0, 1.0 / np.sqrt(shape[-1]), shape) if w is None else w).astype(np.float32)
    return out


def test_residual_adds_its_pre_norm_and_residual_add() -> None:
    with_res, without = KDA(), KDA(residual=False)
    part = with_res.part(DIMS, {"heads": 2})
    assert [op.name for op in part.ops] == list(with_res.op_names())
    assert part.ops[0].name == "input_norm" and part.ops[-1].name == "attn_residual"
    assert "input_norm" in part.tensors and "input_norm" not in without.part(DIMS, {"heads": 2}).tensors
    assert [op.name for op in without.part(DIMS, {"heads": 2}).ops] == list(without.op_names())
    assert part.per_rank == {"heads": 2, "kda_cols": 4 * 2 * 16 + 128}
    assert set(body_table({"kda": (with_res,)})) == {("kda", op) for op in with_res.op_names()}


def test_forward_is_the_residual_around_the_block() -> None:
    s = KDA()
    lp = {n[len(PREFIX):]: jnp.asarray(w) for n, w in _params(s).items()}
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, DIMS.hidden_size)), jnp.float32)
    cache = kda_reference.init_cache(s, DIMS, 0, 2, 8)
    sub = {n[len(s.prefix):]: w for n, w in lp.items() if n.startswith(s.prefix)}
    out, conv, rec = kda_reference.block(s, sub, DIMS, rms_norm(x, lp["input_layernorm.weight"], 1e-5),
                                         cache["layers.0.conv_state"], cache["layers.0.recurrent_state"])
    got = kda_reference.forward(s, lp, DIMS, x, cache, 0, jnp.zeros(2, jnp.int32), None, "kda")
    np.testing.assert_array_equal(got, x + out)
    np.testing.assert_array_equal(cache["layers.0.recurrent_state"], rec)
    assert np.abs(np.asarray(rec)).max() > 0 and cache["layers.0.conv_state"].dtype == jnp.bfloat16


def test_heads_parts_cut_the_upstream_tensors() -> None:
    s, hf = KDA(), _params(KDA())
    a, hd = PREFIX + s.prefix, DIMS.kda_head_dim
    shards = ShardTable.of({"heads": (2, 1)}, 2)
    o_proj = np.concatenate([kda_weights.matrix(s, hf, DIMS, PREFIX, "o_proj", r, shards) for r in (0, 1)])
    np.testing.assert_array_equal(o_proj, hf[a + "o_proj.weight"].T)
    proj = kda_weights.matrix(s, hf, DIMS, PREFIX, "projection", 1, shards)       # heads 2 and 3
    assert proj.shape == (DIMS.hidden_size, 4 * 2 * hd + 128)
    np.testing.assert_array_equal(proj[:, :2 * hd], hf[a + "q_proj.weight"][2 * hd:].T)
    np.testing.assert_array_equal(proj[:, 3 * 2 * hd:4 * 2 * hd], hf[a + "g_proj.weight"][2 * hd:].T)
    np.testing.assert_array_equal(proj[:, 4 * 2 * hd:4 * 2 * hd + 2], hf[a + "b_proj.weight"][2:].T)
    assert not proj[:, 4 * 2 * hd + 2:].any()
    a_log = kda_weights.vector(s, hf, DIMS, PREFIX, "a_log", 1, shards)
    np.testing.assert_array_equal(a_log[0], np.repeat(hf[a + "A_log"][2:], hd))
    taps = kda_weights.vector(s, hf, DIMS, PREFIX, "conv_weight", 0, shards)          # [K, 3 * width]
    np.testing.assert_array_equal(taps[:, 2 * hd:4 * hd], hf[a + "k_conv1d.weight"][:2 * hd, 0].T)


def test_states_convert_both_ways() -> None:
    s, batch, layers = KDA(), 3, [1, 5]
    shards = ShardTable.of({"heads": (2, 2)}, 4)         # two heads parts, each on two ranks
    per_rank = {"heads": 2}
    width, taps = 2 * DIMS.kda_head_dim, DIMS.conv_kernel_size
    shapes = {"kda__conv": ((len(layers), taps - 1, batch, 3 * width), np.float32),
              "kda__recurrent": ((len(layers), batch, 2, 16, 16), np.float32)}
    rng = np.random.default_rng(2)
    ref = {}
    for layer in layers:
        ref[f"layers.{layer}.conv_state"] = rng.normal(size=(batch, 6 * width, taps - 1)).astype(np.float32)
        ref[f"layers.{layer}.recurrent_state"] = rng.normal(size=(batch, 4, 16, 16)).astype(np.float32)
    state = kda_weights.kernel_states(s, ref, DIMS, per_rank, shards, "kda", layers, shapes)
    # ranks 2 and 3 hold heads part 1
    np.testing.assert_array_equal(state["kda__recurrent"][2], state["kda__recurrent"][3])
    back = kda_weights.reference_states(s, state, DIMS, per_rank, shards, "kda", layers)
    assert back.keys() == ref.keys()
    for name, value in ref.items():
        np.testing.assert_array_equal(back[name], value)
