"""The config reading the composed families share (mkc.layers.config): an omitted key and an
explicit null, each read as upstream reads it, and refusals saying which one they judged."""
from __future__ import annotations

import pytest

from mkc.layers.config import ConfigClass, config_class, refuse, setting
from mkc.model.family import ConfigError

DEFAULTS = {"window": 4096, "eps": 1e-6}
WINDOWED = ConfigClass("WindowedConfig", defaults=DEFAULTS, nulls={"window": None},
                       refused={"window": (None, "write \"window\": null")})


def test_without_a_nulls_table_a_null_is_an_omitted_key():
    """What every family's reader relied on before nulls existed, kept."""
    for raw in ({}, {"window": None}):
        assert setting(raw, "window", DEFAULTS) == 4096
    assert setting({"window": 128}, "window", DEFAULTS) == 128


def test_a_null_upstream_reads_as_a_value_is_that_value():
    reads = [WINDOWED.get(raw, "window") for raw in ({}, {"window": None}, {"window": 128})]
    assert reads == [4096, None, 128]
    assert WINDOWED.get({"eps": None}, "eps") == 1e-6           # a null not in the table: omitted


def test_a_refusal_says_whether_it_judged_the_value_or_the_default():
    WINDOWED.refuse({"window": None})
    with pytest.raises(ConfigError, match="window is omitted, which WindowedConfig reads as 4096, "
                                          "and that is not supported"):
        WINDOWED.refuse({})
    with pytest.raises(ConfigError, match="window = 128 is not supported") as e:
        WINDOWED.refuse({"window": 128})
    assert e.value.hint == "write \"window\": null"
    with pytest.raises(ConfigError, match="window = null is not supported"):
        refuse({"window": None}, {"window": (None, "")}, DEFAULTS)   # no nulls: null is the default


def test_the_config_class_is_the_model_type_s():
    classes = {"first": WINDOWED, "second": ConfigClass("SecondConfig", defaults={})}
    assert config_class({}, classes) is WINDOWED
    assert config_class({"model_type": "second"}, classes) is classes["second"]
    with pytest.raises(ConfigError, match="model_type \"third\" is not one this family reads"):
        config_class({"model_type": "third"}, classes)
