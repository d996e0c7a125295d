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
            d = llama_dims(raw, name)
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

# Registers the toy family, then runs examples/run_mini.py as its own main.
RUNNER = '''
import functools, runpy, sys
sys.path.insert(0, {root!r})
from mkc.model import registry
import toy_muse
known = registry._registry
registry._registry = functools.cache(lambda: {{**known(), "toy_muse": toy_muse.FAMILY}})
sys.argv = ["run_mini.py", *sys.argv[1:]]
runpy.run_path({script!r}, run_name="__main__")
'''


def _family(root: Path, rope: bool) -> Path:
    """The family package under `root` (rotated or NoPE), its MINI config and spec (the fused
    projection streamed by its gated name); the spec's path."""
    (root / "toy_muse").mkdir(parents=True)
    for name, text in FAMILY.items():
        text = text.format(rope=rope) if name == "graph.py" else text
        (root / "toy_muse" / name).write_text(textwrap.dedent(text).lstrip())
    shutil.copy(ROOT / "mkc/families/llama/compiler_scratch.json", root / "toy_muse")
    config = json.loads((CONFIG_DIR / "llama_mini.json").read_text()) | {
        "model_type": "toy_muse", "qk_scale_factor": QK_SCALE_FACTOR}
    (root / "toy_mini.json").write_text(json.dumps(config))
    spec = (ROOT / "schedules/llama_3_1_8b.sched").read_text().replace(
        'model   "llama_3_1_8b"', f'model   "{root / "toy_mini.json"}"').replace(
        "schedule llama_3_1_8b", "schedule toy_mini").replace("gqa: qkv,", "gqa: qkv_gate,")
    (root / "toy_mini.sched").write_text(spec)
    return root / "toy_mini.sched"


@pytest.fixture(params=[True, False], ids=["rotated", "nope"])
def toy(request, tmp_path, monkeypatch) -> tuple[Path, bool]:
    """The family on sys.path and registered: (its spec's path, whether it rotates)."""
    spec = _family(tmp_path, request.param)
    monkeypatch.syspath_prepend(str(tmp_path))
    import toy_muse
    known = registry._registry
    monkeypatch.setattr(registry, "_registry",
                        functools.cache(lambda: {**known(), "toy_muse": toy_muse.FAMILY}))
    yield spec, request.param
    for name in [m for m in sys.modules if m.startswith("toy_muse")]:
        del sys.modules[name]


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
    from conftest import run_python

    from mkc.checkpoint import save_checkpoint
    from toy_muse import reference
    spec, rotated = toy
    root = spec.parent
    config = json.loads((root / "toy_mini.json").read_text())
    save_checkpoint(root / "checkpoint", config, reference.init_params(reference.load_config(config), 0))
    runner = root / "run_toy.py"
    runner.write_text(RUNNER.format(root=str(root), script=str(ROOT / "examples/run_mini.py")))
    norm = "k_norm" if rotated else "q_norm_nope"
    mutants = ",".join(f"gqa.{m}" for m in (norm, "softmax_scale", "out_gate"))
    r = run_python([str(runner), "--json", "--spec", str(spec), "--checkpoint", str(root / "checkpoint"),
                    "--steps", "2", "--batch", "2", "--mutants", mutants], timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    summary = json.loads(next(ln for ln in r.stdout.splitlines() if ln.startswith("JSON "))[5:])
    assert summary["emulation_check"] == "exact"
    assert all(s["emulation"]["logits"] == 0.0 for s in summary["steps"])
