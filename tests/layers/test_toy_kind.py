"""A layer kind added as docs/extending.md says ("A new layer kind"), outside mkc: a GeGLU MLP
(`gelu_tanh(gate) * up`, Gemma's) in a package of its own, composed with the library's GQA into
a family of its own, registered, and a MINI spec checked and compiled with it; in the slow tier
its kernel runs in interpret mode bit-equal to its rounding emulation, the toy kind's reference
written to the contract."""
from __future__ import annotations

import functools
import json
import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from mkc import compiler
from mkc.model import registry
from mkc.model.config import CONFIG_DIR
from tests_support import ROOT

KIND = {
    "__init__.py": '''
        from dataclasses import dataclass

        from mkc.layers.sublayer import Part, Sublayer
        from mkc.model.graph import Op, Tensor, split


        @dataclass(frozen=True)
        class GeGLU(Sublayer):
            package = "toy_geglu_kind"
            prefix: str = "mlp."
            # what SwiGLU's weights module, reused below, reads of its kind
            residual: bool = True
            padded: bool = False

            def op_names(self):
                return ("post_norm", "gate_up", "down", "mlp_residual")

            def part(self, d, ways):
                H = d.hidden_size
                inter = split(d.intermediate_size, ways["mlp"], "intermediate_size", "mlp")
                ops = (Op("post_norm", reads=("x", "post_norm"), writes=("h",)),
                       Op("gate_up", reads=("h",), writes=("act",), matmul="gate_up"),
                       Op("down", reads=("act",), writes=("mlp_out",), matmul="down"),
                       Op("mlp_residual", reads=("mlp_out", "x"), writes=("x",)))
                return Part(ops, {"gate_up": Tensor("gate_up", "matrix", (H, 2 * inter), "bf16"),
                                  "down": Tensor("down", "matrix", (inter, H), "bf16", partial_out=("mlp",)),
                                  "post_norm": Tensor("post_norm", "vector", (H,), "f32")}, {"inter": inter})
    ''',
    "lowering.py": '''
        import jax

        from mkc.layers import ops


        def post_norm(s, c):
            return ops.pre_norm("plain", c, "post_norm")


        def gate_up(s, c, h):
            gu, n = c.matmul("gate_up", h), c.per_rank["inter"]
            return jax.nn.gelu(gu[:, :n], approximate=True) * gu[:, n:2 * n]


        def down(s, c, act):
            return c.matmul("down", act)[:, :c.dims.hidden_size]


        def mlp_residual(s, c, mlp_out):
            c.refs.x[...] = c.refs.x[...] + mlp_out
    ''',
    "reference.py": '''
        import jax

        from mkc.layers.reference import NORM, matmul, mm_input, out_projection


        def forward(s, lp, d, x, cache, layer, positions, rounding, kind):
            h = mm_input(NORM["plain"](x, lp["post_attention_layernorm.weight"], d.rms_norm_eps), rounding)
            act = (jax.nn.gelu(matmul(h, lp["mlp.gate_proj.weight"], rounding), approximate=True)
                   * matmul(h, lp["mlp.up_proj.weight"], rounding))
            per_rank = None if rounding is None else rounding.size("inter")
            down = lp["mlp.down_proj.weight"]
            return x + out_projection(act, down, rounding, kind, "down", per_rank, "mlp")


        def param_shapes(s, d, prefix):
            H, inter = d.hidden_size, d.intermediate_size
            return {prefix + "mlp.gate_proj.weight": ((inter, H), "bfloat16"),
                    prefix + "mlp.up_proj.weight": ((inter, H), "bfloat16"),
                    prefix + "mlp.down_proj.weight": ((H, inter), "bfloat16"),
                    prefix + "post_attention_layernorm.weight": ((H,), "bfloat16")}


        def init_cache(s, d, layer, batch, context, dtype=None):
            return {}
    ''',
    # the same upstream tensors as a SwiGLU MLP's
    "weights.py": '''
        from mkc.layers.swiglu.weights import (kernel_states, matrix, reference_states,  # noqa: F401
                                               tensor_names, vector)
    ''',
}

