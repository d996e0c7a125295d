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
    (tmp_path / "config.json").write_text(json.dumps({**config, "model_type": "falcon"}))
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


# ---------------------------------------------------------------------------------------------
# Hostile checkpoints: every file opened is inside the checkpoint and size-capped before it is
# read, every value read is checked, and each failure is a located diagnostic through the CLI.

QWEN_MOE_SPEC = ROOT / "schedules" / "qwen3_5_35b_a3b.sched"


def _cli_diagnostic(argv: list[str], capsys) -> dict:
    """The one diagnostic of an `mkc ... --json` run that fails (exit 1, no exception)."""
    from mkc.cli import main
    assert main([*argv, "--json"]) == 1
    [d] = json.loads(capsys.readouterr().out)["diagnostics"]
    return d


def _line_of(spec: Path, start: str) -> int:
    return next(i for i, t in enumerate(spec.read_text().splitlines(), 1) if t.strip().startswith(start))


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_non_finite_weight_is_refused_naming_the_tensor(tmp_path: Path, config: dict, params: dict,
                                                          value: float, capsys) -> None:
    """A dense Qwen checkpoint with one non-finite weight: the eager load, the lazy load's
    reads (whole, a part) and `mkc check`/`mkc compile --model DIR` all refuse it, naming the
    tensor and the index (they loaded, and packed, it silently)."""
    name = "model.layers.2.mlp.up_proj.weight"
    bad = params[name].copy()
    bad[5, 7] = value
    save_checkpoint(tmp_path, config, {**params, name: bad}, max_shard_bytes=1 << 20)
    want = (rf"tensor {re.escape(name)} holds 1 non-finite value\(s\), the first \(-?(nan|inf)\) "
            r"at index \[5, 7\]")
    with pytest.raises(CheckpointError, match=want):
        load_checkpoint(tmp_path)
    _, lazy = load_checkpoint(tmp_path, lazy=True)
    for read in (np.asarray, lambda t: t[4:6], lambda t: t[5]):
        with pytest.raises(CheckpointError, match=want):
            read(lazy[name])
    np.testing.assert_array_equal(lazy[name][:5].view(np.uint16), params[name][:5].view(np.uint16))
    from tests_support import SPEC
    for cmd in ("check", "compile"):
        out = tmp_path / "out"
        output = ["-o", str(out)] if cmd == "compile" else []
        d = _cli_diagnostic([cmd, str(SPEC), "--model", str(tmp_path), *output], capsys)
        assert d["code"] == "E-CHECKPOINT" and re.search(want, d["message"]), d
        assert (d["file"], d["line"]) == (str(SPEC), _line_of(SPEC, "model")) and "re-download" in d["hint"]
        assert not out.exists()


def test_a_non_finite_expert_weight_is_located_at_its_format_line(tmp_path: Path, capsys) -> None:
    """NaN in Qwen3.5 MoE's fused gate_up experts, which `format expert.gate_up fp8 block N
    rounded` (the shipped spec's rounded FP8 variant) requantizes: a diagnostic at that line
    naming the tensor (was: ValueError 'a value that is not finite cannot be requantized to
    FP8')."""
    from mkc.families.qwen3_5_moe import reference as moe
    from tests_support import format_text
    config = json.loads((ROOT / "mkc/model/configs/qwen3_5_moe_mini.json").read_text())
    params = moe.init_params(moe.load_config(config), seed=0)
    name = "model.layers.1.mlp.experts.gate_up_proj"
    bad = params[name].copy()
    bad[3, 2, 1] = np.nan
    save_checkpoint(tmp_path, config, {**params, name: bad})
    spec = tmp_path / "spec" / QWEN_MOE_SPEC.name
    spec.parent.mkdir()
    spec.write_text(format_text(QWEN_MOE_SPEC, "fp8 block"))
    d = _cli_diagnostic(["check", str(spec), "--model", str(tmp_path)], capsys)
    assert d["code"] == "E-CHECKPOINT" and d["line"] == _line_of(spec, "format expert.gate_up")
    assert d["message"].startswith("`format expert.gate_up fp8 block")
    assert f"tensor {name} holds 1 non-finite value(s), the first (nan) at index [3, 2, 1]" in d["message"]


