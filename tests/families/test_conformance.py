"""The family conformance suite: what every registered family (`mkc.model.registry`, not a hand
list) must do, checked the same way for each. A new family runs it by being registered, with
its MINI configs (`mkc/model/configs/*_mini.json` of its model types: at least one, and each
config check and reference check runs on every one, so an alias's MINI is read by its own
model type) and a shipped spec of it (`schedules/*.sched`) as the inputs.

- its lowering, weights and reference modules provide their roles' contracts, and its dims
  the fields the core reads;
- the lowered ops (its composition's) are exactly its spec's graph ops, and
  every body takes the layer and the op's register values as the generated call passes them;
- one config reader: whatever config the reference refuses, `mkc check` refuses with a
  located diagnostic (every key dropped, every flag flipped, every setting misspelt);
- the reference's weights follow its table and seed, and its decode of a few steps is finite,
  deterministic, well scaled, keeps rows independent and carries state.
"""
from __future__ import annotations

import copy
import inspect
import json
import re
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import NamedTuple

import pytest

from mkc.compiler import check_spec
from mkc.diagnostics import MkcError, Span
from mkc.model.contracts import body_of
from mkc.model import registry
from mkc.model.config import CONFIG_DIR, dims_from_config
from mkc.model.contracts import ROLES, Dims
from mkc.model.family import Family
from tests_support import ROOT, assert_rows_step_like_alone

FAMILIES = registry.all_families()
MODEL_LINE = re.compile(r'^\s*model\s+"([^"]+)"', re.M)


def _model_type(config: Path) -> str | None:
    return json.loads(config.read_text()).get("model_type")


def mini_configs(family: Family) -> list[Path]:
    """The family's MINI configs: every shipped `*_mini.json` of its model types."""
    return [p for p in sorted(CONFIG_DIR.glob("*_mini.json")) if _model_type(p) in family.model_types]


class Mini(NamedTuple):
    family: Family
    config: Path


MINIS = [Mini(f, path) for f in FAMILIES for path in mini_configs(f)]


def shipped_spec(family: Family) -> Path:
    """The first shipped spec whose model is of the family."""
    return next(p for p in sorted((ROOT / "schedules").glob("*.sched"))
                if _model_type(CONFIG_DIR / f"{MODEL_LINE.search(p.read_text())[1]}.json")
                in family.model_types)


@pytest.fixture(scope="module", params=FAMILIES, ids=lambda f: f.name)
def family(request) -> Family:
    return request.param


@pytest.fixture(scope="module", params=MINIS, ids=lambda m: f"{m.family.name}:{m.config.stem}")
def case(request) -> Mini:
    """A family with one of its MINI configs."""
    return request.param


def test_every_shipped_family_is_registered():
    assert {f.name for f in FAMILIES} >= {"kimi_k3", "qwen3_5_text", "qwen3_5_moe_text"}


def test_every_family_has_a_mini_config():
    assert [f.name for f in FAMILIES if not mini_configs(f)] == []


def test_an_alias_s_mini_config_runs_as_its_family_s():
    """A family reading two model types (llama and its alias mistral) runs the suite on the
    MINI of each."""
    assert {_model_type(m.config) for m in MINIS if m.family.name == "llama"} == {"llama", "mistral"}


# ---- contracts ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checked(family: Family):
    """The family's shipped spec, checked (its own model: a MINI model may not split over
    its mesh)."""
    return check_spec(shipped_spec(family))


def test_reference_and_dims_provide_their_contracts(case: Mini):
    family = case.family
    family.module("reference")              # ContractError names what is missing
    dims = family.read_dims(json.loads(case.config.read_text()), "mini")
    assert isinstance(dims, Dims) and dims.family == family.name
    assert isinstance(dims.layer_kinds, tuple) and all(isinstance(k, str) for k in dims.layer_kinds)


def test_kernel_modules_provide_their_contracts(family: Family, checked):
    for role in ROLES:
        family.module(role)                 # ContractError names what is missing
    if checked.ir.top_k:                    # routed experts: the packer asks for each one's
        assert callable(getattr(family.module("weights"), "expert", None))


