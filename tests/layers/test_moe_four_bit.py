"""The int4 and NVFP4 expert formats wired through the library MoE (`mkc.layers.moe`), on Muse
Spark's MoE options with two ranks that each hold half of every expert's width:

* which formats a model's checkpoint offers (`MoE.weight_formats`: the dims' `expert_checkpoint`)
  and its tensors (`param_shapes`, bf16 where an NVFP4 checkpoint excludes a layer);
* NVFP4's random draws (codes, e4m3 scales in 1..8, values of RMS 1/sqrt(fan_in)) and
  NVIDIA's quantizer (`nvfp4_from_bf16`: its held values and their error);
* the packer: a rank's slot is its slice of the checkpoint (nvfp4 byte for byte, decoding to
  the checkpoint's values; int4 the requantization's codes), and the two ranks' slices tile
  every expert;
* the plain reference decodes NVFP4 exactly: the block equals the block on the decoded f32
  values; int4's requantization gives it the values packing holds, its error reported,
  refused without `rounded`;
* the rounding emulation on those formats is the f32 reference to bf16's precision;
* an NVFP4 checkpoint with bf16 layers: refused without `nvfp4 rounded` (naming the layers),
  and with it those layers requantized to NVFP4 for the reference and the packer alike; the
  dims fields a config reader takes from ModelOpt's quantization (`nvfp4_expert_fields`).
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from layer_bodies import PREFIX, draw_params, gap, layer_params, reference
from mkc.ir import WeightFormat
from mkc.layers.expert_formats import weights as fw
from mkc.layers.moe import MoE
from mkc.layers.moe import reference as moe_ref
from mkc.layers.moe import weights as moe_weights
from mkc.layers.moe.options import SCALED_SIGMOID, Checkpoint, nvfp4_expert_fields
from mkc.model.family import ConfigError, FormatError
from mkc.model.sharding import ShardTable
from mkc.reference.rounding import Reduce, Rounding
from test_moe_muse_spark import MUSE_SPARK_LATENT, MuseSparkMoEDims

MOE = MoE(norm="zero_centred", routing=SCALED_SIGMOID, latent=MUSE_SPARK_LATENT)
B, TP = 4, 2
SHARDS = ShardTable.of({"experts": (1, TP), "expert_mlp": (TP, 1)}, TP)
INT4 = WeightFormat("int4", 64, rounded=True)
NVFP4 = WeightFormat("nvfp4")


@dataclasses.dataclass(frozen=True)
class Dims(MuseSparkMoEDims):
    moe_intermediate_size: int = 128
    expert_checkpoint: str = ""
    expert_checkpoint_bf16_layers: tuple[int, ...] = ()


def _draws(d: Dims, seed: int = 5) -> tuple[dict, np.ndarray]:
    hf = draw_params(MOE, d, seed=seed)
    return hf, np.random.default_rng(9).normal(0, 1, (B, d.hidden_size)).astype(np.float32)


def _stored(name: str) -> str:
    return f"{PREFIX}mlp.experts.{name}_proj"


def test_the_checkpoint_offers_its_formats_and_declares_its_tensors():
    assert MOE.weight_formats(Dims()) == (("expert.gate_up", ("bf16", "fp8", "int4")),
                                          ("expert.down", ("bf16", "fp8", "int4")))
    nv = Dims(expert_checkpoint="nvfp4")
    assert MOE.expert_checkpoint(nv) is Checkpoint.NVFP4
    assert MOE.weight_formats(nv) == (("expert.gate_up", ("nvfp4",)), ("expert.down", ("nvfp4",)))
    shapes = moe_ref.param_shapes(MOE, nv, PREFIX)
    E, inter, io = nv.experts, nv.moe_intermediate_size, nv.moe_hidden_size
    assert shapes[_stored("gate_up")] == ((E, 2 * inter, io // 2), "uint8")
    assert shapes[_stored("down") + "_weight_scale"] == ((E, io, inter // 16), "float8_e4m3fn")
    assert shapes[_stored("down") + "_weight_scale_2"] == ((E,), "float32")
    excluded = dataclasses.replace(nv, expert_checkpoint_bf16_layers=(0,))
    assert moe_ref.param_shapes(MOE, excluded, PREFIX)[_stored("gate_up")] == ((E, 2 * inter, io), "bfloat16")
    assert moe_ref.param_shapes(MOE, excluded, "model.layers.1.")[
        "model.layers.1.mlp.experts.gate_up_proj"][1] == "uint8"
    with pytest.raises(ValueError, match="expert_checkpoint 'mxfp4'"):
        MOE.expert_checkpoint(Dims(expert_checkpoint="mxfp4"))
    with pytest.raises(FormatError, match="holds expert.down as nvfp4"):
        MOE.expert_formats(nv, {"expert.down": WeightFormat("bf16")}, TP)


def test_nvfp4_draws_are_weight_like():
    rng = np.random.default_rng(0)
    codes, scales, glob = fw.nvfp4_draw(rng, (3, 64, 128), 0.02)
    assert codes.dtype == np.uint8 and len(np.unique(codes)) > 200
    s = scales.astype(np.float32)
    assert scales.shape == (3, 64, 16) and s.min() >= 1 and s.max() <= 8 and len(np.unique(s)) > 16
    for e in range(3):
        packed, packed_scales = fw.pack_nvfp4_for_kernel(codes[e], scales[e], glob[e])
        values = fw.nvfp4_dequantize(packed, packed_scales)
        assert abs(np.sqrt(np.mean(values ** 2)) - 0.02) < 1e-6


def test_nvidias_quantizer_holds_what_it_reports():
    rng = np.random.default_rng(1)
    w = (rng.normal(0, 0.02, (32, 64)) * rng.uniform(0.1, 3, (32, 1))).astype(np.float32)
    r = fw.nvfp4_from_bf16(w)
    assert r.global_scale == np.float32(np.abs(w).max() / (6 * 448))
    held = r.held()
    err = held - w.astype(np.float64)
    assert r.changed == np.count_nonzero(err) > 0 and r.max_abs == np.abs(err).max()
    assert np.isclose(r.sq_err, np.sum(err ** 2)) and r.blocks == 32 * 4
    assert np.sqrt(r.sq_err / r.sq_ref) < 0.1
    # a slice of whole blocks under the matrix's global scale quantizes as the whole matrix does
    part = fw.nvfp4_from_bf16(w[5:9, 16:48], r.global_scale)
    np.testing.assert_array_equal(part.held(), held[5:9, 16:48])


def _ranks_slots(d, hf, formats, prefix: str = PREFIX) -> list[dict]:
    return [moe_weights.expert(MOE, hf, d, prefix, 3, rank, SHARDS, formats) for rank in range(TP)]


def test_nvfp4_slots_are_the_checkpoints_bytes_and_tile_each_expert():
    d = Dims(expert_checkpoint="nvfp4")
    hf, _ = _draws(d)
    slots = _ranks_slots(d, hf, {"expert.gate_up": NVFP4, "expert.down": NVFP4})
    e, inter, io, w = 3, d.moe_intermediate_size, d.moe_hidden_size, d.moe_intermediate_size // TP
    for name in ("gate_up", "down"):
        packed, scales = fw.pack_nvfp4_for_kernel(hf[_stored(name)][e].astype(np.uint8),
                                                  hf[_stored(name) + "_weight_scale"][e].astype(
                                                      ml_dtypes.float8_e4m3fn),
                                                  hf[_stored(name) + "_weight_scale_2"][e])
        whole = fw.nvfp4_dequantize(packed, scales)                           # [in, out]
        for rank, slot in enumerate(slots):
            mine = np.arange(rank * w, (rank + 1) * w)
            cut = whole[:, np.concatenate([mine, inter + mine])] if name == "gate_up" else whole[mine]
            codes, scales = slot[f"{name}_codes"], slot[f"{name}_scales"]
            np.testing.assert_array_equal(fw.nvfp4_dequantize(codes, scales), cut)
            assert codes.shape == ((io // 2, 2 * w) if name == "gate_up" else (w // 2, io))


def test_int4_slots_and_requantization_agree_and_report():
    d = Dims()
    hf, _ = _draws(d)
    formats = {"expert.gate_up": INT4, "expert.down": INT4}
    held, report = moe_weights.requantization(MOE, hf, d, formats, [PREFIX], SHARDS)
    assert set(report) == set(formats) and not report["expert.down"]["exact"]
    assert report["expert.down"]["blocks"] == d.experts * d.moe_hidden_size * d.moe_intermediate_size // 64
    slots = _ranks_slots(d, hf, formats)
    w = d.moe_intermediate_size // TP
    values = held[_stored("down")][3].astype(np.float32) * np.repeat(
        held[_stored("down") + moe_weights.BLOCK_SCALE][3], 64, axis=-1)
    for rank, slot in enumerate(slots):
        np.testing.assert_array_equal(fw.int4_dequantize(slot["down_codes"], slot["down_scales"]).T,
                                      values[:, rank * w:(rank + 1) * w])
    assert np.sqrt(report["expert.down"]["relative_rms_error"]) < 0.4
    with pytest.raises(FormatError, match="int4 block 64"):
        moe_weights.requantization(MOE, hf, d, {"expert.down": WeightFormat("int4", 64)}, [PREFIX], SHARDS)


def _emulation(d, p, x, formats) -> np.ndarray:
    rounding = Rounding(ranks=TP, reduces=(("kind", "routed_experts", Reduce(((TP, 1),), "f32")),),
                        gathers=(("kind", "latent_down", "f32"), ("kind", "latent_up", "f32")),
                        shard=(("expert_tp", TP), ("expert_width", d.moe_intermediate_size // TP),
                               ("local_experts", d.experts)), formats=tuple(formats.items()))
    return np.asarray(MOE.module("reference").forward(MOE, p, d, jnp.asarray(x), {}, 0,
                                                      jnp.zeros(B, jnp.int32), rounding, "kind"))


def test_the_reference_decodes_nvfp4_and_the_emulation_multiplies_it():
    d = Dims(expert_checkpoint="nvfp4")
    hf, x = _draws(d)
    got, _ = reference(MOE, d, hf, x, np.zeros(B, np.int32))
    decoded = dict(hf)
    for name in ("gate_up", "down"):
        glob = hf[_stored(name) + "_weight_scale_2"]
        decoded[_stored(name)] = np.stack([fw.nvfp4_dequantize(*fw.pack_nvfp4_for_kernel(
            hf[_stored(name)][e].astype(np.uint8), hf[_stored(name) + "_weight_scale"][e].astype(
                ml_dtypes.float8_e4m3fn), glob[e])).T for e in range(d.experts)]).astype(np.float32)
        for suffix in ("_weight_scale", "_weight_scale_2", "_input_scale"):
            del decoded[_stored(name) + suffix]
    want, _ = reference(MOE, Dims(), decoded, x, np.zeros(B, np.int32))
    assert gap(got - x, want - x) < 1e-6
    emulated = _emulation(d, layer_params(hf), x, {"expert.gate_up": NVFP4, "expert.down": NVFP4})
    assert 0 < gap(emulated - x, got - x) < 2e-2


def test_int4_requantization_feeds_the_reference_and_the_emulation():
    d = Dims()
    hf, x = _draws(d)
    formats = {"expert.gate_up": INT4, "expert.down": INT4}
    held, _ = moe_weights.requantization(MOE, hf, d, formats, [PREFIX], SHARDS)
    plain, _ = reference(MOE, d, hf, x, np.zeros(B, np.int32))
    rounded, _ = reference(MOE, d, hf | held, x, np.zeros(B, np.int32))
    assert 1e-4 < gap(rounded - x, plain - x) < 0.2
    emulated = _emulation(d, layer_params(hf | held), x, formats)
    assert gap(emulated - x, rounded - x) < 2e-2
    # without the requantization's tensors the emulation requantizes as packing does
    np.testing.assert_array_equal(_emulation(d, layer_params(hf), x, formats), emulated)


def test_an_nvfp4_checkpoints_bf16_layers_are_requantized_only_when_rounded():
    d = Dims(expert_checkpoint="nvfp4", expert_checkpoint_bf16_layers=(0, 3))
    with pytest.raises(FormatError, match=r"layers 0, 3, which its quantization keeps bf16") as e:
        MOE.expert_formats(d, {"expert.gate_up": NVFP4, "expert.down": NVFP4}, TP)
    assert "nvfp4 rounded" in e.value.hint
    rounded = dataclasses.replace(NVFP4, rounded=True)
    formats = {"expert.gate_up": rounded, "expert.down": rounded}
    assert {f.spelled for f in MOE.expert_formats(d, formats, TP).values()} == {"nvfp4 block 16 rounded"}
    hf, _ = _draws(d)                            # layer 0 (PREFIX) bf16
    assert hf[_stored("gate_up")].shape[-1] == d.moe_hidden_size
    held, report = moe_weights.requantization(MOE, hf, d, formats, [PREFIX, "model.layers.1."], SHARDS)
    assert set(held) == {_stored(n) + s for n in ("gate_up", "down") for s in ("", "_weight_scale",
                                                                              "_weight_scale_2")}
    assert report["expert.down"]["values"] == d.experts * d.moe_hidden_size * d.moe_intermediate_size
    # the packer's slots of layer 0 are the requantization's tensors' slices
    mine = _ranks_slots(d, hf, formats)
    theirs = _ranks_slots(dataclasses.replace(d, expert_checkpoint_bf16_layers=()), hf | held,
                          {"expert.gate_up": NVFP4, "expert.down": NVFP4})
    for a, b in zip(mine, theirs):
        assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    # a checkpoint whose dims do not say so: its packing refuses the bf16 layer
    with pytest.raises(FormatError, match="layer 0 expert 3's gate_up is bf16 in the NVFP4 checkpoint"):
        _ranks_slots(dataclasses.replace(d, expert_checkpoint_bf16_layers=()), hf, {"expert.gate_up": NVFP4})


def test_an_nvfp4_checkpoints_bf16_layers_in_a_kind_of_their_own_stay_bf16():
    """With the layers it keeps bf16 run as a kind of their own (`MoE.bf16_kind`), `nvfp4`
    holds every other layer's experts as released and those layers' bf16 as stored: packing
    gives layer 0 (PREFIX) its bf16 slices, layer 1 its NVFP4 ones; `rounded` goes back to one
    layout."""
    d = Dims(expert_checkpoint="nvfp4", expert_checkpoint_bf16_layers=(0,))
    own = dataclasses.replace(MOE, bf16_kind="moe_bf16")
    formats = {"expert.gate_up": NVFP4, "expert.down": NVFP4}
    fields = own.graph_fields(d, formats, TP)
    assert {c: f.spelled for c, f in fields["formats"].items()} == {
        "expert.gate_up": "nvfp4 block 16", "expert.down": "nvfp4 block 16"}
    assert {c: f.name for c, f in fields["kind_formats"]["moe_bf16"].items()} == {
        "expert.gate_up": "bf16", "expert.down": "bf16"}
    assert {n: t.dtype for n, t in fields["kind_experts"]["moe_bf16"].items()} == {
        "gate_up": "bf16", "down": "bf16"}
    assert {f.name for f in own.layer_formats(d, PREFIX, formats, TP).values()} == {"bf16"}
    assert {f.name for f in own.layer_formats(d, "model.layers.1.", formats, TP).values()} == {"nvfp4"}
    hf, _ = _draws(d)
    slot = moe_weights.expert(own, hf, d, PREFIX, 3, 0, SHARDS, formats)
    assert set(slot) == {"gate_up", "down"} and slot["down"].dtype == ml_dtypes.bfloat16
    rounded = {c: dataclasses.replace(NVFP4, rounded=True) for c in formats}
    assert "kind_experts" not in own.graph_fields(d, rounded, TP)


def test_nvfp4_layers_held_as_they_are_requantize_nothing():
    """`mkc.requantize` asks every class of a rounding format (nvfp4 is one, for the bf16
    layers): the checkpoint's NVFP4 layers give no tensors and a report of no values moved."""
    d = Dims(expert_checkpoint="nvfp4")
    hf, _ = _draws(d)
    held, report = moe_weights.requantization(MOE, hf, d, {"expert.gate_up": NVFP4}, [PREFIX], SHARDS)
    assert held == {} and report["expert.gate_up"]["exact"] and report["expert.gate_up"]["values"] == 0


def test_the_dims_fields_of_an_nvfp4_checkpoints_quantization():
    """What a family's config reader takes from ModelOpt's quantization (`nvfp4_expert_fields`):
    the layers whose experts its exclusion patterns name (the router's `*mlp.gate*` names none)."""
    quant = {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": [
        "lm_head", "*self_attn*", "*mlp.gate*", "model.language_model.layers.0.mlp.experts*",
        "*layers.61.mlp*", "model.layers.7.mlp", "model.layers.9.mlp.pre_expert_proj"]}
    assert nvfp4_expert_fields(quant, 62) == {"expert_checkpoint": "nvfp4",
                                               "expert_checkpoint_bf16_layers": (0, 7, 61)}
    assert nvfp4_expert_fields(None, 62) == {}
    assert nvfp4_expert_fields({"quant_algo": "NVFP4"}, 4)["expert_checkpoint_bf16_layers"] == ()
    with pytest.raises(ConfigError, match="'FP8' in groups of 16"):
        nvfp4_expert_fields({"quant_algo": "FP8"}, 4)
    with pytest.raises(ConfigError, match="groups of 32"):
        nvfp4_expert_fields({"quant_algo": "NVFP4", "group_size": 32}, 4)