def test_a_nan_e8m0_scale_is_refused_at_the_format_line(tmp_path: Path, capsys) -> None:
    """K3 MINI with one MXFP4 scale of 255 (E8M0's NaN): the loader names the tensor; `mkc
    check` of the K3 spec with rounded FP4 experts locates it at the requantizing class's
    `format` line (was: ValueError 'a scale of 255 (NaN) cannot be requantized')."""
    import sys

    from mkc.families.kimi_k3 import reference as k3
    from tests_support import k3_format_text
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import k3_mini_text
    config = json.loads((ROOT / "mkc/model/configs/kimi_k3_mini.json").read_text())
    params = k3.init_params(k3.load_config(config), seed=0)
    name = "model.layers.1.block_sparse_moe.experts.0.w2.weight_scale"
    bad = params[name].copy()
    bad[4, 1] = 255
    save_checkpoint(tmp_path / "ckpt", config, {**params, name: bad})
    want = f"tensor {name} holds 1 E8M0 scale(s) of 255 (NaN), the first at index [4, 1]"
    with pytest.raises(CheckpointError, match=re.escape(want)):
        load_checkpoint(tmp_path / "ckpt")
    spec = tmp_path / "kimi_k3.sched"
    spec.write_text(k3_mini_text(k3_format_text("fp4 block")))
    d = _cli_diagnostic(["check", str(spec), "--model", str(tmp_path / "ckpt")], capsys)
    assert (d["code"], d["line"]) == ("E-CHECKPOINT", _line_of(spec, "format expert.down")), d
    assert want in d["message"] and d["message"].startswith("`format expert.down fp4 block")


def _sparse(path: Path, size: int) -> None:
    with path.open("r+b" if path.exists() else "wb") as f:
        f.truncate(size)


def test_oversized_json_and_headers_are_refused_before_they_are_read(
        tmp_path: Path, config: dict, params: dict) -> None:
    """A 2 GB (sparse) index or config and a safetensors header length past the cap: an error
    naming the file and the cap, nothing read (was: the whole file read, MemoryError)."""
    from mkc.checkpoint import MAX_HEADER_BYTES
    save_checkpoint(tmp_path, config, params, max_shard_bytes=1 << 20)
    index = tmp_path / "model.safetensors.index.json"
    good = index.read_bytes()
    _sparse(index, 2 << 30)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(index))} as a safetensors index: it is "
                                              r"larger than 128 MiB, the most mkc reads of it"):
        load_checkpoint(tmp_path)
    index.write_bytes(good)
    _sparse(tmp_path / "config.json", 2 << 30)
    with pytest.raises(CheckpointError, match="as a Hugging Face config: it is larger than 4 MiB"):
        load_checkpoint(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shard = tmp_path / json.loads(good)["weight_map"]["model.norm.weight"]
    data = bytearray(shard.read_bytes())
    data[:8] = (MAX_HEADER_BYTES + 1).to_bytes(8, "little")
    shard.write_bytes(data)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(shard))}: not a safetensors file \(its "
                                              rf"header length is {MAX_HEADER_BYTES + 1} bytes; at most "
                                              rf"{MAX_HEADER_BYTES}"):
        load_checkpoint(tmp_path)


