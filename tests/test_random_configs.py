"""Exact on configurations unlike the shipped MINIs: each family's kernel, compiled from its
shipped spec for a config drawn by `tests/random_configs.py` (widths that are not powers of
two, head counts and dims, KV heads fewer than the ranks, expert counts, top-k, renormalisation
on and off), runs in TPU interpret mode two decode steps within the rounding emulation's exact
bound (`mkc.numerics`) and passes the plain reference, from a checkpoint of that config
written here. The CI tier runs one fixed draw a family; the extended tier a wider sweep.

The shipped MINIs did not reach every f32 order the emulation must mirror: a Qwen3-MoE config
of hidden 384 (32 query heads of 32 dims, 4 KV heads over 8 cores, 32 experts top 6, no
renormalisation) was 5.1e-4 from the emulation in the logits at step 0 (its caches 3.7e-4),
because the emulation ran its RMS norms eagerly and XLA summed that width otherwise than the
kernel's fused norm (`mkc.layers.reference.rms_norm`)."""
from __future__ import annotations

import json
import tempfile
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc import compiler
from mkc.layers import ops, reference
from mkc.checkpoint import family_of, save_checkpoint
from random_configs import FAMILIES, draw
from tests_support import assert_within_exact_bound, run_example

# the fixed draw of each family the CI tier runs (measured: bit-equal at both steps)
CI_SEED = 0
SWEEP_SEEDS = range(1, 5)


def _write(config: dict, path: Path, weights: bool) -> Path:
    """`config` as a model directory: its config.json, and with `weights` a checkpoint of the
    family reference's seeded draw (what a runner's `--checkpoint` loads)."""
    path.mkdir(parents=True, exist_ok=True)
    if not weights:
        (path / "config.json").write_text(json.dumps(config))
        return path
    reference = family_of(config).module("reference")
    save_checkpoint(path, config, reference.init_params(reference.load_config(config), seed=0))
    return path


def _run(family: str, config: dict, tmp_path: Path, *args: str) -> dict:
    checkpoint = _write(config, tmp_path / "model", weights=True)
    return run_example("examples/run_mini.py", "--spec", str(FAMILIES[family].spec), "--checkpoint",
                       str(checkpoint), "--steps", "2", "--batch", "2", *args, timeout=1800)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_draws_are_valid_configs_the_shipped_spec_compiles_for(family):
    """Every draw the tests run (and a few past them) is a config its family reads and its
    spec resolves and checks for, the same dict on every call; and the draws differ from the
    MINI and from each other (a generator stuck on one config would test nothing new)."""
    seen = set()
    with tempfile.TemporaryDirectory() as tmp:
        for seed in [CI_SEED, *SWEEP_SEEDS, 5, 6, 7]:
            config = draw(family, seed)
            assert config == draw(family, seed)
            model = _write(config, Path(tmp) / str(seed), weights=False)
            compiler.check_spec(FAMILIES[family].spec, str(model))
            seen.add(json.dumps(config, sort_keys=True))
    assert len(seen) >= 5, family


@pytest.mark.parametrize("norm", sorted(ops.NORM))
def test_the_emulation_s_rms_norms_sum_as_a_kernel_s(norm):
    """The kernel's pre-norm body (`mkc.layers.ops`) in a TPU interpret-mode kernel, against the
    emulation's norm (`mkc.layers.reference`), to the bit at widths that are not powers of
    two, 8 rows (measured: run eagerly, the emulation's norm was 263 of 3,072 elements off at
    384 columns, 1,057 of 5,120 at 640)."""
    rng = np.random.default_rng(0)
    for width in (384, 640):
        x = jnp.asarray(rng.normal(0.0, 1.0, (8, width)), jnp.float32)
        w = jnp.asarray(rng.normal(0.0, 0.1, (1, width)), jnp.bfloat16).astype(jnp.float32)

        def body(x_ref, w_ref, o_ref):
            o_ref[...] = ops.NORM[norm](x_ref[...], w_ref[...], 1e-6)
        kernel = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct(x.shape, jnp.float32),
                                interpret=pltpu.InterpretParams())(x, w)
        emulated = reference.NORM[norm](x, w[0], 1e-6)
        off = int(jnp.sum(kernel != emulated))
        assert off == 0, f"{off} elements of {x.size} differ at width {width}"


