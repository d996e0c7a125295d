"""mkc.numerics: how a run summary is judged against the rounding emulation (the "exact" and
"flips" checks, the same at every step: each starts from the kernel's own state), the harness's
near-tie rule, and the emulation's dot at any batch. The
interpret-mode runs that produce real summaries are in test_interpret_mini.py and
test_k3_interpret.py (slow tier)."""
import importlib
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mkc import numerics


def _step(i: int, logits: float, logits_frob: float, states: float) -> dict:
    return {"step": i, "logits_max_abs_err": 0.0, "logits_max_abs": 1.0, "next_token": [1],
            "ref_next_token": [1], "state_rel_err": {"conv_state": 1e-3},
            "emulation": {"logits": logits, "logits_frob": logits_frob,
                          "states": {"conv_state": states, "latent_cache": 0.0}}}


def _summary(check, *steps) -> dict:
    return {"family": "kimi_k3", "emulation_check": check, "steps": list(steps)}


def test_flips_check_accepts_sparse_flips_and_rejects_a_one_percent_error():
    flips = numerics.EMULATION_FLIPS
    # Measured on K3 MINI (see mkc.numerics): the kernel's first step, and the weakest mutant.
    assert numerics.failures(_summary("flips", _step(0, 2e-4, 1.8e-4, 7.2e-7))) == []
    fails = numerics.failures(_summary("flips", _step(0, 5e-3, 4.9e-3, 3.6e-3)))
    assert len(fails) == 2 and all("rounding emulation" in f for f in fails), fails
    # Each metric on its own: the largest logit error is not the flips statistic.
    assert numerics.failures(_summary("flips", _step(0, 1.0, 0.5 * flips["logits_frob"], 0))) == []
    assert numerics.failures(_summary("flips", _step(0, 0, 2 * flips["logits_frob"], 0)))
    assert numerics.failures(_summary("flips", _step(0, 0, 0, 2 * flips["states"])))


def test_exact_check_is_f32_rounding_and_no_check_only_reports():
    sparse = _step(0, 2e-4, 1.8e-4, 7.2e-7)
    assert numerics.failures(_summary("exact", sparse))
    assert numerics.failures({**_summary(None, sparse), "strict_emulation": True})
    assert numerics.failures(_summary(None, sparse)) == []
    assert numerics.failures(_summary("exact", _step(0, 1e-6, 1e-6, 1e-6))) == []
    with pytest.raises(ValueError):
        numerics.failures(_summary("loose", sparse))


def test_every_step_is_held_to_the_first_steps_bound():
    """A later step starts from the kernel's own state, so it gets no drift allowance: a 1 %
    error that shows only from step 1 on (a state-only op) fails there as it would at step 0."""
    exact = numerics.EMULATION_EXACT
    assert numerics.emulation_bounds("exact") == {"logits": exact, "states": exact}
    fine = [_step(i, 0.5 * exact, 0, 0.5 * exact) for i in range(4)]
    assert numerics.failures(_summary("exact", *fine)) == []
    late = fine[:3] + [_step(3, 0, 0, 2 * exact)]
    fails = numerics.failures(_summary("exact", *late))
    assert fails == [f"step 3: conv_state differs from the rounding emulation by {2 * exact:.3g} "
                     f"(x2 the exact bound {exact:.3g})"], fails
    with pytest.raises(ValueError):
        numerics.emulation_bounds("loose")


def test_a_step_with_every_row_a_near_tie_is_not_judged_plainly_but_by_the_emulation():
    step = {**_step(0, 0, 0, 0), "logits_max_abs_err": 0.0, "logits_max_abs": 0.0,
            "next_token": [], "ref_next_token": []}
    assert numerics.failures(_summary("exact", step)) == []
    assert numerics.failures(_summary("exact", {**step, "emulation": _step(0, 1e-3, 0, 0)["emulation"]}))


def _harness():
    import sys

    from tests_support import ROOT
    sys.path.insert(0, str(ROOT / "examples"))
    import generated_module
    return generated_module


def test_a_step_line_says_how_many_rows_the_plain_reference_covered():
    """Every row a near-tie: the plain comparison covered none, and the line says so rather
    than print an error of 0 of 0; some: it names how many."""
    plain_summary = _harness().plain_summary
    rec = {"rows": [0, 1], "plain_rows": [], "logits_max_abs_err": 0.0, "logits_max_abs": 0.0,
           "state_rel_err": {}}
    assert plain_summary(rec) == "plain reference: 0 of 2 rows (near-ties)"
    rec = {**rec, "plain_rows": [1], "logits_max_abs_err": 0.01, "logits_max_abs": 9.5,
           "state_rel_err": {"conv": 2e-3}}
    assert plain_summary(rec) == ("plain reference (1 of 2 rows, the rest near-ties): logits "
                                  "|err| 0.0100 of 9.50, states conv 2.0e-03")
    assert plain_summary({**rec, "plain_rows": [0, 1]}).startswith("plain reference: logits")