def test_a_sparse_2gb_index_is_a_diagnostic_under_a_4gib_address_space(tmp_path: Path, config: dict,
                                                                       params: dict) -> None:
    """`mkc check --model DIR` under `ulimit -v 4194304` (was: MemoryError traceback)."""
    import os
    import resource
    import subprocess
    import sys

    from tests_support import SPEC
    save_checkpoint(tmp_path, config, params, max_shard_bytes=1 << 20)
    _sparse(tmp_path / "model.safetensors.index.json", 2 << 30)

    def cap() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    r = subprocess.run([sys.executable, "-m", "mkc", "check", str(SPEC), "--model", str(tmp_path)],
                       cwd=ROOT, env=dict(os.environ, JAX_PLATFORMS="cpu"), preexec_fn=cap,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr[-3000:]
    assert "error[E-CHECKPOINT]" in r.stderr and "larger than 128 MiB" in r.stderr


@pytest.mark.parametrize("family_config, key", [("qwen3_5_moe_mini", "num_experts"),
                                                ("kimi_k3_mini", "num_experts"),
                                                ("gpt_oss_mini", "num_local_experts")])
def test_a_config_asking_for_a_million_experts_is_refused_before_a_table_is_built(
        tmp_path: Path, family_config: str, key: str) -> None:
    """(was: K3's per-expert table built for 10**6 experts, 35 s and then MemoryError)"""
    config = json.loads((ROOT / f"mkc/model/configs/{family_config}.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, key: 10 ** 6}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"experts = 1000000 is out of range") as e:
        load_checkpoint(tmp_path)
    assert "at most 16384 routed experts" in e.value.hint


def _first_shard_entry(root: Path) -> tuple[Path, dict, str, str]:
    index_path = root / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    name, file = next(iter(index["weight_map"].items()))
    return index_path, index, name, file


@pytest.mark.parametrize("how", ["dotdot", "absolute", "symlink_out", "symlink_system_file", "directory"])
def test_an_index_entry_cannot_read_outside_the_checkpoint(tmp_path: Path, config: dict, params: dict,
                                                           how: str) -> None:
    """`../x`, an absolute path, a symlink inside the directory to a file outside it (or to
    /etc/passwd), or a directory: refused, naming the index entry (tensor and path), before
    anything is opened (was: tensors loaded from outside, /etc/passwd parsed as a header)."""
    root = tmp_path / "ckpt"
    save_checkpoint(root, config, params, max_shard_bytes=1 << 20)
    index_path, index, name, file = _first_shard_entry(root)
    outside = tmp_path / "outside.safetensors"
    (root / file).rename(outside)
    given = file
    if how == "dotdot":
        given = "../outside.safetensors"
    elif how == "absolute":
        given = str(outside)
    elif how == "symlink_out":
        (root / file).symlink_to(outside)
    elif how == "symlink_system_file":
        (root / file).symlink_to("/etc/passwd")
    else:
        (root / file).mkdir()
    index["weight_map"] = {n: given if f == file else f for n, f in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    problem = "is not a regular file" if how == "directory" else "outside the checkpoint directory"
    with pytest.raises(CheckpointError, match=re.escape(f"model.safetensors.index.json entry {name!r} -> "
                                                        f"{given!r}") + ".*" + problem):
        load_checkpoint(root)


def test_config_and_single_file_symlinked_out_are_refused(tmp_path: Path, config: dict, params: dict) -> None:
    root = tmp_path / "ckpt"
    save_checkpoint(root, config, params)
    (root / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (root / "model.safetensors").symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(CheckpointError, match="'model.safetensors' resolves to .*outside the checkpoint"):
        load_checkpoint(root)
    (root / "config.json").rename(tmp_path / "config.json")
    (root / "config.json").symlink_to(tmp_path / "config.json")
    with pytest.raises(CheckpointError, match="'config.json' resolves to .*outside the checkpoint"):
        load_checkpoint(root)


def test_a_hugging_face_hub_snapshot_loads_through_its_blob_symlinks(tmp_path: Path, config: dict,
                                                                     params: dict) -> None:
    """The hub cache's layout (`snapshots/REV/FILE` -> `../../blobs/SHA`) stays loadable: its
    blobs are the checkpoint's own files."""
    save_checkpoint(tmp_path / "plain", config, params, max_shard_bytes=1 << 20)
    repo = tmp_path / "models--org--mini"
    snapshot, blobs = repo / "snapshots" / "abc123", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for i, f in enumerate(sorted((tmp_path / "plain").iterdir())):
        f.rename(blobs / f"sha{i}")
        (snapshot / f.name).symlink_to(Path("../../blobs") / f"sha{i}")
    _assert_same(load_checkpoint(snapshot)[1], params)


def test_a_checkpoint_missing_a_tensor_and_holding_one_transposed_is_refused_at_the_model_line(
        tmp_path: Path, config: dict, params: dict, capsys) -> None:
    """Its headers are checked against the family's weight table wherever a spec is checked
    (the library's check_spec and the editor's analysis too, not only the CLI's requantization
    pass): one diagnostic at the `model` line, a note per tensor with what was expected."""
    from mkc.compiler import check_source, check_spec
    from mkc.diagnostics import MkcError
    from mkc.lsp import analyse
    from tests_support import SPEC
    up, down = "model.layers.2.mlp.up_proj.weight", "model.layers.1.mlp.down_proj.weight"
    ckpt = tmp_path / "ckpt"
    save_checkpoint(ckpt, config, {**{n: v for n, v in params.items() if n != down},
                                   up: params[up].T.copy()}, max_shard_bytes=1 << 20)
    rows, cols = params[up].shape
    want = [f"missing 1 tensor(s): {down}", f"{up}: shape [{cols}, {rows}], expected [{rows}, {cols}]"]
    with pytest.raises(MkcError) as e:
        check_spec(SPEC, str(ckpt))
    [d] = e.value.diagnostics
    assert d.code == "E-CHECKPOINT" and "does not match its config" in d.message
    assert d.notes == want and (d.span.file, d.span.line) == (str(SPEC), _line_of(SPEC, "model"))
    text = SPEC.read_text().replace('model   "qwen3_8_27b"', f'model   "{ckpt}"')
    with pytest.raises(MkcError) as e:
        check_source(text, str(SPEC))
    assert e.value.diagnostics[0].notes == want
    [d] = analyse(text, str(SPEC)).diagnostics
    assert d.code == "E-CHECKPOINT" and d.notes == want
    d = _cli_diagnostic(["check", str(SPEC), "--model", str(ckpt)], capsys)
    assert d["notes"] == want and d["line"] == _line_of(SPEC, "model")


def _published_layout(params: dict[str, np.ndarray], experts: int) -> dict[str, np.ndarray]:
    """DeepSeek-V3's published layout of fused experts: per expert, gate_proj, up_proj and
    down_proj each a `weight` beside its `weight_scale_inv`."""
    out = {}
    for name, a in params.items():
        if ".mlp.experts." not in name:
            out[name] = a
            continue
        layer, _, stored = name.partition("mlp.experts.")
        kind = "weight_scale_inv" if stored.endswith("_scale_inv") else "weight"
        parts = ("gate_proj", "up_proj") if stored.startswith("gate_up") else ("down_proj",)
        for e in range(experts):
            for p, part in enumerate(np.split(a[e], len(parts), axis=0)):
                out[f"{layer}mlp.experts.{e}.{parts[p]}.{kind}"] = part
    return out


def test_an_fp8_checkpoint_loads_its_codes_and_block_scales_as_they_are(tmp_path: Path) -> None:
    """The MINI DeepSeek-V3 FP8 checkpoint (e4m3 codes, safetensors F8_E4M3, beside f32
    `weight_scale_inv`), stored per expert as the published one: loaded eagerly or lazily
    (whole, an expert, rows of a weight), every code byte and scale is the one written, the
    per-expert codes and scales fused; a NaN code is refused naming the tensor."""
    from mkc.families.deepseek_v3 import reference as dsv3
    from mkc.model import fp8_blocks
    config = json.loads((ROOT / "mkc/model/configs/deepseek_v3_mini_fp8.json").read_text())
    d = dsv3.load_config(config)
    params = dsv3.init_params(d, seed=0)
    save_checkpoint(tmp_path / "ckpt", config, _published_layout(params, d.experts), max_shard_bytes=1 << 20)
    _, eager = load_checkpoint(tmp_path / "ckpt")
    _, lazy = load_checkpoint(tmp_path / "ckpt", lazy=True)
    gate_up, q_a = "model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.self_attn.q_a_proj.weight"
    assert eager[gate_up].dtype == ml_dtypes.float8_e4m3fn and eager[gate_up].shape == (32, 512, 256)
    for name, a in params.items():
        assert eager[name].dtype == a.dtype and eager[name].tobytes() == a.tobytes(), name
    assert lazy[gate_up][5].view(np.uint8).tobytes() == params[gate_up][5].view(np.uint8).tobytes()
    assert (lazy[gate_up + "_scale_inv"][5] == params[gate_up + "_scale_inv"][5]).all()
    assert lazy[q_a][3:7].view(np.uint8).tobytes() == params[q_a][3:7].view(np.uint8).tobytes()
    view = fp8_blocks.Dequantized(lazy, d.weight_block_size)
    widened = fp8_blocks.widen(params[q_a], params[q_a + "_scale_inv"], (128, 128))
    assert (np.asarray(view[q_a]) == widened).all()
    assert view[gate_up] is lazy[gate_up]            # experts: codes as they are

    bad = dict(params)
    codes = params[gate_up].view(np.uint8).copy()
    codes[2, 3, 4] = 0x7F                            # e4m3's NaN
    bad[gate_up] = codes.view(ml_dtypes.float8_e4m3fn)
    save_checkpoint(tmp_path / "bad", config, _published_layout(bad, d.experts))
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.2\.gate_proj\.weight holds 1 non-finite "
                                              r"value\(s\), the first \(nan\) at index \[3, 4\]"):
        load_checkpoint(tmp_path / "bad")


def test_a_deepseek_v3_checkpoint_skips_its_mtp_layer_past_the_decoders_layers(tmp_path: Path) -> None:
    """DeepSeek-V3's published checkpoint holds its MTP layer as `model.layers.{N}.*`, N =
    num_hidden_layers (an MoE layer with per-expert tensors, plus its own embedding norms,
    projection and head): loading skips it and reads the decoder's tensors; a stray tensor of
    a decoder layer is still refused."""
    from mkc.families.deepseek_v3 import reference as dsv3
    config = json.loads((ROOT / "mkc/model/configs/deepseek_v3_mini.json").read_text())
    d = dsv3.load_config(config)
    params = dsv3.init_params(d, seed=0)
    last, mtp = f"model.layers.{d.num_hidden_layers - 1}.", f"model.layers.{d.num_hidden_layers}."
    extra = {mtp + n[len(last):]: a for n, a in params.items() if n.startswith(last)}
    norm = params["model.norm.weight"]
    extra |= {mtp + "enorm.weight": norm, mtp + "hnorm.weight": norm,
              mtp + "eh_proj.weight": np.zeros((d.hidden_size, 2 * d.hidden_size), ml_dtypes.bfloat16),
              mtp + "shared_head.head.weight": params["lm_head.weight"]}
    save_checkpoint(tmp_path / "ckpt", config, _published_layout(params | extra, d.experts))
    _, got = load_checkpoint(tmp_path / "ckpt")
    assert list(got) == list(params)
    for name, a in params.items():
        assert got[name].tobytes() == a.tobytes(), name

    stray = "model.layers.0.mlp.gate.weight"       # layer 0 is dense
    save_checkpoint(tmp_path / "stray", config, {**params, stray: params[last + "mlp.gate.weight"]})
    with pytest.raises(CheckpointError, match=rf"1 unexpected tensor\(s\): {stray}"):
        load_checkpoint(tmp_path / "stray")


@pytest.fixture(scope="module")
def fp8_mini() -> tuple[dict, dict]:
    """DeepSeek-V3's MINI FP8 checkpoint: (config, params with f32 `weight_scale_inv`s)."""
    from mkc.families.deepseek_v3 import reference as dsv3
    config = json.loads((ROOT / "mkc/model/configs/deepseek_v3_mini_fp8.json").read_text())
    return config, dsv3.init_params(dsv3.load_config(config), seed=0)


@pytest.mark.parametrize("value", [3e38, -1.0, 0.0, 1e-45])
def test_an_fp8_block_scale_outside_its_range_is_refused_naming_the_tensor(
        tmp_path: Path, fp8_mini: tuple, value: float, capsys) -> None:
    """A scale of 3e38 put 16,235 infinities into its dequantized weight; 0, -1 and a
    subnormal scale no block: each is refused where the scale is read (the eager and lazy
    loads, `mkc check --model DIR` at the `model` line), naming the tensor and the index
    (they loaded silently)."""
    from tests_support import ROOT as ROOT_
    config, params = fp8_mini
    name = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    bad = params[name].copy()
    bad[0, 1] = value
    save_checkpoint(tmp_path, config, {**params, name: bad})
    want = (rf"tensor {re.escape(name)} holds 1 block scale\(s\) outside 1.175e-38 to 7.566e\+35 "
            r".*at index \[0, 1\]")
    with pytest.raises(CheckpointError, match=want):
        load_checkpoint(tmp_path)
    _, lazy = load_checkpoint(tmp_path, lazy=True)
    with pytest.raises(CheckpointError, match=want):
        np.asarray(lazy[name])
    if value == 3e38:                        # one CLI run: the same check, located
        spec = ROOT_ / "schedules" / "deepseek_v3.sched"
        d = _cli_diagnostic(["check", str(spec), "--model", str(tmp_path)], capsys)
        assert d["code"] == "E-CHECKPOINT" and re.search(want, d["message"]), d
        assert (d["file"], d["line"]) == (str(spec), _line_of(spec, "model"))


def test_an_expert_block_scale_stored_per_expert_is_checked_too(tmp_path: Path, fp8_mini: tuple) -> None:
    config, params = fp8_mini
    fused = "model.layers.1.mlp.experts.down_proj_scale_inv"
    bad = params[fused].copy()
    bad[3, 0, 0] = 0.0
    save_checkpoint(tmp_path, config, _published_layout({**params, fused: bad}, bad.shape[0]))
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.3\.down_proj\.weight_scale_inv holds 1 "
                                              r"block scale\(s\) outside .* at index \[0, 0\]"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("dtype, code", [(np.float16, "F16"), (ml_dtypes.bfloat16, "BF16")])
def test_an_fp8_block_scale_must_be_stored_as_f32(tmp_path: Path, fp8_mini: tuple, dtype, code) -> None:
    """DeepSeek-V3's `weight_scale_inv` is F32; an F16 or BF16 one (another rounding of the
    scales) is refused from the header, as a wrong dtype (it loaded silently)."""
    config, params = fp8_mini
    name = "model.layers.0.self_attn.o_proj.weight_scale_inv"
    save_checkpoint(tmp_path, config, {**params, name: params[name].astype(dtype)})
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)}: dtype {code}, expected F32"):
        load_checkpoint(tmp_path, lazy=True)


@pytest.fixture(scope="module")
def nvfp4_mini() -> tuple[dict, dict]:
    """Muse Spark's MINI NVFP4 checkpoint: (config, params with e4m3 `_weight_scale`s and f32
    `_weight_scale_2`s)."""
    from mkc.families.muse_spark import reference as muse
    config = json.loads((ROOT / "mkc/model/configs/muse_spark_mini_nvfp4.json").read_text())
    return config, muse.init_params(muse.load_config(config), seed=0)


NVFP4_BLOCK_SCALE = "model.layers.1.mlp.experts.down_proj_weight_scale"
NVFP4_GLOBAL_SCALE = "model.layers.2.mlp.experts.gate_up_proj_weight_scale_2"


@pytest.mark.parametrize("name, value, want", [
    # an e4m3 block scale: a negative one flipped its block's signs, 0 zeroed it; NaN, and a
    # subnormal (2**-8), are no block's scale either
    *[(NVFP4_BLOCK_SCALE, v, r"1 e4m3 block scale\(s\) outside 0.01562 to 448 \(a positive normal "
       r"e4m3 value\), the first \(" + shown + r"\) at index \[4, 2, 3\]")
      for v, shown in ((-1.0, "-1"), (0.0, "0"), (-0.0, "-0"), (2.0 ** -8, "0.00390625"))],
    (NVFP4_BLOCK_SCALE, np.nan, r"1 non-finite value\(s\), the first \(nan\) at index \[4, 2, 3\]"),
    # the global scale: 3e38 served infinities, 1e30 squares past f32; 0, -1 and a subnormal
    *[(NVFP4_GLOBAL_SCALE, v, r"1 global scale\(s\) outside 1.175e-38 to 6.863e\+15 .*the first "
       r"\(" + shown + r"\) at index \[4\]")
      for v, shown in ((3e38, r"3e\+38"), (1e30, r"1e\+30"), (0.0, "0"), (-1.0, "-1"),
                       (1e-40, r"9.99995e-41"))],
])
def test_an_nvfp4_scale_outside_its_range_is_refused_naming_the_tensor(
        tmp_path: Path, nvfp4_mini: tuple, name: str, value: float, want: str) -> None:
    """Each loaded silently (a negative block scale sign-flipped its block; a global scale of
    3e38 made `mkc serve` answer from infinities): the eager and lazy loads refuse it, naming
    the file, the tensor and the index."""
    config, params = nvfp4_mini
    bad = params[name].astype(np.float32)
    bad[(4, 2, 3) if bad.ndim == 3 else (4,)] = value
    save_checkpoint(tmp_path, config, {**params, name: bad.astype(params[name].dtype)})
    want = rf"model\.safetensors: tensor {re.escape(name)} holds {want}"
    with pytest.raises(CheckpointError, match=want) as e:
        load_checkpoint(tmp_path)
    assert e.value.hint.startswith("a non-finite weight" if np.isnan(value) else "a scale outside its range")
    _, lazy = load_checkpoint(tmp_path, lazy=True)
    with pytest.raises(CheckpointError, match=want):
        np.asarray(lazy[name])


def test_an_nvfp4_scale_outside_its_range_is_refused_at_the_model_line(
        tmp_path: Path, nvfp4_mini: tuple, capsys) -> None:
    """`mkc check --model DIR` reads every value: the refusal at the spec's `model` line."""
    config, params = nvfp4_mini
    bad = params[NVFP4_GLOBAL_SCALE].copy()
    bad[1] = -1.0
    save_checkpoint(tmp_path, config, {**params, NVFP4_GLOBAL_SCALE: bad})
    spec = ROOT / "schedules" / "muse_spark.sched"
    d = _cli_diagnostic(["check", str(spec), "--model", str(tmp_path)], capsys)
    assert d["code"] == "E-CHECKPOINT", d
    assert re.search(rf"tensor {re.escape(NVFP4_GLOBAL_SCALE)} holds 1 global scale\(s\) outside .*"
                     r"the first \(-1\) at index \[1\]", d["message"]), d
    assert (d["file"], d["line"]) == (str(spec), _line_of(spec, "model"))


@pytest.mark.parametrize("scale", [253, 254])
def test_an_e8m0_scale_that_overflows_its_block_is_refused(tmp_path: Path, scale: int) -> None:
    """GPT-OSS's MXFP4 experts: an E8M0 scale of 253 or 254 puts e2m1's 6 past bf16's range
    (255, NaN, was refused already)."""
    from mkc.families.gpt_oss import reference as gpt
    config = json.loads((ROOT / "mkc/model/configs/gpt_oss_mini.json").read_text())
    params = gpt.init_params(gpt.load_config(config), seed=0)
    name = next(n for n in params if n.endswith("_scales"))
    bad = params[name].copy()
    bad.reshape(-1)[5] = scale
    save_checkpoint(tmp_path, config, {**params, name: bad})
    index = list(np.unravel_index(5, bad.shape))
    with pytest.raises(CheckpointError, match=rf"{re.escape(name)} holds 1 E8M0 scale\(s\) above 252 "
                                              rf".* at index \[{', '.join(map(str, index))}\]"):
        load_checkpoint(tmp_path)
