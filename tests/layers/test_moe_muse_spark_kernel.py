"""Muse Spark's MoE options in a compiled kernel: a family outside mkc (as `test_gqa_options_kernel`
builds one) composes `GQA(qk_norm="plain")` with `MoE(routing=SCALED_SIGMOID,
latent=MUSE_SPARK_LATENT)` on the Qwen3-MoE MINI config plus Muse Spark's MoE dims, compiled
from Qwen3-30B-A3B's schedule with every rank a width slice of every expert (`shard experts
over tp / 8`, `shard expert_mlp over 8`) and the latent projections' columns split and
gathered. The schedule all-reduces the picks' outputs before `expert_norm` reads them. In
the slow tier the kernel runs two decode steps at batch 2 in TPU interpret mode (8 ranks),
its logits and caches bit-equal to the rounding emulation's, and the generated module's 1.01
mutants of the new ops (`examples/generated_module.py`: moe.latent_norm_input,
moe.expert_norm; the router's logits, qwen_moe.router) rejected.
Not the Muse Spark family: its decoder (residual gates, post-norms, attention) is not composed
here."""
from __future__ import annotations

from pathlib import Path

import pytest

from mkc import compiler
from toy_family import registered, run_mini, write_family

MOE_DIMS = {"moe_hidden_size": 128, "post_norm_eps": 1e-8, "output_multiplier": 0.1767766952966369,
            "routed_scaling_factor": 1.0}

FAMILY = {
    "__init__.py": '''
        import dataclasses

        from mkc.families.qwen3_moe.config import Qwen3MoeDims
        from mkc.families.qwen3_moe.config import read_dims as qwen_dims
        from mkc.layers.moe import EXPERT_LAYOUTS, ROUNDING_FORMATS, WEIGHT_FORMATS
        from mkc.layers.rope import rope_input
        from mkc.model.family import Family, config_float, config_int
        from toy_msmoe.graph import LAYERS, SHARD_CLASSES, build

        EXTRA = ("moe_hidden_size", "post_norm_eps", "output_multiplier", "routed_scaling_factor")


        @dataclasses.dataclass(frozen=True)
        class ToyDims(Qwen3MoeDims):
            moe_hidden_size: int
            post_norm_eps: float
            output_multiplier: float
            routed_scaling_factor: float


        def read_dims(raw, name):
            d = qwen_dims({k: v for k, v in raw.items() if k not in EXTRA}, name)
            fields = {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}
            extra = {k: (config_int if k == "moe_hidden_size" else config_float)(raw[k], k) for k in EXTRA}
            return ToyDims(**fields | {"family": "toy_msmoe"} | extra)


        FAMILY = Family(name="toy_msmoe", model_types=("toy_msmoe",), read_dims=read_dims,
                        shard_classes=SHARD_CLASSES, build=build, package=__name__,
                        dims_import=("toy_msmoe", "ToyDims"), vmem_inputs=rope_input, layers=LAYERS,
                        weight_formats=WEIGHT_FORMATS, rounding_formats=ROUNDING_FORMATS,
                        expert_layouts=EXPERT_LAYOUTS)
    ''',
    "graph.py": '''
        from mkc.layers.decoder import vocab_globals
        from mkc.layers.gqa import GQA
        from mkc.layers.moe import MoE, expert_split
        from mkc.layers.moe.options import SCALED_SIGMOID, Latent
        from mkc.layers.sublayer import layer_kinds
        from mkc.model.graph import FamilyGraph

        LATENT = Latent(width="moe_hidden_size", down="pre_expert_proj.weight", up="post_expert_proj.weight",
                        norm="pre_expert_norm.weight", norm_at="input", norm_weight="zero_centred",
                        expert_norm="experts.post_expert_norm.weight")
        MOE = MoE(routing=SCALED_SIGMOID, latent=LATENT)
        SHARD_CLASSES = ("heads", "vocab", "experts", "expert_mlp", "latent_down", "latent_up")
        LAYERS = {"gqa": (GQA(qk_norm="plain"),), "moe": (MOE,)}


        def build(d, rules, ranks, formats=None):
            ways = {"heads": rules["heads"][0], **expert_split(rules, ranks, "toy_msmoe"),
                    "latent_down": rules["latent_down"][0], "latent_up": rules["latent_up"][0]}
            kinds, per_rank = layer_kinds(LAYERS, d, ways)
            glob, per_rank["vocab"] = vocab_globals(d, rules["vocab"][0])
            return FamilyGraph(kinds=kinds, globals=glob, per_rank=per_rank,
                               activations=MOE.activations(d),
                               **MOE.graph_fields(d, formats, ways["expert_mlp"]))
    ''',
    "lowering.py": '''
        from mkc.layers.decoder.lowering import final_hidden, prologue  # noqa: F401
        from mkc.layers.rope import host_inputs  # noqa: F401
        from mkc.layers.sublayer import body_table
        from toy_msmoe.graph import LAYERS

        BODIES = body_table(LAYERS)
    ''',
    "weights.py": '''
        from mkc.layers.sublayer import paired
        from mkc.layers.weights import DecoderWeights
        from toy_msmoe.graph import LAYERS

        _W = DecoderWeights(LAYERS, model_layer=paired)
        matrix, layer_vector, reference_states = _W.matrix, _W.layer_vector, _W.reference_states
        head_vectors, embedding, kernel_states = _W.head_vectors, _W.embedding, _W.kernel_states
        expert, requantization = _W.expert, _W.requantization
    ''',
    "reference.py": '''
        from mkc.layers.decode import DecoderReference
        from mkc.layers.moe.reference import route, selection_scores  # noqa: F401
        from mkc.layers.sublayer import paired
        from toy_msmoe import FAMILY

        load_config, param_shapes, init_params, init_cache, decode_step = DecoderReference.of(
            FAMILY, model_layer=paired).functions()
    ''',
}


@pytest.fixture
def toy(tmp_path, monkeypatch) -> Path:
    """The family on sys.path and registered, its MINI config and spec (every rank a width slice
    of every expert, the latent projections split and gathered): the spec's path."""
    spec = write_family(tmp_path, "toy_msmoe", FAMILY, "qwen3_moe_mini", "qwen3_30b_a3b", MOE_DIMS, (
        ("shard experts over tp\n", "shard experts over tp / 8\n  shard expert_mlp over 8\n"
         "  shard latent_down over tp\n  shard latent_up over tp\n"),
        ("    moe: router\n", "    moe: router, latent_down, latent_up\n"),
        ("    allreduce routed_experts direct wire bf16\n",
         "    allgather latent_down over tp\n    allreduce routed_experts direct wire bf16\n"
         "    allgather latent_up over tp\n")), scratch_of="qwen3_moe")
    yield from registered(monkeypatch, tmp_path, "toy_msmoe", spec)


def test_the_options_compose_and_compile(toy):
    c = compiler.compile_spec(toy)
    assert list(c.ir.kinds["moe"].ops) == ["post_norm", "router", "route", "latent_down", "latent_norm",
                                           "routed_experts", "expert_norm", "latent_up", "mlp_residual"]
    assert "lower.expert_norm(" in c.module_source


@pytest.mark.extended
def test_the_kernel_equals_its_emulation(toy):
    """Two decode steps at batch 2 in TPU interpret mode: the logits bit-equal to the rounding
    emulation's; the generated module's 1.01 mutants of the normed latent, of the normed
    picks' weighted sum and of the scaled router logits each rejected."""
    run_mini(toy, "toy_msmoe", "--steps", "2", "--batch", "2", "--mutants",
             "moe.latent_norm_input,moe.expert_norm,qwen_moe.router", timeout=3000)
