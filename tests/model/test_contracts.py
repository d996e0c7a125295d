"""A family's declared contracts (`mkc.model.contracts`), on fake family packages written to a
temporary directory: a module that lacks a function of its role is refused at import with the
family, the role and the missing names; the lowered ops are read from the `@lowers` decorators
without importing the lowering module, re-exports from another `.lowering` module included."""
from __future__ import annotations

import sys
import textwrap
import types

import pytest

from mkc.model.contracts import (ContractError, Reference, body_of, declared_ops, lowers, members,
                                 registered_ops)

PREAMBLE = "from mkc.model.contracts import lowers\n"
FAMILY_INIT = """
from mkc.model.family import Family
FAMILY = Family(name={name!r}, model_types=({name!r},), read_dims=None, shard_classes=(),
                build=None, package=__name__)
"""
REFERENCE = "\n".join(f"def {n}(*args, **kwargs): pass" for n in members(Reference))
LOWERING = PREAMBLE + """
def prologue(k): pass
def final_hidden(k, head_norm): pass
def host_inputs(dims, positions): return {}
@lowers("mix")
def mix(c): pass
"""


def _family(tmp_path, monkeypatch, name: str, **modules: str):
    """A family package `name` in tmp_path with the given modules (role -> source)."""
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text(textwrap.dedent(FAMILY_INIT.format(name=name)))
    for role, source in modules.items():
        (package / f"{role}.py").write_text(source)
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
    family = _family(tmp_path, monkeypatch, "fake_full", reference=REFERENCE, lowering=LOWERING)
    assert family.module("reference").decode_step is not None
    assert family.module("lowering").mix.__name__ == "mix"


def test_lowered_ops_are_read_from_the_source_without_importing_it(tmp_path, monkeypatch):
    """Its own `@lowers` bodies and those it imports from another family's lowering module
    count; a helper it imports from there that is not registered does not."""
    base = _family(tmp_path, monkeypatch, "fake_base", lowering=LOWERING + "def helper(c): pass\n")
    derived = _family(tmp_path, monkeypatch, "fake_derived", lowering=(
        "raise ImportError('a spec check must not import a lowering module')\n" + PREAMBLE
        + "from fake_base.lowering import final_hidden, helper, host_inputs, mix, prologue\n"
        + "@lowers(\"route\")\ndef route(c): pass\n"))
    assert base.lowered_ops == {"mix"}
    assert derived.lowered_ops == {"mix", "route"}
    assert "fake_derived.lowering" not in sys.modules


def test_a_body_registered_outside_a_decorator_is_refused(tmp_path, monkeypatch):
    """What the module registers at import must be what its source declares: a body
    registered by a call, which the source scan cannot see, is a contract error."""
    family = _family(tmp_path, monkeypatch, "fake_hidden", lowering=(
        LOWERING + "def gate(c): pass\ngate = lowers('gate')(gate)\n"))
    assert family.lowered_ops == {"mix"}
    with pytest.raises(ContractError, match=r"registers ops \['gate', 'mix'\] at import"):
        family.module("lowering")


def test_a_body_is_named_after_its_op():
    with pytest.raises(ContractError, match="a body is named gate"):
        @lowers("gate")
        def gate_body(c):
            pass
    with pytest.raises(ContractError, match="a body is named moe_gate"):
        @lowers("gate", kind="moe")
        def gate(c):
            pass


def test_a_body_registered_for_one_kind_serves_that_kind_only():
    """`@lowers(op, kind=...)` bodies: the kind's own over the op's shared one; registered and
    declared like any other (the source is read without importing it)."""
    module = types.ModuleType("m")

    @lowers("gate")
    def gate(c):
        return "shared"

    @lowers("gate", kind="moe")
    def moe_gate(c):
        return "moe"
    module.gate, module.moe_gate = gate, moe_gate
    assert body_of(module, "moe", "gate") is moe_gate
    assert body_of(module, "dense", "gate") is gate
    assert registered_ops(module) == {"gate"}
    assert "mlp_residual" in declared_ops("mkc.families.kimi_k3.lowering")