def test_every_shipped_spec_of_the_family_has_measured_compiler_scratch(family: Family):
    """What libtpu allocates beyond mkc's buffers (spill slots) is measured for each geometry
    the family ships (benchmarks/compiler_scratch.py), never borrowed from another family: a
    spec of a family with no measure is refused, so `mkc check` never promises a fit it has no
    evidence for."""
    from mkc.checks.capacity import compiler_scratch, scratch_key
    from mkc.lang.parser import parse_file
    from mkc.resolve import resolve
    measures = family.measured_scratch()
    assert measures, f"family {family.name} has no compiler_scratch.json: measure it"
    assert all(m.used_bytes > 0 and m.libtpu.startswith("libtpu ") for m in measures)
    for path in sorted((ROOT / "schedules").glob("*.sched")):
        s = resolve(parse_file(path)[0], None)
        if s.family == family.name:
            assert any(m.key == scratch_key(s) for m in measures), path.name
            assert compiler_scratch(s).measured, path.name


def test_a_family_without_measured_scratch_is_refused_at_the_model_line(family: Family,
                                                                        monkeypatch):
    monkeypatch.setattr(Family, "measured_scratch", lambda self: ())
    with pytest.raises(MkcError) as e:
        check_spec(shipped_spec(family))
    d = next(d for d in e.value.diagnostics if d.code == "E-VMEM-SCRATCH")
    assert d.span.line == _model_line(shipped_spec(family)) and "compiler_scratch.py" in d.hint


def _model_line(path: Path) -> int:
    return path.read_text()[:MODEL_LINE.search(path.read_text()).start(1)].count("\n") + 1


def test_lowered_ops_are_the_graph_ops_and_take_their_values(family: Family, checked):
    """The ops of its composition are the graph's, and each
    kind's body of each op binds the layer and the op's register values (a TypeError if not)."""
    compiled = checked
    graph_ops = {op for kind in compiled.ir.kinds.values() for op in kind.ops}
    assert graph_ops == family.lowered_ops
    lowering = family.module("lowering")
    for name, kind in compiled.ir.kinds.items():
        for op in kind.ops:
            reads, _ = kind.op_values[op]
            inspect.signature(body_of(lowering, name, op)).bind("layer", *reads)


# ---- one config reader ---------------------------------------------------------------------------


def _variants(raw: Mapping, path: tuple = ()) -> Iterator[tuple[str, dict]]:
    """Configs one edit away from `raw`: each key dropped, each flag flipped, each string
    setting misspelt (nested objects too)."""
    node = raw
    for key in path:
        node = node[key]
    for key, value in node.items():
        here = ".".join((*path, key))
        path_to = (*path, key)
        yield f"without {here}", _edit(raw, path_to, None)
        if isinstance(value, bool):
            yield f"{here} = {not value}", _edit(raw, path_to, not value)
        elif isinstance(value, str) and key != "model_type":
            yield f"{here} = 'unsupported'", _edit(raw, path_to, "unsupported")
        elif isinstance(value, Mapping):
            yield from _variants(raw, path_to)


def _edit(raw: Mapping, path: tuple, value) -> dict:
    """A copy of `raw` with the key at `path` set to `value` (None: removed)."""
    out = copy.deepcopy(dict(raw))
    node = out
    for key in path[:-1]:
        node = node[key]
    if value is None:
        del node[path[-1]]
    else:
        node[path[-1]] = value
    return out


def test_whatever_the_reference_refuses_mkc_check_refuses(case: Mini):
    """Every one-edit variant of the MINI config that the reference's load_config refuses is
    refused by the compiler's config reader with an E-MODEL diagnostic at the spec's `model`
    line (here a stand-in span)."""
    family, path = case
    reference = family.module("reference")
    where = Span("spec.sched", 3, 11, 3, 24)
    refused = []
    for what, raw in _variants(json.loads(path.read_text())):
        try:
            reference.load_config(raw)
        except (ValueError, KeyError, TypeError):
            refused.append(what)
            with pytest.raises(MkcError) as e:
                dims_from_config(raw, path, where)
            (d,) = e.value.diagnostics
            assert (d.code, d.span) == ("E-MODEL", where) and d.hint, (what, d)
    assert len(refused) >= 3, refused


