"""A family's declared contracts (`mkc.model.contracts`), on fake family packages written to a
temporary directory: a module that lacks a function of its role is refused at import with the
family, the role and the missing names; the lowered ops are its composition's, read without
importing the lowering module, and its `BODIES` table must hold exactly those."""
from __future__ import annotations

import sys
import textwrap
import types

import pytest

from mkc.model.contracts import ContractError, Reference, body_of, members

FAMILY_INIT = """
from mkc.model.family import Family
from mkc.layers.swiglu import SwiGLU
FAMILY = Family(name={name!r}, model_types=({name!r},), read_dims=None, shard_classes=(),
                build=None, package=__name__, layers={layers})
"""
REFERENCE = "\n".join(f"def {n}(*args, **kwargs): pass" for n in members(Reference))
LOWERING = """
def prologue(k): pass
def final_hidden(k, head_norm): pass
def host_inputs(dims, positions): return {}
"""
COMPOSED = LOWERING + """
from mkc.layers.sublayer import body_table
from {name} import FAMILY
BODIES = body_table(FAMILY.layers)
"""


def _family(tmp_path, monkeypatch, name: str, layers: str = "None", **modules: str):
    """A family package `name` in tmp_path composed of `layers` (source text) with the given
    modules (role -> source)."""
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(FAMILY_INIT.format(name=name, layers=layers)))
    for role, source in modules.items():
        (package / f"{role}.py").write_text(source.replace("{name}", name))
    monkeypatch.syspath_prepend(str(tmp_path))
    return __import__(name).FAMILY


@pytest.fixture(autouse=True)
def _forget_fake_modules():
    yield
    for name in [m for m in sys.modules if m.startswith("fake_")]:
        del sys.modules[name]


def test_a_module_lacking_a_function_of_its_role_is_refused_at_import(tmp_path, monkeypatch):
    without_decode = "\n".join(line for line in REFERENCE.splitlines() if "decode_step" not in line)
    family = _family(tmp_path, monkeypatch, "fake_lacks", reference=without_decode)
    with pytest.raises(ContractError) as e:
        family.module("reference")
    assert "family fake_lacks" in str(e.value) and "reference module" in str(e.value)
    assert str(e.value).split(" lacks ")[1].startswith("decode_step ")


def test_a_complete_module_loads(tmp_path, monkeypatch):
    family = _family(tmp_path, monkeypatch, "fake_full", layers='{"dense": (SwiGLU(),)}',
                     reference=REFERENCE, lowering=COMPOSED)
    assert family.module("reference").decode_step is not None
    lowering = family.module("lowering")
    assert body_of(lowering, "dense", "gate_up").func.__module__ == "mkc.layers.swiglu.lowering"


def test_lowered_ops_are_the_compositions_without_importing_the_lowering(tmp_path, monkeypatch):
    family = _family(tmp_path, monkeypatch, "fake_spec_only", layers='{"dense": (SwiGLU(),)}',
                     lowering="raise ImportError('a spec check must not import a lowering module')\n")
    assert family.lowered_ops == {"post_norm", "gate_up", "down", "mlp_residual"}
    assert "fake_spec_only.lowering" not in sys.modules


def test_bodies_that_are_not_the_compositions_are_refused(tmp_path, monkeypatch):
    """A body outside the `BODIES` table (a module-level function named after an op) is not
    one: the family's lowering must hold its composition's ops in `BODIES`."""
    family = _family(tmp_path, monkeypatch, "fake_loose", layers='{"dense": (SwiGLU(),)}',
                     lowering=LOWERING + "BODIES = {}\ndef gate_up(c, h): pass\n")
    with pytest.raises(ContractError, match=r"BODIES hold ops \[\] but its composition declares"):
        family.module("lowering")


def test_a_body_is_found_by_its_kind_and_op_only():
    module = types.ModuleType("m")
    module.BODIES = {("moe", "gate"): "moe's"}
    module.gate = "a function named after the op"
    assert body_of(module, "moe", "gate") == "moe's"
    assert body_of(module, "dense", "gate") is None
