"""Read a Hugging Face style config.json (upstream key names) into the dimensions mkc needs."""
from __future__ import annotations

import dataclasses
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mkc.diagnostics import Span, fail

if TYPE_CHECKING:
    from mkc.model.kimi_k3_graph import KimiDims

CONFIG_DIR = Path(__file__).with_name("configs")

# Upstream layer_types values -> mkc layer kinds (the phase names a schedule uses).
_QWEN35_KINDS = {"linear_attention": "gdn", "full_attention": "gqa"}
SUPPORTED_FAMILIES = ("qwen3_5_text", "kimi_k3")
MAX_CONFIG_BYTES = 4 << 20
MAX_LAYERS = 1024
MAX_DIM = 1 << 24          # far above any real width, head or expert count; keeps loops bounded
_ANY_SIGN = ("gate_lower_bound",)


@dataclass(frozen=True)
class ModelDims:
    """Dimensions of one decoder family instance; names follow the upstream config keys."""

    family: str
    name: str
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int
    intermediate_size: int
    rms_norm_eps: float
    layer_kinds: tuple[str, ...]
    # gated GQA
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_theta: float
    # gated delta net
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    @property
    def linear_conv_dim(self) -> int:
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)


def resolve_config_path(model: str, relative_to: Path | None = None) -> Path:
    """A shipped config name (e.g. "qwen3_8_27b") or a path to a config.json / checkpoint dir."""
    shipped = CONFIG_DIR / f"{model}.json"
    if _probe(shipped.exists):
        return shipped
    p = Path(model)
    if not p.is_absolute() and relative_to is not None:
        p = relative_to / p
    return p / "config.json" if _probe(p.is_dir) else p


def _probe(test) -> bool:
    """A path test that is False, not an error, for names the OS refuses (too long, NUL)."""
    try:
        return test()
    except (OSError, ValueError):
        return False


def shipped_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a model dimension can take")


def read_config(path: Path, where: Span) -> dict:
    """The config's JSON object: a regular file of bounded size, strict JSON (no NaN)."""
    p = Path(path)
    if not _probe(p.exists):
        raise fail("E-MODEL", f"model config not found: {path}", where,
                   hint=f"use a shipped config ({', '.join(shipped_configs())}) or a path to a "
                        "config.json or a checkpoint directory")
    if not p.is_file():
        raise fail("E-MODEL", f"model config {path} is not a regular file", where,
                   hint="point `model` at a config.json or a checkpoint directory holding one")
    try:
        with p.open("rb") as f:
            data = f.read(MAX_CONFIG_BYTES + 1)
        if len(data) > MAX_CONFIG_BYTES:
            raise ValueError(f"it is larger than {MAX_CONFIG_BYTES >> 20} MiB")
        raw = json.loads(data.decode("utf-8"), parse_constant=_reject_constant)
    except OSError as e:
        raise fail("E-MODEL", f"cannot read model config {path}: {e.strerror}", where,
                   hint="check the path and its permissions") from None
    except (ValueError, RecursionError) as e:    # JSON, UTF-8 and size errors are ValueErrors
        raise fail("E-MODEL", f"cannot read model config {path}: {e}", where,
                   hint="the file must be a Hugging Face style config.json") from None
    if not isinstance(raw, dict):
        raise fail("E-MODEL", f"model config {path} is not a JSON object", where,
                   hint="the file must be a Hugging Face style config.json")
    return raw


def load_dims(path: Path, span: Span | None = None) -> "ModelDims | KimiDims":
    """Parse config.json; errors point at the spec's `model` line when a span is given."""
    where = span or Span.unknown(str(path))
    return dims_from_config(read_config(path, where), path, where)


def dims_from_config(raw: dict, path: Path, where: Span) -> "ModelDims | KimiDims":
    family = raw.get("model_type")
    if family not in SUPPORTED_FAMILIES:
        raise fail("E-MODEL", f"model family {family!r} is not supported", where,
                   hint=f"supported families: {', '.join(SUPPORTED_FAMILIES)}")
    layers = raw.get("num_hidden_layers")
    if not (type(layers) is int and 1 <= layers <= MAX_LAYERS):
        raise fail("E-MODEL", f"model config {path}: num_hidden_layers is {layers!r}", where,
                   hint=f"a whole number of layers from 1 to {MAX_LAYERS}")
    stem = Path(path).stem if Path(path).name != "config.json" else Path(path).parent.name
    if family == "kimi_k3":
        return _checked(_load_kimi(raw, path, stem, where), path, where)
    return _checked(_load_qwen(raw, path, family, stem, where), path, where)


