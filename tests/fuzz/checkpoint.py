"""Hostile MINI checkpoint directories: the fuzz campaign's `checkpoint` target (`fuzz`).

Each generator in `GENERATORS` takes (rng, dir), writes into `dir` a MINI checkpoint made
hostile in one way, and returns a short description starting with the MINI config's name
(`"qwen3_5_moe_mini: ..."`); it is a pure function of the rng's state (the base weights are
each MINI reference's `init_params(seed=0)`). A generator may also write next to `dir` (a file
an index or symlink points out of the checkpoint to), never elsewhere. `spec_text(description)`
is the spec to check the directory with and `check(description, dir)` runs what `mkc check
SPEC --model DIR` runs: on every generator's output it must raise MkcError and nothing else.
"""
from __future__ import annotations

import functools
import json
import math
import random
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]

# MINI config -> the shipped spec its checkpoints are checked with (K3's moved to 2 hosts).
SPECS = {"qwen3_8_mini": "qwen3_8_27b", "qwen3_5_moe_mini": "qwen3_5_35b_a3b",
         "kimi_k3_mini": "kimi_k3", "deepseek_v3_mini_fp8": "deepseek_v3"}
INDEX = "model.safetensors.index.json"


@functools.cache
def _config(mini: str) -> dict:
    return json.loads((ROOT / "mkc" / "model" / "configs" / f"{mini}.json").read_text())


@functools.cache
def _params(mini: str) -> dict[str, np.ndarray]:
    from mkc.checkpoint import family_of
    reference = family_of(_config(mini)).module("reference")
    return reference.init_params(reference.load_config(_config(mini)), seed=0)


def _write(rng: random.Random, dir: Path, mini: str, params: dict[str, np.ndarray] | None = None,
           sharded: bool | None = None) -> None:
    """The MINI checkpoint (with `params` replacing some tensors), in one file or in shards
    with an index, as the rng picks unless `sharded` says."""
    from mkc.checkpoint import save_checkpoint
    sharded = rng.random() < 0.5 if sharded is None else sharded
    save_checkpoint(dir, _config(mini), _params(mini) | (params or {}),
                    max_shard_bytes=(4 << 20) if sharded else None)


def _mini(rng: random.Random, choices: tuple[str, ...] = ("qwen3_8_mini", "qwen3_5_moe_mini",
                                                           "kimi_k3_mini")) -> str:
    return rng.choice(choices)


def _index_entry(rng: random.Random, dir: Path) -> tuple[dict, str, str]:
    index = json.loads((dir / INDEX).read_text())
    name = rng.choice(sorted(index["weight_map"]))
    return index, name, index["weight_map"][name]


def _outside(dir: Path) -> Path:
    """A real safetensors file next to the checkpoint (what an escaping path reaches)."""
    return dir.parent / f"{dir.name}.outside.safetensors"


def non_finite_weight(rng: random.Random, dir: Path) -> str:
    """A NaN or infinity in one float tensor (an expert's or any other) at a random index."""
    mini = _mini(rng)
    floats = sorted(n for n, a in _params(mini).items() if a.dtype != np.uint8)
    if mini != "qwen3_8_mini" and rng.random() < 0.5:     # often a tensor requantization reads
        floats = [n for n in floats if ".experts." in n] or floats
    name = rng.choice(floats)
    a = _params(mini)[name].copy()
    index = tuple(rng.randrange(n) for n in a.shape)
    value = rng.choice([math.nan, math.inf, -math.inf])
    a[index] = value
    _write(rng, dir, mini, {name: a})
    return f"{mini}: {value} at {name}{list(index)}"


def nan_e8m0_scale(rng: random.Random, dir: Path) -> str:
    """An MXFP4 scale of 255 (E8M0's NaN), or one under which e2m1's largest value overflows
    (253, 254), in one of K3's expert scale tensors."""
    mini = "kimi_k3_mini"
    name = rng.choice(sorted(n for n in _params(mini) if n.endswith(".weight_scale")))
    a = _params(mini)[name].copy()
    index = tuple(rng.randrange(n) for n in a.shape)
    a[index] = value = rng.choice([253, 254, 255])
    _write(rng, dir, mini, {name: a})
    return f"{mini}: E8M0 scale {value} at {name}{list(index)}"


