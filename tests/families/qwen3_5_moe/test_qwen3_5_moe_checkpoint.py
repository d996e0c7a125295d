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


def test_per_expert_layout_is_refused_by_name(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    """The Qwen2/3-MoE per-expert layout is not this family's: the reader names the tensors."""
    split = dict(params)
    prefix = "model.layers.0.mlp.experts."
    gate_up, down = split.pop(prefix + "gate_up_proj"), split.pop(prefix + "down_proj")
    inter = gate_up.shape[1] // 2
    for e in range(gate_up.shape[0]):
        split[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :inter]
        split[f"{prefix}{e}.up_proj.weight"] = gate_up[e, inter:]
        split[f"{prefix}{e}.down_proj.weight"] = down[e]
    save_checkpoint(tmp_path, MINI, split)
    with pytest.raises(CheckpointError, match=r"(?s)unexpected tensor.*experts\.0\.down_proj.*"
                                              r"missing 2 tensor.*experts\.down_proj"):
        load_checkpoint(tmp_path)
