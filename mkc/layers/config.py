"""Config reading the composed families share: upstream defaults for omitted keys, the
settings a family refuses, the attention heads a GQA kind reads, and a per-layer
`layer_types` list."""
from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from typing import Any

from mkc.model.family import ConfigError, config_int


def setting(raw: Mapping, key: str, defaults: Mapping[str, Any]) -> Any:
    """A config value, or the upstream default for a key the config omits or sets to null."""
    value = raw.get(key)
    return defaults[key] if value is None else value


def with_aliases(raw: Mapping, aliases: Mapping[str, str]) -> Mapping:
    """The config with each value transformers' config class also takes under another name
    (its `attribute_map`; `save_pretrained` writes the attribute's name, so Qwen3-MoE's expert
    count arrives as `num_local_experts`) under the name mkc reads: `aliases` maps the other
    name to it. ConfigError where a config gives both names different values."""
    out = dict(raw)
    for alias, key in aliases.items():
        if raw.get(alias) is None:
            continue
        if raw.get(key) is not None and raw[key] != raw[alias]:
            raise ConfigError(f"{alias} = {json.dumps(raw[alias])} and {key} = {json.dumps(raw[key])} "
                              "disagree", f"they name one setting (transformers reads {alias} as "
                              f"{key}): keep one")
        out[key] = raw[alias]
    return out


def refuse(raw: Mapping, refused: Mapping[str, tuple[Any, str]], defaults: Mapping[str, Any]) -> None:
    """ConfigError for a setting nothing computes: key -> (the value computed, hint)."""
    for key, (wanted, hint) in refused.items():
        if setting(raw, key, defaults) != wanted:
            raise ConfigError(f"{key} = {json.dumps(raw.get(key))} is not supported", hint)


def attention_heads(raw: Mapping, hidden_size: int, heads: int, kv_heads: int) -> dict[str, int]:
    """`num_attention_heads`, `num_key_value_heads` and `head_dim` (hidden / heads unless the
    config gives it); ConfigError for KV heads that do not group the query heads, or an odd
    head (rotary embedding pairs its dims)."""
    for key, count in (("num_attention_heads", heads), ("num_key_value_heads", kv_heads)):
        if count < 1:
            raise ConfigError(f"{key} = {count} is out of range", f"{key} must be a whole number from 1")
    if heads % kv_heads:
        raise ConfigError(f"num_attention_heads ({heads}) must be a multiple of num_key_value_heads "
                          f"({kv_heads})", "each group of query heads shares one KV head")
    if raw.get("head_dim") is None and hidden_size % heads:
        raise ConfigError(f"hidden_size ({hidden_size}) is not a multiple of num_attention_heads "
                          f"({heads})", "give head_dim, or heads that divide the hidden size")
    head_dim = config_int(raw.get("head_dim") or hidden_size // heads, "head_dim")
    if head_dim % 2:
        raise ConfigError(f"head_dim = {head_dim} is odd", "rotary embedding pairs a head's dims")
    return {"num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim}


def layer_types(raw: Mapping, layers: int, allowed: Collection[str], pattern: Callable[[int], list[str]],
                source: str) -> list[str]:
    """Upstream `layer_types`, one per layer, or `pattern(layers)` (the config class's default
    pattern) when the config omits it; ConfigError for a list of another length or a type not
    in `allowed`, with the hint to list them as `source` (whose configs) do."""
    if raw.get("layer_types") is None:
        return pattern(layers)
    types = list(raw["layer_types"])
    bad = sorted({str(t) for t in types if t not in allowed})
    if len(types) != layers or bad:
        what = (f"layer_types has {len(types)} entries but num_hidden_layers is {layers}"
                if len(types) != layers else f"unsupported layer_types {bad}")
        raise ConfigError(what, f"list one of {sorted(allowed)} per layer, as {source} do")
    return types