def bad_block_scale(rng: random.Random, dir: Path) -> str:
    """DeepSeek-V3's FP8 checkpoint with one `weight_scale_inv` out of its format: a value
    that is no f32 normal or makes the largest code infinite, or the tensor stored as F16 or
    BF16 instead of F32."""
    import ml_dtypes
    mini = "deepseek_v3_mini_fp8"
    name = rng.choice(sorted(n for n in _params(mini) if n.endswith("_scale_inv")))
    a = _params(mini)[name].copy()
    if rng.random() < 0.25:
        dtype = rng.choice([np.float16, ml_dtypes.bfloat16])
        _write(rng, dir, mini, {name: a.astype(dtype)})
        return f"{mini}: {name} stored as {np.dtype(dtype).name}"
    index = tuple(rng.randrange(n) for n in a.shape)
    a[index] = value = rng.choice([3e38, 1e36, -1.0, 0.0, -0.0, 1e-45, 1e-39, math.nan, math.inf])
    _write(rng, dir, mini, {name: a})
    return f"{mini}: block scale {value} at {name}{list(index)}"


def bad_config_value(rng: random.Random, dir: Path) -> str:
    """config.json with a value no model has: layers by the billion, a zero divisor (DeepSeek-V3's
    expert groups, a KV head count), a YaRN base of 1, an eos_token_id past the vocabulary, or
    an expert count under both of transformers' names, disagreeing."""
    mini = _mini(rng, ("qwen3_8_mini", "qwen3_5_moe_mini", "deepseek_v3_mini_fp8"))
    _write(rng, dir, mini)
    config = _config(mini)
    changes = [{"num_hidden_layers": rng.choice([10 ** 9, 2 ** 63, 0, -1])},
               {"eos_token_id": rng.choice([config["vocab_size"], -1, [1, 10 ** 9], "</s>"])},
               {"num_key_value_heads": 0}]
    if mini == "deepseek_v3_mini_fp8":
        changes += [{"n_group": 0}, {"topk_group": 0}, {"n_group": -4},
                    {"num_local_experts": config["n_routed_experts"] + 1}, {"rope_theta": 1}]
    change = rng.choice(changes)
    (dir / "config.json").write_text(json.dumps(config | change))
    return f"{mini}: config {json.dumps(change)[:80]}"


def oversized_json(rng: random.Random, dir: Path) -> str:
    """config.json or the index grown (sparse: nothing written) past what mkc reads of it."""
    from mkc.checkpoint import MAX_INDEX_BYTES
    from mkc.model.config import MAX_CONFIG_BYTES
    mini = _mini(rng)
    _write(rng, dir, mini, sharded=True)
    file, cap = rng.choice([("config.json", MAX_CONFIG_BYTES), (INDEX, MAX_INDEX_BYTES)])
    size = rng.choice([cap + 1, 2 << 30, 1 << 40])
    with (dir / file).open("r+b") as f:
        f.truncate(size)
    return f"{mini}: {file} of {size} bytes (sparse)"


def bad_header_length(rng: random.Random, dir: Path) -> str:
    """A safetensors file whose first 8 bytes (the header's length) are past the cap or the
    file, or a file shorter than those 8 bytes."""
    from mkc.checkpoint import MAX_HEADER_BYTES
    mini = _mini(rng)
    _write(rng, dir, mini)
    file = rng.choice(sorted(dir.glob("*.safetensors")))
    data = bytearray(file.read_bytes())
    length = rng.choice([MAX_HEADER_BYTES + 1, len(data), 2 ** 64 - 1, None])
    if length is None:
        data = data[:rng.randrange(8)]
    else:
        data[:8] = length.to_bytes(8, "little")
    file.write_bytes(bytes(data))
    return f"{mini}: {file.name} with header length {length if length is not None else 'cut short'}"