def _unsupported_activation(case: Mini) -> dict:
    """The MINI config with an activation no family computes."""
    return json.loads(case.config.read_text()) | {"hidden_act": "unsupported"}


def test_the_reference_refuses_an_activation_it_does_not_compute(case: Mini):
    with pytest.raises(ValueError, match="hidden_act"):
        case.family.module("reference").load_config(_unsupported_activation(case))


def test_mkc_check_locates_a_refused_config_at_the_model_line(case: Mini, tmp_path):
    """End to end: a spec whose model is a config the reference refuses (an activation mkc
    does not compute) fails `mkc check` at its `model` line, naming the setting."""
    family = case.family
    raw = _unsupported_activation(case)
    (tmp_path / "broken.json").write_text(json.dumps(raw))
    text = MODEL_LINE.sub('  model   "broken.json"', shipped_spec(family).read_text(), count=1)
    spec = tmp_path / "broken.sched"
    spec.write_text(text)
    with pytest.raises(MkcError) as e:
        check_spec(spec)
    (d,) = e.value.diagnostics
    line = text[:text.index('model   "broken.json"')].count("\n") + 1
    assert (d.code, d.span.file, d.span.line) == ("E-MODEL", str(spec), line)
    assert d.span.column > 1 and "hidden_act" in d.message and d.hint


# ---- the reference ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mini(case: Mini):
    """(reference module, MINI config, its weights at seed 0)."""
    reference = case.family.module("reference")
    cfg = reference.load_config(case.config)
    return reference, cfg, reference.init_params(cfg, seed=0)


def test_weights_follow_the_table_and_the_seed(mini):
    import numpy as np
    reference, cfg, params = mini
    shapes = reference.param_shapes(cfg)
    assert list(params) == list(shapes)
    for name, (shape, dtype) in shapes.items():
        assert params[name].shape == shape and params[name].dtype == np.dtype(dtype), name
    again = reference.init_params(cfg, seed=0)
    assert all(np.array_equal(again[n].view(np.uint8), params[n].view(np.uint8)) for n in shapes)


def test_decode_is_finite_deterministic_and_well_scaled(mini):
    """Four greedy steps of two rows, twice: bit-equal runs, finite logits neither flat nor
    exploding nor one-hot, rows that differ, and a state that carries between steps."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    reference, cfg, params = mini
    decode = jax.jit(reference.decode_step, static_argnums=1)

    def run() -> list[np.ndarray]:
        cache = reference.init_cache(cfg, batch=2, context=8)
        tokens = jnp.array([3, cfg.vocab_size // 2], jnp.int32)
        out = []
        for t in range(4):
            logits, cache = decode(params, cfg, cache, tokens, jnp.full((2,), t, jnp.int32))
            assert logits.shape == (2, cfg.vocab_size) and logits.dtype == jnp.float32
            out.append(np.asarray(logits))
            tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        return out

    first, second = run(), run()
    for a, b in zip(first, second):
        assert np.all(np.isfinite(a))
        np.testing.assert_array_equal(a, b)
        assert 0.3 < a.std() < 5.0
        assert np.asarray(jax.nn.softmax(a, axis=-1)).max() < 0.5
    assert not np.allclose(first[0][0], first[0][1])     # rows are independent
    assert not np.allclose(first[0], first[1])           # the state carries between steps


def test_rows_at_different_positions_step_like_alone(mini):
    """A joint step of rows at positions 4 and 2 equals stepping each row alone."""
    import jax
    reference, cfg, params = mini
    decode = jax.jit(reference.decode_step, static_argnums=1)
    assert_rows_step_like_alone(lambda c, t, p: decode(params, cfg, c, t, p),
                                lambda b, n: reference.init_cache(cfg, batch=b, context=n),
                                [[7, 8, 9, 10], [100, 200]], [12, cfg.vocab_size // 3])
