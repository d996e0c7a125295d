"""HF checkpoint round trips of the Qwen3.5 MoE MINI model through mkc.checkpoint (which finds
the family by the config's model_type)."""
from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mkc.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mkc.families.qwen3_5_moe import reference as ref
from mkc.model.config import CONFIG_DIR

MINI = json.loads((CONFIG_DIR / "qwen3_5_moe_mini.json").read_text())


@pytest.fixture(scope="module")
def params() -> dict[str, np.ndarray]:
    return ref.init_params(ref.load_config(MINI), seed=0)


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint16), a.view(np.uint16), err_msg=name)


def test_round_trip(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    save_checkpoint(tmp_path / "one", MINI, params)
    got_config, got = load_checkpoint(tmp_path / "one")
    assert got_config == MINI
    _assert_same(got, params)
    save_checkpoint(tmp_path / "sharded", MINI, params, max_shard_bytes=1 << 20)
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    _assert_same(load_checkpoint(tmp_path / "sharded")[1], params)


def test_published_multimodal_layout(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    """As Qwen3_5MoeForConditionalGeneration stores it: text under model.language_model., f32
    A_log, a vision tower and an MTP head (per-expert, as its MoE layer is stored) to skip."""
    stored = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): a
              for n, a in params.items()}
    a_log = "model.language_model.layers.0.linear_attn.A_log"
    stored[a_log] = stored[a_log].astype(np.float32)
    stored["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), ml_dtypes.bfloat16)
    stored["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = np.zeros((4, 4), ml_dtypes.bfloat16)
    composite = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                 "text_config": MINI}
    save_checkpoint(tmp_path, composite, stored)
    got_config, got = load_checkpoint(tmp_path)
    assert got_config == composite and list(got) == list(params)
    np.testing.assert_array_equal(got["model.layers.0.linear_attn.A_log"],
                                  params["model.layers.0.linear_attn.A_log"].astype(np.float32))
    np.testing.assert_array_equal(got["model.layers.3.mlp.experts.gate_up_proj"].view(np.uint16),
                                  params["model.layers.3.mlp.experts.gate_up_proj"].view(np.uint16))


def per_expert(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What transformers' default `save_pretrained` of a Qwen3_5MoeForCausalLM writes: each
    layer's fused experts split back into the Qwen2/3-MoE per-expert tensors (the inverse of
    its qwen2_moe converters; written from upstream's shapes, not from mkc's table: gate rows
    first in `gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`)."""
    out: dict[str, np.ndarray] = {}
    for name, a in params.items():
        prefix, sep, fused = name.rpartition("mlp.experts.")
        if not sep:
            out[name] = a
            continue
        inter = a.shape[1] // 2
        for e in range(a.shape[0]):
            if fused == "gate_up_proj":
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = a[e, :inter]
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = a[e, inter:]
            else:
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = a[e]
    return out


def two_shards(tensors: dict[str, np.ndarray]) -> int:
    """A `max_shard_bytes` that splits `tensors` into exactly two files."""
    sizes = [a.nbytes for a in tensors.values()]
    return sum(sizes) // 2 + max(sizes)


def test_per_expert_sharded_composite_checkpoint_loads_equal_to_the_fused_params(
        tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    """transformers' default save (per expert), under the published composite names, in two
    shards with an index: loads equal to the fused parameters, and lazily one expert at a time."""
    stored = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): a
              for n, a in per_expert(params).items()}
    composite = {"model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
                 "text_config": MINI}
    save_checkpoint(tmp_path, composite, stored, max_shard_bytes=two_shards(stored))
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2
    assert "model.language_model.layers.2.mlp.experts.15.up_proj.weight" in index["weight_map"]
    _assert_same(load_checkpoint(tmp_path)[1], params)
    _, lazy = load_checkpoint(tmp_path, lazy=True)
    name = "model.layers.2.mlp.experts.gate_up_proj"
    assert lazy[name].shape == params[name].shape and lazy[name].dtype == ml_dtypes.bfloat16
    for e in (0, 9, -1):
        np.testing.assert_array_equal(lazy[name][e].view(np.uint16), params[name][e].view(np.uint16))
    np.testing.assert_array_equal(lazy[name][3, 5:7].view(np.uint16), params[name][3, 5:7].view(np.uint16))
    np.testing.assert_array_equal(np.asarray(lazy[name]).view(np.uint16), params[name].view(np.uint16))


def _load_error(tmp_path: Path, stored: dict[str, np.ndarray]) -> str:
    save_checkpoint(tmp_path, MINI, stored)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    return str(err.value)


def test_a_partial_per_expert_set_is_named(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    stored = per_expert(params)
    del stored["model.layers.1.mlp.experts.5.up_proj.weight"]
    extra = "model.layers.1.mlp.experts.16.down_proj.weight"          # expert 16 of 0..15
    stored[extra] = stored["model.layers.1.mlp.experts.0.down_proj.weight"]
    msg = _load_error(tmp_path, stored)
    assert ("model.layers.1.mlp.experts.gate_up_proj: stored per expert, but 1 of its 32 per-expert "
            "tensors are missing: model.layers.1.mlp.experts.5.up_proj.weight") in msg
    assert f"1 unexpected tensor(s): {extra}" in msg
    assert "missing 1 tensor" not in msg        # the fused tensor is not listed as missing as well


def test_a_misshapen_expert_and_mixed_layouts_are_named(tmp_path: Path,
                                                        params: dict[str, np.ndarray]) -> None:
    stored = per_expert(params)
    gate = "model.layers.0.mlp.experts.7.gate_proj.weight"
    stored[gate] = np.ascontiguousarray(stored[gate].T)                          # [H, I], not [I, H]
    stored["model.layers.3.mlp.experts.down_proj"] = params["model.layers.3.mlp.experts.down_proj"]
    msg = _load_error(tmp_path, stored)
    assert (f"{gate}: shape [256, 128], expected [128, 256] (expert 7 of "
            "model.layers.0.mlp.experts.gate_up_proj [16, 256, 256])") in msg
    assert ("model.layers.3.mlp.experts.down_proj: stored both fused (model.layers.3.mlp.experts.down_proj)"
            " and per expert (model.layers.3.mlp.experts.0.down_proj.weight") in msg
    assert "keep one layout" in msg


def test_a_lazy_per_expert_load_packs_the_same_bytes(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    """The generated module packs a lazily loaded per-expert checkpoint (its fused experts read
    one expert at a time) byte for byte as the fused arrays."""
    import sys

    from tests_support import ROOT
    stored = per_expert(params)
    save_checkpoint(tmp_path, MINI, stored, max_shard_bytes=two_shards(stored))
    _, lazy = load_checkpoint(tmp_path, lazy=True)
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import load_generated
    module = load_generated(ROOT / "schedules" / "qwen3_5_35b_a3b.sched", "qwen3_5_moe_mini")
    for rank in (0, module.RANKS - 1):
        want, got = module.pack_rank(params, rank), module.pack_rank(lazy, rank)
        for key, a in want.items():
            np.testing.assert_array_equal(np.asarray(got[key]).view(np.uint8), np.asarray(a).view(np.uint8),
                                          err_msg=key)