def escaping_index_path(rng: random.Random, dir: Path) -> str:
    """An index entry naming a file outside the checkpoint (`..`, absolute) or not a file."""
    mini = _mini(rng)
    _write(rng, dir, mini, sharded=True)
    index, name, file = _index_entry(rng, dir)
    (dir / file).rename(_outside(dir))
    given = rng.choice([f"../{_outside(dir).name}", str(_outside(dir)), f"x/../../{_outside(dir).name}",
                        "/etc/passwd", "/dev/zero", ".", "", "a\0b", 7, None])
    index["weight_map"] = {n: given if f == file else f for n, f in index["weight_map"].items()}
    (dir / INDEX).write_text(json.dumps(index))
    return f"{mini}: {INDEX} entry {name!r} -> {given!r}"


def escaping_symlink(rng: random.Random, dir: Path) -> str:
    """A checkpoint file replaced by a symlink out of the checkpoint (a system file, a device,
    a file next to it), a loop, or a dangling link."""
    mini = _mini(rng)
    _write(rng, dir, mini)
    file = rng.choice(sorted(p.name for p in dir.iterdir()))
    (dir / file).rename(_outside(dir))
    target = rng.choice(["/etc/passwd", "/dev/zero", "/proc/self/mem", str(_outside(dir)),
                         f"../{_outside(dir).name}", file, "missing.safetensors"])
    (dir / file).symlink_to(target)
    return f"{mini}: {file} -> {target}"


def huge_dims(rng: random.Random, dir: Path) -> str:
    """config.json asking for far more experts (or layers of them) than any model has."""
    mini = _mini(rng, ("qwen3_5_moe_mini", "kimi_k3_mini"))
    _write(rng, dir, mini)
    config = _config(mini) | {"num_experts": rng.choice([10 ** 6, 1 << 15, 2 ** 63, 10 ** 30])}
    (dir / "config.json").write_text(json.dumps(config))
    return f"{mini}: num_experts {config['num_experts']}"


GENERATORS: dict[str, Callable[[random.Random, Path], str]] = {
    f.__name__: f for f in (non_finite_weight, nan_e8m0_scale, bad_block_scale, bad_config_value,
                            oversized_json, bad_header_length, escaping_index_path, escaping_symlink,
                            huge_dims)}


def spec_text(description: str) -> str:
    """The spec to check a generated checkpoint with (its description names the MINI config)."""
    mini = description.split(":", 1)[0]
    text = (ROOT / "schedules" / f"{SPECS[mini]}.sched").read_text()
    if mini == "kimi_k3_mini":
        sys.path.insert(0, str(ROOT / "examples"))
        from generated_module import k3_mini_text
        text = k3_mini_text(text)
    return text


def check(description: str, dir: Path) -> None:
    """What `mkc check SPEC --model DIR` runs (MkcError for a diagnostic): the spec checked
    against the directory's config, then the checkpoint itself (`mkc.requantize.report`)."""
    from mkc.compiler import check_source
    from mkc.requantize import report
    spec = ROOT / "schedules" / f"{SPECS[description.split(':', 1)[0]]}.sched"
    c = check_source(spec_text(description), str(spec), str(dir))
    report(c.ir, c.schedule)


# ---- the campaign's `checkpoint` target ------------------------------------------------------

def kinds() -> dict:
    """The generators, each `(rng, dir) -> description`, as kinds: the case checks `--model ckpt`,
    a directory the generator fills when the case is written (`Case.materialize`), with the
    spec of the MINI config it picked (`spec_text(description)`, which also sets the case's
    base)."""
    def kind(name):
        def make(rng, b, case):
            case.files.append(("checkpoint", "ckpt", name))
            case.model = "ckpt"
            case.desc = f"checkpoint from fuzz.checkpoint.{name} (the MINI config it picks sets the spec)"
            return b.spec
        return make
    return {name: (kind(name), 1) for name in GENERATORS}


def run(case, d: Path, res: dict) -> dict:
    """`mkc check spec.sched --model ckpt` on a hostile checkpoint (a generator
    here writes it): the check and the requantization report `mkc check` prints."""
    from mkc import compiler
    from mkc.requantize import report
    res["stage"] = "write checkpoint"
    spec = case.materialize(d)
    res["base"] = case.base
    res["stage"] = "check"
    c = compiler.check_spec(spec, case.model)
    res["stage"] = "requantization"
    report(c.ir, c.schedule)
    return {"cls": "ok"}