def test_near_ties_are_the_rows_whose_margin_a_measured_difference_could_cross():
    """The plain reference may pick otherwise only where the emulation's margin is at most twice
    the largest difference between the two runs' scores in that row; other rows must match."""
    near_ties = _harness().near_ties
    emu = np.array([[0.9, 0.5, 0.1], [0.6, 0.59, 0.1], [0.6, 0.55, 0.1]], np.float32)
    plain = emu + np.array([[0.01, 0, 0], [0.001, 0, 0], [0, 0.03, 0]], np.float32)
    logits = np.array([[3.0, 1.0], [3.0, 1.0], [3.0, 1.0]], np.float32)
    ties = near_ties([(emu, 1)], [(plain, 1)], logits, logits)
    # row 0: margin 0.4 > 2 x 0.01; row 1: 0.01 > 2 x 0.001; row 2: 0.05 <= 2 x 0.03
    assert sorted(ties["routing"]) == [2] and ties["token"] == {}
    assert "margin 5.00e-02 <= 2 x 3.00e-02" in ties["routing"][2]
    close = np.array([[2.0, 1.99], [3.0, 1.0], [2.0, 1.99]], np.float32)
    ties = near_ties([], [], close, close + np.float32([[0.01, 0], [0.01, 0], [0.01, 0]]))
    assert sorted(ties["token"]) == [0, 2] and ties["routing"] == {}


def test_a_state_only_mutant_edits_one_lowering_function_of_its_own_module_only():
    """LOWERING_MUTANTS bind an edited copy of one lowering function into the mutant module;
    the family's lowering module, and so an unmutated module in the same process, keep theirs."""
    gm = _harness()
    from mkc.layers.gated_delta_net import lowering
    from tests_support import ROOT

    original = lowering.delta_rule
    mutant = gm.load_generated(ROOT / "schedules" / "qwen3_5_35b_a3b.sched", "qwen3_5_moe_mini",
                               "gdn.decay")
    plain = gm.load_generated(ROOT / "schedules" / "qwen3_5_35b_a3b.sched", "qwen3_5_moe_mini")
    # the modules call their lowering through `lower`, which runs each body in its op's name
    # scope (mkc.runtime.scopes); a composed kind's body is the library function, options bound
    assert lowering.delta_rule is original and plain.lower.body("gdn", "delta_rule").func is original
    assert mutant.lower.body("gdn", "delta_rule").func is not original
    assert mutant.lower.body("gdn", "conv").func is lowering.conv
    edited = mutant.lower.body("gdn", "delta_rule").func
    assert edited.__code__.co_filename.startswith("<mutant gdn.decay of ")
    for name, (func, old, _) in gm.LOWERING_MUTANTS.items():   # each edit matches exactly once
        family = {"gdn": "qwen3_5", "gqa": "qwen3_5", "oss": "gpt_oss"}.get(name.split(".")[0], "kimi_k3")
        # the gated residuals' (no shipped family composes them yet): the library's lowering
        module = importlib.import_module("mkc.layers.gated_residuals.lowering" if name.startswith("gres.")
                                         else f"mkc.families.{family}.lowering")
        assert inspect.getsource(gm.lowering_function(module, func)).count(old) == 1, name


