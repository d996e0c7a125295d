"""`format expert.* fp4 block N [rounded]`: routed experts as e2m1 codes (two a byte) with one
E8M0 scale per block of whole pack groups, requantized from the checkpoint's MXFP4 (a scale per
32 rows) when weights are packed. Exact only where a block's values fit one scale; otherwise
packing refuses unless the spec says `rounded`, and reports the error either way. The kernel's
mixed bf16 x fp4 dot equals, bit for bit, the emulation's dot of the requantized values."""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from mkc.families.kimi_k3 import reference as reference
from mkc.families.kimi_k3 import weights as kw
from mkc.families.kimi_k3.config import KimiDims
from mkc.families.kimi_k3.graph import build
from mkc.ir import WeightFormat
from mkc.layers.expert_formats import ops as format_ops
from mkc.model.config import CONFIG_DIR
from mkc.model.family import FormatError
from mkc.model.graph import build_graph
from mkc.model.sharding import ShardTable
from mkc.model.mxfp4 import E2M1_VALUES, mxfp4_dequantize, mxfp4_quantize, requantize_blocks
from mkc.reference.rounding import chunked_linear

F32 = jnp.float32
MINI = KimiDims.load(CONFIG_DIR / "kimi_k3_mini.json")
RULES = {"heads": (16, 1), "mlp": (16, 1), "vocab": (16, 1), "latent_down": (16, 1),
         "experts": (4, 4), "expert_mlp": (4, 1), "latent_up": (8, 1), "router": (2, 1)}
PER_RANK = build(MINI, RULES, 16).per_rank
TP = PER_RANK["expert_tp"]


def values_in_kernel(fn, args: list, out_shape):
    """``fn`` of every (VMEM) input, in a grid-less pallas_call in TPU interpret mode."""
    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)

    def body(*refs):
        refs[-1][...] = fn(*[r[...] for r in refs[:-1]]).astype(refs[-1].dtype)
    return pl.pallas_call(body, out_shape=out_shape, in_specs=[vmem] * len(args),
                          out_specs=vmem, interpret=pltpu.InterpretParams())(*args)


def sds(shape: tuple[int, ...], dtype=F32) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape, dtype)


def _fp4(block: int, rounded: bool, where: str = "k3.sched:40") -> WeightFormat:
    return WeightFormat("fp4", block, rounded=rounded, where=where)


