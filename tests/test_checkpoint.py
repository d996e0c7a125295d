"""HF checkpoint directories: round trips (single file, sharded, multimodal layout) and error messages."""
from __future__ import annotations

import json
import re
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mkc.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mkc.families.qwen3_5 import reference as ref

ROOT = Path(__file__).resolve().parents[1]
MINI_JSON = ROOT / "mkc" / "model" / "configs" / "qwen3_8_mini.json"


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads(MINI_JSON.read_text())


@pytest.fixture(scope="module")
def params(config: dict) -> dict[str, np.ndarray]:
    return ref.init_params(ref.load_config(config), seed=0)


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint16), a.view(np.uint16), err_msg=name)


def test_round_trip_single_file(tmp_path: Path, config: dict, params: dict[str, np.ndarray]) -> None:
    save_checkpoint(tmp_path, config, params)
    assert (tmp_path / "model.safetensors").is_file()
    got_config, got = load_checkpoint(tmp_path)
    assert got_config == config
    _assert_same(got, params)


def test_round_trip_sharded(tmp_path: Path, config: dict, params: dict[str, np.ndarray]) -> None:
    save_checkpoint(tmp_path, config, params, max_shard_bytes=1 << 20)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (tmp_path / "model.safetensors").exists()
    _assert_same(load_checkpoint(tmp_path)[1], params)


def test_a_lazy_load_reads_tensors_when_packed_and_packs_the_same_bytes(
        tmp_path: Path, config: dict, params: dict[str, np.ndarray]) -> None:
    """`lazy=True` gives StoredTensors: shape and dtype from the header, the data read on use
    (whole by np.asarray, a part by indexing); a generated module packs them byte for byte as
    the arrays themselves, and checks their shapes without reading them."""
    import sys

    from mkc.checkpoint import StoredTensor
    from tests_support import ROOT, SPEC
    save_checkpoint(tmp_path, config, params, max_shard_bytes=1 << 20)
    _, lazy = load_checkpoint(tmp_path, lazy=True)
    name = "model.embed_tokens.weight"
    assert isinstance(lazy[name], StoredTensor) and lazy[name].shape == params[name].shape
    assert lazy[name].dtype == params[name].dtype == ml_dtypes.bfloat16
    np.testing.assert_array_equal(np.asarray(lazy[name]).view(np.uint16), params[name].view(np.uint16))
    part = lazy[name][3:5, 7:9]                                   # reads just this part
    np.testing.assert_array_equal(part.view(np.uint16), params[name][3:5, 7:9].view(np.uint16))
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import load_generated
    qwen = load_generated(SPEC, "qwen3_8_mini")
    for rank in (0, qwen.RANKS - 1):
        want, got = qwen.pack_rank(params, rank), qwen.pack_rank(lazy, rank)
        for key, a in want.items():
            np.testing.assert_array_equal(np.asarray(got[key]).view(np.uint8), np.asarray(a).view(np.uint8),
                                          err_msg=key)


def test_multimodal_layout_is_renamed_and_filtered(tmp_path: Path, config: dict,
                                                   params: dict[str, np.ndarray]) -> None:
    """Published Qwen3.5 layout: text under model.language_model., f32 A_log, vision and MTP extras."""
    stored = {("model.language_model." + n[len("model."):] if n.startswith("model.") else n): a
              for n, a in params.items()}
    a_log = "model.language_model.layers.0.linear_attn.A_log"
    stored[a_log] = stored[a_log].astype(np.float32)
    stored["model.visual.patch_embed.proj.weight"] = np.zeros((4, 3), ml_dtypes.bfloat16)
    stored["mtp.fc.weight"] = np.zeros((4, 4), ml_dtypes.bfloat16)
    composite = {"model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"],
                 "text_config": config}
    save_checkpoint(tmp_path, composite, stored)
    got_config, got = load_checkpoint(tmp_path)
    assert got_config == composite and list(got) == list(params)
    assert got["model.layers.0.linear_attn.A_log"].dtype == np.float32
    np.testing.assert_array_equal(got["model.layers.0.linear_attn.A_log"],
                                  params["model.layers.0.linear_attn.A_log"].astype(np.float32))


