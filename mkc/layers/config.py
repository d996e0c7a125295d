"""Config reading the composed families share: upstream defaults for omitted keys (and, where
upstream tells them apart, what an explicit null means), the settings a family refuses, the
attention heads a GQA kind reads, and a per-layer `layer_types` list."""
from __future__ import annotations

import json
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

from mkc.model.family import ConfigError, config_int


def setting(raw: Mapping, key: str, defaults: Mapping[str, Any], nulls: Mapping[str, Any] | None = None
            ) -> Any:
    """A config value: the upstream default for a key the config omits; for a key it sets to
    null, `nulls[key]` where upstream reads that null as a value of its own (Mistral's
    `sliding_window: null` is no window, its omission a 4096-token one), else the default."""
    if key not in raw:
        return defaults[key]
    value = raw[key]
    if value is None:
        return nulls[key] if nulls is not None and key in nulls else defaults[key]
    return value


@dataclass(frozen=True)
class ConfigClass:
    """What one upstream config class (one `model_type`) makes of a config.json: `defaults` for
    the keys a config omits, `nulls` for the keys whose explicit null it reads as a value of its
    own (key -> that value; any other null is read as omitted), and `refused`, the settings
    nothing in mkc computes (key -> (the value computed, hint)). A family that reads several
    model types keeps one per type beside its reader, so an alias gets its own class's
    defaults, never another's."""
    name: str
    defaults: Mapping[str, Any]
    nulls: Mapping[str, Any] = field(default_factory=dict)
    refused: Mapping[str, tuple[Any, str]] = field(default_factory=dict)

    def get(self, raw: Mapping, key: str) -> Any:
        return setting(raw, key, self.defaults, self.nulls)

    def refuse(self, raw: Mapping) -> None:
        refuse(raw, self.refused, self.defaults, self.nulls, self.name)


def config_class(raw: Mapping, classes: Mapping[str, ConfigClass]) -> ConfigClass:
    """The config class of the config's `model_type`: `classes` maps each type a family reads to
    its class, the first for a config that names no type (as a reference's `load_config` takes
    it); ConfigError for a type the family does not read."""
    model_type = raw.get("model_type") or next(iter(classes))
    if model_type not in classes:
        raise ConfigError(f"model_type {json.dumps(model_type)} is not one this family reads",
                          f"this family reads model_type {', '.join(map(repr, classes))}")
    return classes[model_type]


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


def refuse(raw: Mapping, refused: Mapping[str, tuple[Any, str]], defaults: Mapping[str, Any],
           nulls: Mapping[str, Any] | None = None, whose: str = "upstream") -> None:
    """ConfigError for a setting nothing computes: key -> (the value computed, hint); an omitted
    key is judged by its default (`whose` config class gives it), and the message says so."""
    for key, (wanted, hint) in refused.items():
        if setting(raw, key, defaults, nulls) != wanted:
            what = (f"{key} = {json.dumps(raw[key])}" if key in raw else
                    f"{key} is omitted, which {whose} reads as {json.dumps(defaults[key])}, and that")
            raise ConfigError(f"{what} is not supported", hint)


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