FAMILY = {
    "__init__.py": '''
        import dataclasses

        from mkc.families.llama.config import read_dims as llama_dims
        from mkc.layers.rope import rope_input
        from mkc.model.family import Family
        from toy_geglu.graph import LAYERS, build


        def read_dims(raw, name):
            return dataclasses.replace(llama_dims(raw, name), family="toy_geglu")


        FAMILY = Family(name="toy_geglu", model_types=("toy_geglu",), read_dims=read_dims,
                        shard_classes=("heads", "mlp", "vocab"), build=build, package=__name__,
                        dims_import=("mkc.families.llama.config", "LlamaDims"), vmem_inputs=rope_input,
                        layers=LAYERS)
    ''',
    "graph.py": '''
        from mkc.layers.decoder import vocab_globals
        from mkc.layers.gqa import GQA
        from mkc.layers.sublayer import layer_kinds
        from mkc.model.graph import FamilyGraph
        from toy_geglu_kind import GeGLU

        LAYERS = {"gqa": (GQA(), GeGLU())}


        def build(d, rules, ranks, formats=None):
            kinds, per_rank = layer_kinds(LAYERS, d, {"heads": rules["heads"][0], "mlp": rules["mlp"][0]})
            glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
            return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank)
    ''',
    "lowering.py": '''
        from mkc.families.llama.lowering import final_hidden, host_inputs, prologue  # noqa: F401
        from mkc.layers.sublayer import body_table
        from toy_geglu.graph import LAYERS

        BODIES = body_table(LAYERS)
    ''',
    "weights.py": '''
        from mkc.layers.weights import DecoderWeights
        from toy_geglu.graph import LAYERS

        _W = DecoderWeights(LAYERS)
        matrix, layer_vector, reference_states = _W.matrix, _W.layer_vector, _W.reference_states
        head_vectors, embedding, kernel_states = _W.head_vectors, _W.embedding, _W.kernel_states
    ''',
    "reference.py": '''
        from mkc.layers.decode import DecoderReference
        from toy_geglu import read_dims
        from toy_geglu.graph import LAYERS

        _R = DecoderReference(LAYERS, read_dims, ("toy_geglu",))
        load_config, param_shapes, init_params = _R.load_config, _R.param_shapes, _R.init_params
        init_cache, decode_step = _R.init_cache, _R.decode_step
    ''',
}

# Registers the toy family, then runs examples/run_mini.py as its own main.
RUNNER = '''
import functools, runpy, sys
sys.path.insert(0, {root!r})
from mkc.model import registry
import toy_geglu
known = registry._registry
registry._registry = functools.cache(lambda: {{**known(), "toy_geglu": toy_geglu.FAMILY}})
sys.argv = ["run_mini.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
'''


def _write(root: Path, package: str, files: dict[str, str]) -> None:
    (root / package).mkdir(parents=True)
    for name, text in files.items():
        (root / package / name).write_text(textwrap.dedent(text).lstrip())


@pytest.fixture
def toy(tmp_path, monkeypatch) -> Path:
    """The kind and family packages on sys.path, the family registered; the MINI spec's path.
    The family has no compiler scratch measure of its own: it borrows Llama's file (a geometry
    it has not measured is counted at 1.5x the family's largest, as for any family)."""
    _write(tmp_path, "toy_geglu_kind", KIND)
    _write(tmp_path, "toy_geglu", FAMILY)
    shutil.copy(ROOT / "mkc/families/llama/compiler_scratch.json", tmp_path / "toy_geglu")
    config = json.loads((CONFIG_DIR / "llama_mini.json").read_text()) | {"model_type": "toy_geglu"}
    (tmp_path / "toy_mini.json").write_text(json.dumps(config))
    spec = (ROOT / "schedules/llama_3_1_8b.sched").read_text().replace(
        'model   "llama_3_1_8b"', f'model   "{tmp_path / "toy_mini.json"}"').replace(
        "schedule llama_3_1_8b", "schedule toy_mini")
    (tmp_path / "toy_mini.sched").write_text(spec)
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_geglu
    known = registry._registry
    monkeypatch.setattr(registry, "_registry",
                        functools.cache(lambda: {**known(), "toy_geglu": toy_geglu.FAMILY}))
    yield tmp_path
    for name in [m for m in sys.modules if m.startswith("toy_geglu")]:
        del sys.modules[name]


def test_a_toy_kind_composes_checks_and_compiles(toy):
    c = compiler.compile_spec(toy / "toy_mini.sched")
    assert c.ir.family == "toy_geglu" and list(c.ir.kinds["gqa"].ops)[-4:] == \
        ["post_norm", "gate_up", "down", "mlp_residual"]
    assert "from toy_geglu import lowering" in c.module_source
    import toy_geglu_kind.lowering as geglu
    from toy_geglu import lowering
    assert lowering.BODIES["gqa", "gate_up"].func is geglu.gate_up


def test_a_format_line_in_a_family_without_choices_is_refused(toy):
    """The toy family offers no format for any class (no experts, no `dense_classes`): a
    `format` line is an E-FORMAT at its class, which says to remove it."""
    from mkc.diagnostics import MkcError
    spec = toy / "toy_mini.sched"
    line = "  shard vocab over tp\n"
    spec.write_text(spec.read_text().replace(line, line + "  format attention fp8 channel rounded\n"))
    with pytest.raises(MkcError, match="stores every matrix one way: attention has no other format"):
        compiler.check_spec(spec)


@pytest.mark.slow
def test_a_toy_kind_s_kernel_equals_its_emulation(toy):
    from conftest import run_python

    from mkc.checkpoint import save_checkpoint
    from toy_geglu import reference
    config = json.loads((toy / "toy_mini.json").read_text())
    save_checkpoint(toy / "checkpoint", config, reference.init_params(reference.load_config(config), 0))
    runner = toy / "run_toy.py"
    runner.write_text(RUNNER.format(root=str(toy), script=str(ROOT / "examples/run_mini.py")))
    r = run_python([str(runner), "--json", "--spec", str(toy / "toy_mini.sched"), "--checkpoint",
                    str(toy / "checkpoint"), "--steps", "2", "--batch", "2"], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("JSON "))[5:])
    assert summary["emulation_check"] == "exact"
    assert all(s["emulation"]["logits"] == 0.0 for s in summary["steps"])