def test_missing_directory_and_files(tmp_path: Path, config: dict) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    with pytest.raises(CheckpointError, match="missing config.json"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"no model.safetensors.*\*.safetensors"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "llama"}))
    with pytest.raises(CheckpointError, match="config.json: unusable config.*qwen3_5_text"):
        load_checkpoint(tmp_path)


def test_missing_tensor(tmp_path: Path, config: dict, params: dict[str, np.ndarray]) -> None:
    gone = "model.layers.3.self_attn.k_norm.weight"
    save_checkpoint(tmp_path, config, {n: a for n, a in params.items() if n != gone})
    with pytest.raises(CheckpointError, match=rf"missing 1 tensor\(s\): {gone}"):
        load_checkpoint(tmp_path)


def test_unexpected_tensor(tmp_path: Path, config: dict, params: dict[str, np.ndarray]) -> None:
    # A linear layer's tensor on a full-attention layer: the layer pattern disagrees with the config.
    extra = "model.layers.3.linear_attn.A_log"
    save_checkpoint(tmp_path, config, {**params, extra: params["model.layers.0.linear_attn.A_log"]})
    with pytest.raises(CheckpointError, match=rf"1 unexpected tensor\(s\): {extra}"):
        load_checkpoint(tmp_path)


def test_wrong_shape_and_dtype(tmp_path: Path, config: dict, params: dict[str, np.ndarray]) -> None:
    name = "model.layers.0.linear_attn.conv1d.weight"
    bad = {**params, name: params[name][:, :, :3].copy(),
           "model.norm.weight": params["model.norm.weight"].view(np.int16)}
    save_checkpoint(tmp_path, config, bad)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert f"{name}: shape [4096, 1, 3], expected [4096, 1, 4]" in msg
    assert "model.norm.weight: dtype I16" in msg


def test_sharded_index_errors(tmp_path: Path, config: dict, params: dict[str, np.ndarray]) -> None:
    save_checkpoint(tmp_path, config, params, max_shard_bytes=1 << 20)
    index_path = tmp_path / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    files = sorted(set(index["weight_map"].values()))

    # The index points a tensor at a shard that does not hold it.
    moved = next(n for n, f in index["weight_map"].items() if f == files[0])
    wrong = {**index, "weight_map": {**index["weight_map"], moved: files[1]}}
    index_path.write_text(json.dumps(wrong))
    with pytest.raises(CheckpointError, match=rf"{files[1]}: tensors listed for it .* {moved}"):
        load_checkpoint(tmp_path)

    index_path.write_text(json.dumps(index))
    (tmp_path / files[-1]).unlink()
    with pytest.raises(CheckpointError, match=rf"shard files that do not exist: {files[-1]}"):
        load_checkpoint(tmp_path)

    index_path.write_text("{not json")
    with pytest.raises(CheckpointError, match="as a safetensors index: Expecting property name"):
        load_checkpoint(tmp_path)


def test_k3_mxfp4_codes_round_trip_as_uint8_and_floats_in_their_place_are_refused(tmp_path: Path) -> None:
    """Integer codes (MXFP4 blocks, E8M0 scales) load as stored; a float where the table says
    uint8 is named with the dtype expected (one rule: `mkc.model.family.stored_dtypes`)."""
    from mkc.families.kimi_k3 import reference as k3
    config = json.loads((ROOT / "mkc/model/configs/kimi_k3_mini.json").read_text())
    params = k3.init_params(k3.load_config(config), seed=0)
    codes = [n for n, a in params.items() if a.dtype == np.uint8]
    assert codes
    save_checkpoint(tmp_path / "good", config, params, max_shard_bytes=4 << 20)
    _assert_same(load_checkpoint(tmp_path / "good")[1], params)
    bad = {**params, codes[0]: params[codes[0]].astype(np.float32)}
    save_checkpoint(tmp_path / "bad", config, bad)
    with pytest.raises(CheckpointError, match=rf"{re.escape(codes[0])}: dtype F32, expected U8"):
        load_checkpoint(tmp_path / "bad")