def _checked(dims, path: Path, where: Span):
    """Every dimension a whole number in range and every constant finite and positive (the
    K3 gate's lower bound is a log-space floor, so any finite value): a bad value must not
    reach the generated module (`EPS = nan`) or a loop bound."""
    for f in dataclasses.fields(dims):
        v = getattr(dims, f.name)
        if f.name in ("family", "name", "layer_kinds"):
            continue
        if isinstance(v, int) and not 1 <= v <= MAX_DIM:
            bad = f"{f.name} = {v}", f"a whole number from 1 to {MAX_DIM}"
        elif isinstance(v, float) and not (math.isfinite(v) and (v > 0 or f.name in _ANY_SIGN)):
            bad = f"{f.name} = {v}", "a finite positive number"
        else:
            continue
        raise fail("E-MODEL", f"model config {path}: {bad[0]} is out of range", where,
                   hint=f"{f.name} must be {bad[1]}")
    if getattr(dims, "top_k", 0) > getattr(dims, "experts", 0):
        raise fail("E-MODEL", f"model config {path}: top-k {dims.top_k} exceeds the "
                   f"{dims.experts} experts", where, hint="num_experts_per_token <= num_experts")
    return dims


def _load_qwen(raw: dict, path: Path, family: str, stem: str, where: Span) -> ModelDims:
    try:
        n_layers = int(raw["num_hidden_layers"])
        if "layer_types" in raw:
            types = list(raw["layer_types"])
        else:
            interval = int(raw.get("full_attention_interval", 4))
            types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                     for i in range(n_layers)]
        if len(types) != n_layers or any(t not in _QWEN35_KINDS for t in types):
            raise ValueError(f"layer_types must list {n_layers} entries of "
                             f"{sorted(_QWEN35_KINDS)}")
        rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(rope, dict):
            raise ValueError(f"rope_parameters must be an object, not {rope!r}")
        head_dim = int(raw["head_dim"])
        # Fallbacks are the upstream Qwen3_5TextConfig defaults.
        factor = float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25)))
        theta = float(rope.get("rope_theta", raw.get("rope_theta", 10_000_000.0)))
        return ModelDims(
            # The name reaches file names and generated source: keep it to identifier chars.
            family=family, name=re.sub(r"[^A-Za-z0-9_]", "_", stem) or "model",
            hidden_size=int(raw["hidden_size"]), num_hidden_layers=n_layers,
            vocab_size=int(raw["vocab_size"]), intermediate_size=int(raw["intermediate_size"]),
            rms_norm_eps=float(raw["rms_norm_eps"]),
            layer_kinds=tuple(_QWEN35_KINDS[t] for t in types),
            num_attention_heads=int(raw["num_attention_heads"]),
            num_key_value_heads=int(raw["num_key_value_heads"]), head_dim=head_dim,
            rotary_dim=int(head_dim * factor), rope_theta=theta,
            linear_num_key_heads=int(raw["linear_num_key_heads"]),
            linear_num_value_heads=int(raw["linear_num_value_heads"]),
            linear_key_head_dim=int(raw["linear_key_head_dim"]),
            linear_value_head_dim=int(raw["linear_value_head_dim"]),
            linear_conv_kernel_dim=int(raw["linear_conv_kernel_dim"]),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise _config_error(e, path, family, where) from None


def _config_error(e: Exception, path: Path, family: str, where: Span) -> Exception:
    if isinstance(e, KeyError):
        return fail("E-MODEL", f"model config {path} lacks key {e}", where,
                    hint=f"the config must use the upstream {family} key names")
    return fail("E-MODEL", f"model config {path} is malformed: {e}", where,
                hint="compare with a shipped config in mkc/model/configs")


def _load_kimi(raw: dict, path: Path, stem: str, where: Span) -> "KimiDims":
    from mkc.model.kimi_k3_graph import KimiDims
    try:
        dims = KimiDims.from_config(raw, stem)
    except (KeyError, TypeError, ValueError, OverflowError) as e:
        raise _config_error(e, path, "kimi_k3", where) from None
    if dims.num_hidden_layers < 2 or dims.layer_kinds[1] != "dense" or "dense" in dims.layer_kinds[2:]:
        raise fail("E-MODEL", f"model config {path}: mkc lowers K3 with exactly one dense layer "
                   "(first_k_dense_replace = 1) before the MoE layers", where,
                   hint="set first_k_dense_replace to 1")
    listed = raw["linear_attn_config"]["full_attn_layers"]
    if not all(type(i) is int and 1 <= i <= dims.num_hidden_layers for i in listed):
        raise fail("E-MODEL", f"model config {path}: full_attn_layers must list 1-based layer "
                   f"numbers from 1 to {dims.num_hidden_layers}", where,
                   hint="as upstream Kimi configs do, e.g. [4, 8, ...]")
    missing = [k for k in ("kda", "mla") if k not in dims.layer_kinds]
    if missing:
        raise fail("E-MODEL", f"model config {path} has no {missing[0]} layer; the K3 lowering "
                   "runs both KDA and MLA layers", where,
                   hint="list some but not all layers in linear_attn_config.full_attn_layers")
    return dims