@pytest.mark.parametrize("batch", [1, 2, 8])
def test_the_emulations_dot_is_the_kernels_at_any_batch(batch):
    """A ring-tiled matmul as the kernel runs it in interpret mode (bf16 activation tiles times
    [in, out] weight tiles, f32 partial sums added tile by tile) equals the emulation's
    ``chunked_linear`` bit for bit, at one row as at several: XLA's CPU picks its dot routine
    by shape and operand layout (on an AVX512-BF16 host a one-row dot of an [out, in] weight
    sums otherwise), and the emulation's dot reads the weight as the kernel's does, traced or
    not."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    from mkc.reference.rounding import chunked_linear

    rows, n_in, n_out = 128, 384, 256
    rng = np.random.default_rng(batch)
    x = jnp.asarray(rng.normal(size=(batch, n_in)), jnp.bfloat16)
    w = jnp.asarray(rng.normal(size=(n_out, n_in)) / 16, jnp.bfloat16)        # [out, in]

    def body(x_ref, w_ref, o_ref):
        for i in range(n_in // rows):
            part = jnp.dot(x_ref[:, i * rows:(i + 1) * rows], w_ref[i * rows:(i + 1) * rows, :],
                           preferred_element_type=jnp.float32)
            o_ref[...] = part if i == 0 else o_ref[...] + part

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    kernel = pl.pallas_call(body, out_shape=jax.ShapeDtypeStruct((batch, n_out), jnp.float32),
                            in_specs=[vmem, vmem], out_specs=vmem,
                            interpret=pltpu.InterpretParams())(x, jnp.transpose(w))
    traced = jax.jit(chunked_linear, static_argnums=(2, 3))
    for emulated in (chunked_linear(x, w, rows, "bf16"), traced(x, w, rows, "bf16")):
        np.testing.assert_array_equal(np.asarray(kernel), np.asarray(emulated))


def test_rounding_carries_the_kernels_tiles_from_the_ir():
    """The emulation sums a streamed matrix ring tile by ring tile and reads the MLA cache in
    the spec's KV tiles: both come from the schedule IR."""
    from mkc import compiler
    from tests_support import K3_SPEC, ROOT

    ir = compiler.check_spec(K3_SPEC, None).ir
    rounding = numerics.rounding_from_ir(ir)
    for fams in (*ir.stream.families.values(), ir.stream.tail):
        for f in fams:
            assert rounding.tile_rows(f.kind, f.name) == f.tile_rows
    assert rounding.tile_rows("kda", "projection") is None       # pooled: one dot
    assert rounding.kv_tile("mla") == ir.kinds["mla"].kv.tokens
    # The emulated residual mixture runs over every source slot of the kernel's block buffer.
    from mkc.families.kimi_k3 import reference
    from mkc.layers import block_residuals

    cfg = reference.load_config(ROOT / "mkc/model/configs/kimi_k3.json")
    assert block_residuals.slots(cfg) == next(b.shape[0] for b in ir.buffers if b.name == "blocks")


def test_chunked_linear_sums_tile_by_tile_in_order():
    from mkc.reference.rounding import chunked_linear

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 10)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(3, 10)), jnp.float32)
    want = (x[:, :4] @ w[:, :4].T + x[:, 4:8] @ w[:, 4:8].T) + x[:, 8:] @ w[:, 8:].T
    np.testing.assert_array_equal(chunked_linear(x, w, 4), want)
    np.testing.assert_allclose(chunked_linear(x, w, None), x @ w.T, rtol=1e-6)
    np.testing.assert_array_equal(chunked_linear(x, w, 10), chunked_linear(x, w, None))


def test_k3_emulation_pack_groups_follow_the_kernels_layout():
    """The K3 emulation's MXFP4 pack groups (of its config's expert input) are the graph's."""
    from mkc.families.kimi_k3.config import KimiDims
    from mkc.families.kimi_k3.graph import MOE
    from mkc.layers import expert_formats
    from mkc.model.config import CONFIG_DIR

    for name in ("kimi_k3_mini.json", "kimi_k3.json"):
        dims = KimiDims.load(CONFIG_DIR / name)
        rows = {"gate_up": dims.routed_expert_hidden_size, "down": dims.moe_intermediate_size // 4}
        assert expert_formats.pack_groups(rows) == MOE.pack_groups(dims, 4)


def test_mutants_by_row_scale_their_own_row_only():
    """`--mutants-by-row`: `{scale}` scales row `row` of axis 0 by 1.01 (in f32, back to the
    dtype), every other row bit for bit; `{factor}(b)` is 1.01 for that row only; one module
    takes several mutants, each edit bound to its own row."""
    gm = _harness()
    from tests_support import ROOT

    x = jnp.asarray(np.arange(24, dtype=np.float32).reshape(4, 6) + 1.0, jnp.bfloat16)
    got = np.asarray(gm.mutant_scale(2)(x), np.float32)
    want = np.asarray(x, np.float32)
    np.testing.assert_array_equal(np.delete(got, 2, axis=0), np.delete(want, 2, axis=0))
    assert np.all(got[2] > want[2])
    assert np.all(np.asarray(gm.mutant_scale(None)(x), np.float32) > want)
    assert [gm.mutant_factor(1)(b) for b in range(3)] == [1.0, 1.01, 1.0]
    module = gm.load_generated(ROOT / "schedules" / "qwen3_8_27b.sched", "qwen3_8_mini",
                               {"gqa.o_proj": 0, "gdn.decay": 1})
    source = open(module.__file__).read()
    assert "attn_out = _mutant_scale_0(lower.o_proj(c, core))" in source
    assert module._mutant_scale_0 is not module._mutant_scale_1
    assert "<mutant gdn.decay of " in module.lower.body("gdn", "delta_rule").func.__code__.co_filename
    with pytest.raises(ValueError, match="unknown mutants"):
        gm.load_generated(ROOT / "schedules" / "qwen3_8_27b.sched", "qwen3_8_mini", "gqa.typo")