def _values(codes: np.ndarray, scales: np.ndarray, block: int) -> np.ndarray:
    """Checkpoint-layout codes [..., K/2] and one scale per `block` -> f64 values."""
    k = 2 * codes.shape[-1]
    nib = np.stack([codes & 0xF, codes >> 4], axis=-1).reshape(*codes.shape[:-1], k)
    v = E2M1_VALUES[nib].astype(np.float64).reshape(*codes.shape[:-1], k // block, block)
    return (v * np.ldexp(1.0, scales.astype(np.int64) - 127)[..., None]).reshape(nib.shape)


@pytest.fixture(scope="module")
def hf():
    cfg = reference.load_config(CONFIG_DIR / "kimi_k3_mini.json")
    return reference.init_params(cfg, seed=3)


def test_requantization_rounds_to_nearest_under_a_scale_that_holds_the_block():
    """Gaussian draws quantized to MXFP4 (realistic: their 32-row scales differ by an octave
    or two within 512 rows) do not requantize exactly; every value lands on the nearest e2m1
    value under its block's scale (error at most half a step of 0.5 x scale... of the largest
    step, 2 x scale), nothing overflows, and the report's figures are those of the values."""
    rng = np.random.default_rng(0)
    w = rng.normal(0, 1 / 16, (64, 1024))
    codes, scales = mxfp4_quantize(w)
    assert np.ptp(scales.reshape(64, 2, 16).astype(int), axis=-1).max() >= 1
    r = requantize_blocks(codes, scales, 512)
    assert r.scales.shape == (64, 2) and r.codes.shape == codes.shape
    old, new = mxfp4_dequantize(codes, scales, w.shape).astype(np.float64), _values(r.codes, r.scales, 512)
    scale = np.repeat(np.ldexp(1.0, r.scales.astype(np.int64) - 127), 512, axis=1)
    assert np.all(np.abs(new) <= 6 * scale)                             # nothing overflows
    assert np.all(np.abs(old) <= 6 * scale)                             # the scale holds the block
    # nearest: no e2m1 value under the block's scale is closer to the checkpoint's value
    candidates = E2M1_VALUES[:8].astype(np.float64)[None, None, :] * scale[..., None]
    best = np.min(np.abs(np.abs(old)[..., None] - candidates), axis=-1)
    np.testing.assert_array_equal(np.abs(new - old), best)
    assert not r.exact and r.changed == int(np.count_nonzero(new != old))
    assert r.max_abs == float(np.abs(new - old).max())
    np.testing.assert_allclose((r.sq_err / r.sq_ref) ** 0.5,
                               np.sqrt(np.sum((new - old) ** 2) / np.sum(old ** 2)))
    assert 0.01 < (r.sq_err / r.sq_ref) ** 0.5 < 0.1
    lo, hi = r.first_scales
    assert hi > lo                                     # an inexact block has unequal scales


def test_requantization_is_exact_where_a_blocks_scales_are_equal_and_idempotent():
    """Equal 32-row scales in every block: the codes and the scale come through unchanged
    (exact); a requantized tensor, written back as MXFP4, requantizes exactly to itself."""
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, (16, 512)).astype(np.uint8)
    scales = np.repeat(rng.integers(110, 130, (16, 2)), 16, axis=1).astype(np.uint8)
    codes[codes & 0x7 == 0] = 0x77                 # every block holds a 6 (no finer scale)
    codes[:, 0] = 0x77
    codes[:, 256] = 0x77
    r = requantize_blocks(codes, scales, 512)
    assert r.exact and r.inexact_blocks == 0 and r.max_abs == 0.0
    np.testing.assert_array_equal(r.scales_per_32(), scales)
    np.testing.assert_array_equal(_values(r.codes, r.scales, 512),
                                  mxfp4_dequantize(codes, scales, (16, 1024)))
    w = rng.normal(0, 1 / 16, (16, 1024))
    once = requantize_blocks(*mxfp4_quantize(w), 512)
    twice = requantize_blocks(once.codes, once.scales_per_32(), 512)
    assert twice.exact
    np.testing.assert_array_equal(twice.codes, once.codes)
    np.testing.assert_array_equal(twice.scales, once.scales)


@pytest.mark.parametrize("batch, n_out, n_in, group, block", [(8, 256, 1024, 512, 512),
                                                          (1, 256, 1024, 512, 512),
                                                          (2, 512, 256, 128, 256)])
