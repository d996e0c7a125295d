"""Kimi K3 checkpoint layouts through mkc.checkpoint: the released composite (text tower under
`language_model.`, per-expert MXFP4 experts) and fused experts load equal to the family's
table (text-only names, per expert), sharded with an index; a bad fused tensor is named."""
from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from mkc.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from mkc.families.kimi_k3 import reference as ref
from mkc.model.config import CONFIG_DIR

MINI = json.loads((CONFIG_DIR / "kimi_k3_mini.json").read_text())
_EXPERT = re.compile(r"(?P<layer>.*block_sparse_moe\.experts\.)(?P<e>\d+)\.(?P<w>w[123])"
                     r"\.(?P<kind>weight_\w+)$")


@pytest.fixture(scope="module")
def params() -> dict[str, np.ndarray]:
    return ref.init_params(ref.load_config(MINI), seed=0)


def fused(params: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The experts as transformers fuses a Kimi Linear's (DeepseekV3Experts): per layer and
    per MXFP4 array, `gate_up_proj [E, 2I, ...]` = each expert's w1 (gate) rows then w3 (up)
    rows, `down_proj [E, out, ...]` = each expert's w2; every other tensor as it is."""
    out: dict[str, np.ndarray] = {}
    experts: dict[tuple[str, str, str], dict[int, np.ndarray]] = {}
    for name, a in params.items():
        if m := _EXPERT.match(name):
            experts.setdefault((m["layer"], m["w"], m["kind"]), {})[int(m["e"])] = a
        else:
            out[name] = a
    for (layer, w, kind), by_id in experts.items():
        stack = np.stack([by_id[e] for e in range(len(by_id))])
        if w == "w1":
            up = np.stack([v for _, v in sorted(experts[layer, "w3", kind].items())])
            out[f"{layer}gate_up_proj.{kind}"] = np.concatenate([stack, up], axis=1)
        elif w == "w2":
            out[f"{layer}down_proj.{kind}"] = stack
    return out


def _two_shards(tensors: dict[str, np.ndarray]) -> int:
    sizes = [a.nbytes for a in tensors.values()]
    return sum(sizes) // 2 + max(sizes)


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    assert list(got) == list(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        np.testing.assert_array_equal(got[name].view(np.uint8), a.view(np.uint8), err_msg=name)


def _save_sharded(path: Path, config: dict, stored: dict[str, np.ndarray]) -> None:
    save_checkpoint(path, config, stored, max_shard_bytes=_two_shards(stored))
    index = json.loads((path / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 2


def test_the_released_composite_layout_loads(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    """As the reference loader reads K3: `language_model.model.` and `language_model.lm_head.`,
    per-expert MXFP4 pairs, beside a vision tower that is skipped."""
    stored = {"language_model." + n: a for n, a in params.items()}
    stored["vision_tower.patch_embed.proj.weight"] = np.zeros((4, 3), np.float32)
    composite = {"model_type": "kimi_k3", "text_config": MINI}
    _save_sharded(tmp_path, composite, stored)
    _assert_same(load_checkpoint(tmp_path)[1], params)


def test_fused_experts_load_per_expert(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    stored = fused(params)
    assert "model.layers.1.block_sparse_moe.experts.gate_up_proj.weight_packed" in stored
    assert not any(_EXPERT.match(n) for n in stored)
    _save_sharded(tmp_path, MINI, stored)
    _assert_same(load_checkpoint(tmp_path)[1], params)
    _, lazy = load_checkpoint(tmp_path, lazy=True)
    name = "model.layers.6.block_sparse_moe.experts.31.w3.weight_scale"
    np.testing.assert_array_equal(np.asarray(lazy[name]), params[name])
    np.testing.assert_array_equal(lazy[name][2:5], params[name][2:5])


def test_a_bad_fused_tensor_is_named(tmp_path: Path, params: dict[str, np.ndarray]) -> None:
    stored = fused(params)
    gate_up = "model.layers.2.block_sparse_moe.experts.gate_up_proj.weight_packed"
    stored[gate_up] = stored[gate_up][:, : stored[gate_up].shape[1] // 2]       # w1 only
    mixed = "model.layers.4.block_sparse_moe.experts.0.w2.weight_scale"
    stored[mixed] = params[mixed]
    save_checkpoint(tmp_path, MINI, stored)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    msg = str(err.value)
    assert (f"{gate_up}: shape [32, 256, 128], expected [32, 512, 128] (the fused form of 32 experts' "
            "block_sparse_moe.experts.{e}.w1.weight_packed, block_sparse_moe.experts.{e}.w3.weight_packed)"
            ) in msg
    down = "model.layers.4.block_sparse_moe.experts.down_proj.weight_scale"
    assert f"{down}: stored both fused ({down}) and per expert ({mixed})" in msg
    assert "missing" not in msg