def test_a_top_k_of_every_expert_has_no_routing_near_tie():
    """A draw may pick every expert (GPT-OSS's seed 3: top 4 of 4): the runners' routing margin
    (`generated_module.top_margins`) is then inf, not an IndexError before any step ran."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from generated_module import top_margins
    scores = np.array([[0.1, 0.4, 0.2, 0.3], [0.3, 0.3, 0.2, 0.2]])
    assert top_margins(scores, 4).tolist() == [np.inf, np.inf]
    assert np.allclose(top_margins(scores, 2), [0.1, 0.1])


REGRESSION = {"hidden_size": 384, "num_attention_heads": 32, "head_dim": 32, "num_key_value_heads": 4,
              "num_experts": 32, "num_experts_per_tok": 6, "norm_topk_prob": False,
              "moe_intermediate_size": 128}


@pytest.mark.slow
def test_qwen3_moe_hidden_384_is_exact(tmp_path):
    """The configuration whose pre-norms the emulation summed in another order (module
    docstring), row 1 from position 136: bit-equal at both steps."""
    mini = json.loads((Path(__file__).parent.parent / "mkc/model/configs/qwen3_moe_mini.json").read_text())
    summary = _run("qwen3_moe", {**mini, **REGRESSION}, tmp_path, "--first-position", "5")
    assert_within_exact_bound(summary)
    assert [s["emulation"]["logits"] for s in summary["steps"]] == [0.0, 0.0]


# CI's draws: the cheapest dense family and the hybrid MoE (measured CPU time, two steps: Llama
# 13 s, Qwen3.5 MoE 28 s, Qwen3-MoE 19 s, GPT-OSS 24 s, DeepSeek-V3 on 16 devices 52 s; the
# regression test above is CI's Qwen3-MoE draw)
CI_FAMILIES = ("llama", "qwen3_5_moe")


@pytest.mark.parametrize("family", [f if f in CI_FAMILIES else pytest.param(f, marks=pytest.mark.extended)
                                    for f in sorted(FAMILIES)])
@pytest.mark.slow
def test_a_drawn_config_is_exact(family, tmp_path):
    assert_within_exact_bound(_run(family, draw(family, CI_SEED), tmp_path))


# Open: Qwen3.5 MoE's draw 2 (16 query heads, 2 KV heads, 32 experts top 3) is 2.8e-5 from the
# emulation in the logits at step 1 (key cache 1.2e-4), row 1: one element of layer 1's shared
# expert's output after its bf16-wire all-reduce is a flip apart (the block's input and its
# routed sum equal). Captured: the kernel's shared activations equal the emulation's, and the
# emulation's down projection of them ([2, 16] x [16, 256] a rank) puts rank 0's partial sum of
# that element exactly halfway between two bf16 values, which the wire rounds to even; the
# kernel's rounds up, so its f32 partial is an ulp above: that dot sums in another order in the
# kernel's context (captured partials are ulps apart in every layer, the MINI's too, which the
# bf16 wire hides but near a boundary; a standalone interpret-mode dot of those shapes agrees
# with the emulation on 20 random draws). Measured December 2026, AVX2-capped host.
OPEN = {("qwen3_5_moe", 2): "the shared expert's down projection sums in another f32 order (see above)"}


@pytest.mark.extended
@pytest.mark.parametrize("family,seed", [
    pytest.param(f, s, marks=[pytest.mark.xfail(strict=True, reason=OPEN[f, s])] if (f, s) in OPEN else [])
    for f in sorted(FAMILIES) for s in SWEEP_SEEDS])
def test_drawn_configs_are_exact(family, seed, tmp_path):
    assert_within_exact_bound(_run(family, draw(family, seed), tmp_path))
