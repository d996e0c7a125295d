"""A layer kind added as docs/extending.md says ("A new layer kind"), outside mkc: a GeGLU MLP
(`gelu_tanh(gate) * up`, Gemma's) in a package of its own, composed with the library's GQA into
a family of its own, registered, and a MINI spec checked and compiled with it; in the slow tier
its kernel runs in interpret mode bit-equal to its rounding emulation, the toy kind's reference
written to the contract."""
from __future__ import annotations

from pathlib import Path

import pytest

from mkc import compiler
from toy_family import registered, run_mini, write_family, write_package

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
            return dataclasses.replace(llama_dims(raw | {"model_type": "llama"}, name), family="toy_geglu")


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

@pytest.fixture
def toy(tmp_path, monkeypatch) -> Path:
    """The kind and family packages on sys.path, the family registered; their directory."""
    write_package(tmp_path, "toy_geglu_kind", KIND)
    write_family(tmp_path, "toy_geglu", FAMILY, "llama_mini", "llama_3_1_8b")
    yield from registered(monkeypatch, tmp_path, "toy_geglu", tmp_path)


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
    run_mini(toy / "toy_mini.sched", "toy_geglu", "--steps", "2", "--batch", "2", timeout=900)
