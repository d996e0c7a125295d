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
                               activations={"latent": ((-1, per_rank["latent_gathered"]), "f32")},
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


def _family(root: Path) -> Path:
    """The family package under `root`, its MINI config and spec; the spec's path."""
    (root / "toy_msmoe").mkdir(parents=True)
    for name, text in FAMILY.items():
        (root / "toy_msmoe" / name).write_text(textwrap.dedent(text).lstrip())
    shutil.copy(ROOT / "mkc/families/qwen3_moe/compiler_scratch.json", root / "toy_msmoe")
    config = json.loads((CONFIG_DIR / "qwen3_moe_mini.json").read_text()) | {"model_type": "toy_msmoe",
                                                                            **MOE_DIMS}
    (root / "toy_mini.json").write_text(json.dumps(config))
    spec = (ROOT / "schedules/qwen3_30b_a3b.sched").read_text()
    for old, new in (('model   "qwen3_30b_a3b"', f'model   "{root / "toy_mini.json"}"'),
                     ("schedule qwen3_30b_a3b", "schedule toy_mini"),
                     ("shard experts over tp\n", "shard experts over tp / 8\n  shard expert_mlp over 8\n"
                      "  shard latent_down over tp\n  shard latent_up over tp\n"),
                     ("    moe: router\n", "    moe: router, latent_down, latent_up\n"),
                     ("    allreduce routed_experts direct wire bf16\n",
                      "    allgather latent_down over tp\n    allreduce routed_experts direct wire bf16\n"
                      "    allgather latent_up over tp\n")):
        assert old in spec, old
        spec = spec.replace(old, new)
    (root / "toy_mini.sched").write_text(spec)
    return root / "toy_mini.sched"


@pytest.fixture
def toy(tmp_path, monkeypatch) -> Path:
    """The family on sys.path and registered: its spec's path."""
    spec = _family(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_msmoe
    known = registry._registry
    monkeypatch.setattr(registry, "_registry",
                        functools.cache(lambda: {**known(), "toy_msmoe": toy_msmoe.FAMILY}))
    yield spec
    for name in [m for m in sys.modules if m.startswith("toy_msmoe")]:
        del sys.modules[name]


# Registers the toy family, then runs examples/run_mini.py as its own main.
RUNNER = '''
import functools, runpy, sys
sys.path.insert(0, {root!r})
from mkc.model import registry
import toy_msmoe
known = registry._registry
registry._registry = functools.cache(lambda: {{**known(), "toy_msmoe": toy_msmoe.FAMILY}})
sys.argv = ["run_mini.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
'''


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
    from conftest import run_python

    from mkc.checkpoint import save_checkpoint
    from toy_msmoe import reference
    root = toy.parent
    config = json.loads((root / "toy_mini.json").read_text())
    save_checkpoint(root / "checkpoint", config, reference.init_params(reference.load_config(config), 0))
    runner = root / "run_toy.py"
    runner.write_text(RUNNER.format(root=str(root), script=str(ROOT / "examples/run_mini.py")))
    mutants = "moe.latent_norm_input,moe.expert_norm,qwen_moe.router"
    r = run_python([str(runner), "--json", "--spec", str(toy), "--checkpoint", str(root / "checkpoint"),
                    "--steps", "2", "--batch", "2", "--mutants", mutants], timeout=3000)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("JSON "))[5:])
    assert summary["emulation_check"] == "exact"
    assert all(s["emulation"]["logits"] == 0.0 for s in summary["steps"])
