"""GQA's Muse Spark options in a compiled kernel: a family outside mkc (as docs/extending.md's "A
new layer kind" test builds one, `test_toy_kind`) composes `GQA(norm="zero_centred",
qk_norm="weightless", output_gate="rms_gate_proj")`, rotated or NoPE, with a SwiGLU MLP on the
Llama MINI config plus Muse Spark's `qk_scale_factor`, compiled from Llama 3.1 8B's schedule.
In the slow tier its kernel runs in TPU interpret mode bit-equal to the GQA reference's
rounding emulation and within the numerics' tolerances of the f32 reference, and the generated
module's 1.01 mutants of the new ops (`examples/generated_module.py`: the normed key, or a NoPE
layer's normed query; the softmax scale; the gated output) are rejected.
Not the Muse Spark family: its decoder (residual gates, post-norms, MoE) is not composed here."""
from __future__ import annotations

from pathlib import Path

import pytest

from mkc import compiler
from toy_family import registered, run_mini, write_family

QK_SCALE_FACTOR = 5.4730064863875      # Muse Spark's (MuseSparkTextConfig)

FAMILY = {
    "__init__.py": '''
        import dataclasses

        from mkc.families.llama.config import LlamaDims
        from mkc.families.llama.config import read_dims as llama_dims
        from mkc.layers.rope import rope_input
        from mkc.model.family import Family, config_float
        from toy_muse.graph import LAYERS, build


        @dataclasses.dataclass(frozen=True)
        class ToyMuseDims(LlamaDims):
            qk_scale_factor: float


        def read_dims(raw, name):
            # llama's reader takes the defaults of the model types it reads: read as LlamaConfig
            d = llama_dims(raw | {"model_type": "llama"}, name)
            fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
            return ToyMuseDims(**fields | {"family": "toy_muse"},
                               qk_scale_factor=config_float(raw["qk_scale_factor"], "qk_scale_factor"))


        FAMILY = Family(name="toy_muse", model_types=("toy_muse",), read_dims=read_dims,
                        shard_classes=("heads", "mlp", "vocab"), build=build, package=__name__,
                        dims_import=("toy_muse", "ToyMuseDims"), vmem_inputs=rope_input, layers=LAYERS)
    ''',
    "graph.py": '''
        from mkc.layers.decoder import vocab_globals
        from mkc.layers.gqa import GQA
        from mkc.layers.sublayer import layer_kinds
        from mkc.layers.swiglu import SwiGLU
        from mkc.model.graph import FamilyGraph

        ATTENTION = GQA(norm="zero_centred", qk_norm="weightless", output_gate="rms_gate_proj", rope={rope})
        LAYERS = {{"gqa": (ATTENTION, SwiGLU())}}


        def build(d, rules, ranks, formats=None):
            kinds, per_rank = layer_kinds(LAYERS, d, {{"heads": rules["heads"][0], "mlp": rules["mlp"][0]}})
            glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
            return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank)
    ''',
    "lowering.py": '''
        from mkc.families.llama.lowering import final_hidden, host_inputs, prologue  # noqa: F401
        from mkc.layers.sublayer import body_table
        from toy_muse.graph import LAYERS

        BODIES = body_table(LAYERS)
    ''',
    "weights.py": '''
        from mkc.layers.weights import DecoderWeights
        from toy_muse.graph import LAYERS

        _W = DecoderWeights(LAYERS)
        matrix, layer_vector, reference_states = _W.matrix, _W.layer_vector, _W.reference_states
        head_vectors, embedding, kernel_states = _W.head_vectors, _W.embedding, _W.kernel_states
    ''',
    "reference.py": '''
        from mkc.layers.decode import DecoderReference
        from toy_muse import read_dims
        from toy_muse.graph import LAYERS

        _R = DecoderReference(LAYERS, read_dims, ("toy_muse",))
        load_config, param_shapes, init_params = _R.load_config, _R.param_shapes, _R.init_params
        init_cache, decode_step = _R.init_cache, _R.decode_step
    ''',
}

@pytest.fixture(params=[True, False], ids=["rotated", "nope"])
def toy(request, tmp_path, monkeypatch) -> tuple[Path, bool]:
    """The family (rotated or NoPE) on sys.path and registered, its MINI config and spec (the
    fused projection streamed by its gated name): (the spec's path, whether it rotates)."""
    files = FAMILY | {"graph.py": FAMILY["graph.py"].format(rope=request.param)}
    spec = write_family(tmp_path, "toy_muse", files, "llama_mini", "llama_3_1_8b",
                        {"qk_scale_factor": QK_SCALE_FACTOR}, [("gqa: qkv,", "gqa: qkv_gate,")])
    yield from registered(monkeypatch, tmp_path, "toy_muse", (spec, request.param))


def test_the_options_compose_and_compile(toy):
    spec, rotated = toy
    c = compiler.compile_spec(spec)
    ops = list(c.ir.kinds["gqa"].ops)
    assert ops[:8] == ["input_norm", "qkv_gate", "qk_norm_rope" if rotated else "qk_norm", "kv_write",
                       "attention", "out_gate", "o_proj", "attn_residual"]
    assert "q_norm" not in c.module_source          # the q/k norm has no weight
    assert f"qk_scale_factor={QK_SCALE_FACTOR}" in c.module_source


@pytest.mark.extended
def test_the_kernel_equals_its_emulation_and_rejects_each_new_op_s_mutant(toy):
    spec, rotated = toy
    norm = "k_norm" if rotated else "q_norm_nope"
    mutants = ",".join(f"gqa.{m}" for m in (norm, "softmax_scale", "out_gate"))
    run_mini(spec, "toy_muse", "--steps", "2", "--batch", "2", "--mutants", mutants)