def test_the_mixed_fp4_dot_equals_the_emulations_dot_of_the_requantized_values(
        batch, n_out, n_in, group, block):
    """In interpret mode, one bf16 x fp4 dot per pack group (codes bitcast where they sit, two
    rows a byte, byte row a holding rows 2a and 2a + 1) times the block scale is, bit for bit,
    the emulation's "mixed_fp4" dot of the requantized values, summed group by group, at one
    row and at several (XLA's CPU sums the two differently); and not its dot of the
    checkpoint's values."""
    rng = np.random.default_rng(12)
    codes, scales = mxfp4_quantize(rng.normal(0, 1 / 32, (n_out, n_in)))
    r = requantize_blocks(codes, scales, block)
    packed, block_scales = np.ascontiguousarray(r.codes.T), np.ascontiguousarray(r.scales.T)
    x = jnp.asarray(rng.standard_normal((batch, n_in)), jnp.bfloat16)

    def fn(x, c, s):
        parts = [format_ops.fp4_group_matmul(
            x[:, g * group:(g + 1) * group], c[g * group // 2:(g + 1) * group // 2],
            format_ops.e8m0_scale(s[g * group // block:g * group // block + 1]))
                 for g in range(n_in // group)]
        return sum(parts[1:], parts[0])

    got = values_in_kernel(fn, [x, jnp.asarray(packed), jnp.asarray(block_scales)],
                           sds((batch, n_out), F32))
    w = jnp.asarray(_values(r.codes, r.scales, block), F32)                # [out, in]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(chunked_linear(x, w, group, "mixed_fp4")))
    checkpoint = jnp.asarray(mxfp4_dequantize(codes, scales, (n_out, n_in)))
    assert not np.array_equal(np.asarray(got),
                              np.asarray(chunked_linear(x, checkpoint, group, "mixed_fp4")))


def test_fp4_experts_are_refused_where_inexact_unless_rounded(hf):
    """The MINI draws (Gaussian, per-32-row scales) do not fit one scale per block: packing
    refuses, naming the spec's format line, the layer, expert, rows and the scales' spread,
    with the way out; `rounded` packs, with the graph's shapes, two codes a byte, codes and
    scales equal to the checkpoint-level requantization the references run on."""
    formats = {"expert.gate_up": _fp4(512, False), "expert.down": _fp4(128, True, "k3.sched:41")}
    with pytest.raises(FormatError) as e:
        kw.expert_arrays(hf, MINI, 2, 5, 1, TP, formats)
    msg = str(e.value)
    assert msg.startswith("k3.sched:40: `format expert.gate_up fp4 block 256` cannot hold "
                          "layer 2 expert 5's gate (w1) exactly: output 64, input rows 0-255 "
                          "take 32-row scales spanning"), msg
    assert e.value.cls == "expert.gate_up" and "`format expert.gate_up fp4 block 256 rounded`" in e.value.hint
    formats["expert.gate_up"] = _fp4(512, True)
    graph = build_graph(MINI, build(MINI, RULES, 16, formats), 16)
    a = kw.expert_arrays(hf, MINI, 2, 5, 1, TP, formats)
    assert {n: x.shape for n, x in a.items()} == {n: t.shape for n, t in graph.experts.items()}
    w = PER_RANK["expert_width"]
    assert a["gate_up_codes"].shape == (MINI.routed_expert_hidden_size // 2, 2 * w)
    assert a["down_scales"].shape == (1, MINI.routed_expert_hidden_size)
    shards = _shards()
    held, report = kw.requantization(hf, MINI, formats, shards, layers=[2])
    e5 = "model.layers.2.block_sparse_moe.experts.5."
    # the kernel's gate codes are the requantized checkpoint's, transposed; down's slice too
    gate = held[e5 + "w1.weight_packed"][w:2 * w]
    np.testing.assert_array_equal(a["gate_up_codes"][:, :w], gate.T)
    down_codes = held[e5 + "w2.weight_packed"][:, w // 2:w]
    np.testing.assert_array_equal(a["down_codes"], down_codes.T)
    np.testing.assert_array_equal(a["down_scales"][0], held[e5 + "w2.weight_scale"][:, 2])
    assert set(report) == {"expert.gate_up", "expert.down"}
    for r in report.values():
        assert not r["exact"] and 0 < r["changed"] < r["values"] and r["max_abs_error"] > 0
        assert 0.01 < r["relative_rms_error"] < 0.1
    assert report["expert.gate_up"]["format"] == "fp4 block 256 rounded"


def test_an_exactly_requantizable_checkpoint_packs_without_rounded(hf):
    """A checkpoint whose blocks fit one scale (here: the MINI draws requantized once) packs
    without `rounded`, its kernel values equal to the checkpoint's, and reports exact."""
    shards = _shards()
    rounded = {"expert.gate_up": _fp4(512, True), "expert.down": _fp4(128, True)}
    held, _ = kw.requantization(hf, MINI, rounded, shards, layers=[2])
    exact_hf = {**hf, **held}
    strict = {cls: dataclasses.replace(f, rounded=False) for cls, f in rounded.items()}
    _, report = kw.requantization(exact_hf, MINI, strict, shards, layers=[2])
    assert all(r["exact"] and r["changed"] == 0 and r["max_abs_error"] == 0 for r in report.values())
    a = kw.expert_arrays(exact_hf, MINI, 2, 5, 1, TP, strict)
    e5 = "model.layers.2.block_sparse_moe.experts.5."
    w = PER_RANK["expert_width"]
    down = a["down_codes"].T                                            # [latent, w/2]
    values = _values(down, a["down_scales"].T, w)
    want = mxfp4_dequantize(exact_hf[e5 + "w2.weight_packed"], exact_hf[e5 + "w2.weight_scale"],
                            (MINI.routed_expert_hidden_size, MINI.moe_intermediate_size))[:, w:2 * w]
    np.testing.assert_array_equal(values, want)
    assert a["down_codes"].view(ml_dtypes.float4_e2m1fn).dtype.itemsize == 1


def _shards() -> ShardTable:
    return ShardTable.of(RULES, 16)


def _mini_fp4_spec(tmp_path, rounded: bool):
    """The shipped K3 spec on the MINI layout (16 cores), both expert classes fp4 blocks (with
    `rounded` or not), its model a MINI checkpoint directory beside it (Gaussian draws: not
    exactly requantizable)."""
    import json
    import re
    import sys

    from mkc.checkpoint import save_checkpoint
    from tests_support import ROOT, k3_format_text
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import k3_mini_text
    ckpt = tmp_path / "k3_mini_ckpt"
    if not ckpt.exists():
        config = json.loads((CONFIG_DIR / "kimi_k3_mini.json").read_text())
        save_checkpoint(ckpt, config, reference.init_params(reference.load_config(config), 0))
    word = " rounded" if rounded else ""
    text = k3_mini_text(k3_format_text((f"fp4 block 512{word}", f"fp4 block 128{word}")))
    text = re.sub(r'model\s+"kimi_k3"', 'model   "k3_mini_ckpt"', text)
    spec = tmp_path / f"k3_fp4{'_rounded' * rounded}.sched"
    spec.write_text(text)
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if "format expert.gate_up" in ln)
    return spec, line


@pytest.mark.slow
def test_compile_with_a_checkpoint_refuses_or_reports_the_requantization(tmp_path):
    """`mkc compile SPEC` whose model is a checkpoint directory requantizes it as packing will:
    without `rounded`, a located diagnostic at the spec's format line (the expert, rows and
    scale spread; the hint names `rounded`), no traceback, no output written; with it, the
    error per matrix class in the text and in --json."""
    import re

    from conftest import run_python
    spec, line = _mini_fp4_spec(tmp_path, rounded=False)
    out = tmp_path / "gen"
    r = run_python(["-m", "mkc", "compile", str(spec), "-o", str(out), "--json"], timeout=900)
    assert r.returncode == 1 and "Traceback" not in r.stderr + r.stdout, r.stderr[-3000:]
    import json
    [d] = json.loads(r.stdout)["diagnostics"]
    assert (d["code"], d["line"], d["column"]) == ("E-FORMAT", line, 3), d
    assert re.match(r"`format expert\.gate_up fp4 block 256` cannot hold layer 1 expert 0's "
                    r"gate \(w1\) exactly: output \d+, input rows 0-255 take 32-row scales "
                    r"spanning [1-9] octaves? \(E8M0 \d+\.\.\d+\)", d["message"]), d["message"]
    assert "fp4 block 256 rounded" in d["hint"] and not out.exists()
    spec, _ = _mini_fp4_spec(tmp_path, rounded=True)
    r = run_python(["-m", "mkc", "compile", str(spec), "-o", str(out), "--json"], timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(r.stdout)["requantization"]
    assert set(rep) == {"expert.gate_up", "expert.down"}
    for cls, x in rep.items():
        assert x["measured"] and not x["exact"] and 0 < x["changed"] < x["values"], (cls, x)
        assert 0.01 < x["relative_rms_error"] < 0.1 and x["max_abs_error"] > 0
    r = run_python(["-m", "mkc", "compile", str(spec), "-o", str(out)], timeout=900)
    assert r.returncode == 0 and "requantization: expert.gate_up (fp4 block 256 rounded): " in r.stdout
