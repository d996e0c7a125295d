"""Rotary position embedding, rotate-half form (pairs `(i, i + R/2)` of a head's first R dims):
its config reading, the host's table the kernel reads, and the inverse frequencies.

Scalings (transformers' `modeling_rope_utils.py`): "default" (`theta^(-2i/R)`) and "llama3"
(`_compute_llama3_parameters`: frequencies whose wavelength exceeds `original_max_position_embeddings /
low_freq_factor` divided by `factor`, those under `.. / high_freq_factor` kept, the band between
blended by `smooth = (original / wavelength - low) / (high - low)`); neither scales cos and
sin (attention factor 1). The dims a model gives: head_dim, rotary_dim, rope_theta and
`rope_type`, `rope_factor`, `rope_low_freq_factor`, `rope_high_freq_factor`,
`rope_original_max_position` (absent: "default"; 1 for a scaling that has no such setting).
"yarn" (`_compute_yarn_parameters`, `read_yarn`): the original frequencies below rotary pair
index `yarn_low`, those divided by `yarn_factor` above `yarn_high`, a linear ramp between;
cos and sin times `yarn_attention_factor` (dims fields of those names, whole heads rotated).

The table is computed on the host per step in f32 (`host_inputs`), as JAX computes it under
`jit`; a reference emulating the kernel calls the same function.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from mkc import ir
from mkc.model.family import ConfigError, config_float, config_int

ROPE_TYPES = ("default", "llama3")


def rope_parameters(raw: Mapping) -> Mapping:
    """The config's rope parameters (`rope_parameters` in transformers 5 configs, `rope_scaling`
    before), {} when it has none."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise ConfigError(f"rope_parameters must be an object, not {params!r}",
                          "write rope_parameters as upstream configs do, e.g. {\"rope_type\": \"default\"}")
    return params


def read_rope(raw: Mapping, head_dim: int, theta_default: float, types: tuple[str, ...] = ROPE_TYPES
              ) -> dict[str, Any]:
    """The rope fields of a model's dims from its config, whole heads rotated; ConfigError for a
    rope type not in `types` or an incomplete llama3 scaling."""
    params = rope_parameters(raw)
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in types:
        raise ConfigError(f"rope_type = {rope_type!r} is not supported",
                          f"this family computes rope_type {' or '.join(map(repr, types))}")
    theta = params.get("rope_theta", raw.get("rope_theta", theta_default))
    fields: dict[str, Any] = dict(rotary_dim=head_dim, rope_theta=config_float(theta, "rope_theta"),
                                  rope_type=rope_type, rope_factor=1.0, rope_low_freq_factor=1.0,
                                  rope_high_freq_factor=1.0, rope_original_max_position=1)
    if rope_type == "llama3":
        missing = [k for k in ("factor", "low_freq_factor", "high_freq_factor",
                               "original_max_position_embeddings") if params.get(k) is None]
        if missing:
            raise ConfigError(f"the llama3 rope scaling lacks {', '.join(missing)}",
                              "give factor, low_freq_factor, high_freq_factor and "
                              "original_max_position_embeddings, as Llama 3.1 configs do")
        fields |= dict(rope_factor=config_float(params["factor"], "factor"),
                       rope_low_freq_factor=config_float(params["low_freq_factor"], "low_freq_factor"),
                       rope_high_freq_factor=config_float(params["high_freq_factor"], "high_freq_factor"),
                       rope_original_max_position=config_int(params["original_max_position_embeddings"],
                                                             "original_max_position_embeddings"))
        if not fields["rope_high_freq_factor"] > fields["rope_low_freq_factor"] > 0:
            raise ConfigError("the llama3 rope scaling needs high_freq_factor > low_freq_factor > 0",
                              "Llama 3.1 uses low_freq_factor 1 and high_freq_factor 4")
    return fields


def read_yarn(raw: Mapping, params: Mapping, head_dim: int, theta_default: float,
              max_positions_default: int) -> dict[str, float]:
    """rope_theta and the YaRN fields (`yarn_factor`, `yarn_low`, `yarn_high`,
    `yarn_attention_factor`) of a model's dims, as upstream's `_compute_yarn_parameters`
    derives them from the config's rope parameters `params` over `head_dim` rotated dims, and
    `yarn_mscale`: `yarn_get_mscale(factor, mscale_all_dim)` where the parameters give
    `mscale_all_dim` (MLA's softmax scale takes it twice: `yarn_apply_mscale`), else 1.
    ConfigError without `original_max_position_embeddings` or with a partial rotary factor."""
    def number(key: str, default: float | None = None) -> float | None:
        value = params.get(key)
        return default if value is None else config_float(value, f"rope_scaling.{key}")

    if number("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError("partial_rotary_factor must be 1: the rotary dims are rotated whole",
                          "leave partial_rotary_factor out")
    original = number("original_max_position_embeddings")
    if original is None:
        raise ConfigError("the yarn rope scaling has no original_max_position_embeddings",
                          "give the pre-extension context, as the published configs do")
    def setting(key: str, default: float) -> float:
        """A config number, or `default` where it is absent (or null)."""
        return config_float(default if raw.get(key) is None else raw[key], key)

    theta = number("rope_theta") or setting("rope_theta", theta_default)
    if not theta > 1:                  # YaRN's correction dims divide by log(theta)
        raise ConfigError(f"rope_theta = {theta} is out of range for YaRN",
                          "a rope base above 1, as upstream's (150000 for GPT-OSS, 10000 for DeepSeek-V3)")
    factor = number("factor")       # upstream's fallback: the context's extension ratio
    if factor is None:
        factor = setting("max_position_embeddings", max_positions_default) / original
    attention = number("attention_factor")
    mscale, mscale_all = number("mscale"), number("mscale_all_dim")
    if attention is None:
        attention = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                     else yarn_mscale(factor, 1.0))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low = correction_dim(number("beta_fast") or 32.0)
    high = correction_dim(number("beta_slow") or 1.0)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    return dict(rope_theta=theta, yarn_factor=factor, yarn_low=float(max(low, 0)),
                yarn_high=float(min(high, head_dim - 1)), yarn_attention_factor=float(attention),
                yarn_mscale=yarn_mscale(factor, mscale_all) if mscale_all else 1.0)


def yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's `0.1 * mscale * log(factor) + 1` (1 for a factor of at most 1)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _scaled(freq, dims: Any, xp):
    """The frequencies `freq` [rotary_dim / 2] (`xp`: numpy in f64, or jax.numpy in f32) under
    the dims' scaling: as they are ("default"), llama3's bands or YaRN's ramp (module
    docstring)."""
    rope_type = getattr(dims, "rope_type", "default")
    if rope_type == "yarn":
        high = dims.yarn_high + (0.001 if dims.yarn_high == dims.yarn_low else 0.0)   # upstream's guard
        ramp = xp.clip((xp.arange(freq.shape[0], dtype=freq.dtype) - dims.yarn_low) / (high - dims.yarn_low),
                       0, 1)
        return freq / dims.yarn_factor * ramp + freq * (1 - ramp)
    if rope_type != "llama3":
        return freq
    factor, low, high = dims.rope_factor, dims.rope_low_freq_factor, dims.rope_high_freq_factor
    original = dims.rope_original_max_position
    wavelength = 2 * math.pi / freq
    scaled = xp.where(wavelength > original / low, freq / factor, freq)
    smooth = (original / wavelength - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelength >= original / high) & (wavelength <= original / low)
    return xp.where(medium, blended, scaled)


def frequencies(dims: Any):
    """The rotary frequencies [rotary_dim / 2] in f64 (`modeling_rope_utils.py`: `theta^(-2i/R)`
    under the dims' scaling), for the caller to round once: the references' oracles, and the
    YaRN table (`yarn_inv_freq`)."""
    import numpy as np
    rd = dims.rotary_dim
    return _scaled(dims.rope_theta ** (-np.arange(0, rd, 2, dtype=np.float64) / rd), dims, np)


def yarn_inv_freq(dims: Any):
    """The YaRN frequencies [head_dim / 2] f32 (`read_yarn`'s fields; whole heads rotated),
    computed in f64 and rounded once."""
    import numpy as np
    return frequencies(dims).astype(np.float32)


def rope_input(dims: Any, batch: int) -> list[ir.Buffer]:
    """The module passes the rotary table [2, B, head_dim] f32 in VMEM (`Family.vmem_inputs`)."""
    return [ir.Buffer("rope", "input", (2, batch, dims.head_dim), "f32", batch_axis=1)]


def inv_freq(dims: Any):
    """The rotary frequencies [rotary_dim / 2] f32, computed in f32 as transformers does
    (default or llama3: the host's table)."""
    import jax.numpy as jnp
    rd = dims.rotary_dim
    return _scaled(1.0 / (dims.rope_theta ** (jnp.arange(0, rd, 2, dtype=jnp.float32) / rd)), dims, jnp)


def rope_table(dims: Any, positions):
    """The `rope` VMEM input: cos/sin rows [2, B, head_dim] for each row's position, 1 and 0
    past the rotary dims (YaRN: whole heads, times its attention factor)."""
    import jax.numpy as jnp
    F32 = jnp.float32
    if getattr(dims, "rope_type", "default") == "yarn":
        ang = positions.astype(F32)[:, None] * jnp.asarray(yarn_inv_freq(dims))[None, :]
        ang = jnp.concatenate([ang, ang], axis=-1)
        return jnp.stack([jnp.cos(ang), jnp.sin(ang)]) * dims.yarn_attention_factor
    hd, rd = dims.head_dim, dims.rotary_dim
    ang = positions.astype(F32)[:, None] * inv_freq(dims)[None, :]
    ang = jnp.concatenate([ang, ang], axis=-1)
    pad = hd - rd
    cos = jnp.concatenate([jnp.cos(ang), jnp.ones((positions.shape[0], pad), F32)], axis=-1)
    sin = jnp.concatenate([jnp.sin(ang), jnp.zeros((positions.shape[0], pad), F32)], axis=-1)
    return jnp.stack([cos, sin])


def host_inputs(dims: Any, positions) -> dict[str, Any]:
    """The VMEM inputs the host computes per step (`rope_input` declares their shapes)."""
    return {"rope": rope_table(dims, positions)}
