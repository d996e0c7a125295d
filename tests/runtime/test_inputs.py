"""`mkc.runtime.inputs`: a step's inputs that do not fit the schedule are a ValueError naming
the input, what it is and what to pass; device-held values are not read back."""
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from mkc.runtime.inputs import check_step_inputs
from tests_support import ROOT, SPEC

RANKS, CONTEXT, VOCAB = 2, 64, 100
WEIGHTS = {"embed": ((50, 8), jnp.bfloat16), "ring_hbm": ((4, 16, 16), jnp.bfloat16)}


def _state_shapes(S: int) -> dict:
    return {"kv": ((1, S, CONTEXT, 4), jnp.bfloat16), "rec": ((1, S, 4, 4), jnp.float32)}


def _arrays(shapes) -> dict:
    return {n: np.zeros((RANKS, *shape), dtype) for n, (shape, dtype) in shapes.items()}


def check(tokens, positions, state=None, weights=None, rows=None) -> int:
    S = np.shape(tokens)[0]
    return check_step_inputs(_arrays(WEIGHTS) if weights is None else weights,
                             _arrays(_state_shapes(S)) if state is None else state, tokens,
                             positions, weight_shapes=WEIGHTS, state_shapes=_state_shapes,
                             ranks=RANKS, context=CONTEXT, vocab=VOCAB, rows=rows)


def test_inputs_that_fit_give_the_sequence_count():
    assert check(np.array([1, 99], np.int32), [0, CONTEXT - 1]) == 2
    assert check(np.zeros((3, 4), np.int64), np.array([0, 10, CONTEXT - 4]), rows=4) == 3
    assert check(jnp.array([5]), jnp.array([3])) == 1


@pytest.mark.parametrize("tokens, positions, rows, message", [
    ([1.0, 2.0], [0, 1], None, "tokens must be integers, not float64"),
    (np.zeros((2, 1), np.int32), [0, 1], None, "tokens has shape (2, 1); this step takes tokens[S]"),
    ([1, 2], [0, 1, 2], None, "positions has shape (3,); 2 sequences need positions[2]"),
    ([1, 2], [0.5, 1], None, "positions must be integers"),
    ([1, VOCAB], [0, 1], None, f"tokens[1] = {VOCAB} is outside 0 to {VOCAB - 1}"),
    ([-1, 2], [0, 1], None, "tokens[0] = -1 is outside"),
    ([1, 2], [0, CONTEXT], None, f"positions[1] = {CONTEXT} is outside 0 to {CONTEXT - 1}: a "
                                 f"row's position must stay within the KV cache of {CONTEXT}"),
    ([1, 2], [-3, 1], None, "positions[0] = -3 is outside"),
    (np.zeros((2, 4), np.int32), [0, CONTEXT - 3], 4,
     f"starts[1] = {CONTEXT - 3} is outside 0 to {CONTEXT - 4}: a sequence's 4 rows"),
    (np.zeros((2, 3), np.int32), [0, 1], 4, "tokens has shape (2, 3); this step takes tokens[S, 4]"),
    (np.zeros(4, np.int32), [0], 4, "tokens has shape (4,); this step takes tokens[S, 4]"),
])
def test_bad_tokens_and_positions(tokens, positions, rows, message):
    with pytest.raises(ValueError) as e:
        check(tokens, positions, rows=rows)
    assert message in str(e.value)


def test_state_and_weights_from_elsewhere():
    tokens, positions = np.array([1, 2]), np.array([0, 1])
    with pytest.raises(ValueError, match=r"state\['kv'\] is bfloat16\[2, 1, 4, 64, 4\], this "
                       r"module's is bfloat16\[2, 1, 2, 64, 4\]; a state for 2 sequences comes "
                       r"from init_state\(2\)"):
        check(tokens, positions, state=_arrays(_state_shapes(4)))
    weights = _arrays(WEIGHTS)
    weights["embed"] = weights["embed"].astype(np.float32)
    with pytest.raises(ValueError, match=r"weights\['embed'\] is float32.*bfloat16\[2, 50, 8\]"):
        check(tokens, positions, weights=weights)
    with pytest.raises(ValueError, match=r"missing \['ring_hbm'\], unexpected \['other'\]"):
        check(tokens, positions, weights={"embed": weights["embed"], "other": 0})


def test_values_on_a_device_are_not_read_back():
    """A position past the cache held in a device array passes the host check (reading it back
    would stall the step); the same value on the host does not."""
    assert check(jnp.array([1, 2]), jnp.array([0, CONTEXT + 5])) == 2
    with pytest.raises(ValueError):
        check(jnp.array([1, 2]), np.array([0, CONTEXT + 5]))


def test_a_generated_modules_steps_check_before_they_trace():
    """The generated wrappers call the check first: a wrong state or position is the runtime
    check's ValueError, raised before a mesh is built or anything is traced."""
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import load_generated
    qwen = load_generated(SPEC, "qwen3_8_mini")
    weights = {n: np.zeros((qwen.RANKS, *shape), dtype) for n, (shape, dtype)
               in qwen.hbm_shapes().items()}
    tokens = np.array([1, 2], np.int32)
    with pytest.raises(ValueError, match="a state for 2 sequences comes from init_state"):
        qwen.decode_step(weights, qwen.init_state(4), tokens, np.array([0, 1]))
    with pytest.raises(ValueError, match=f"positions\\[1\\] = {qwen.CONTEXT} is outside"):
        qwen.decode_step(weights, qwen.init_state(2), tokens, np.array([0, qwen.CONTEXT]))
    with pytest.raises(ValueError, match="starts\\[0\\] = -1 is outside"):
        qwen.verify_step(weights, qwen.init_state(1), np.zeros((1, 8), np.int32), [-1])


def test_accepted_counts():
    from mkc.runtime.inputs import check_accepted
    check_accepted([0, 8], 2, 8)
    check_accepted(jnp.array([9, 1]), 2, 8)        # on a device: not read back
    for accepted, message in (([0, 9], "accepted[1] = 9 is outside 0 to 8"),
                              ([1], "accepted has shape (1,); 2 sequences need accepted[2]"),
                              ([0.0, 1.0], "accepted must be integers")):
        with pytest.raises(ValueError) as e:
            check_accepted(accepted, 2, 8)
        assert message in str(e.value)


def _hf_of(config: str):
    """(family package, dims, raw config, HF weights of that config's table as zero-memory
    views)."""
    import json

    from mkc.model import registry
    from mkc.runtime.inputs import expected_hf_weights
    raw = json.loads((ROOT / "mkc" / "model" / "configs" / f"{config}.json").read_text())
    family = registry.for_model_type(raw.get("model_type"))
    dims = family.read_dims(raw, config)
    hf = {name: np.broadcast_to(np.zeros((), dtype), shape)
          for name, (shape, dtype) in expected_hf_weights(family.package, raw).items()}
    return family.package, dims, raw, hf


@pytest.mark.parametrize("config", ["qwen3_8_mini", "qwen3_5_moe_mini", "kimi_k3_mini", "kimi_k3"])
def test_hf_weights_of_the_compiled_config_pass_and_of_another_do_not(config):
    """Every family's upstream tensors (`param_shapes`) pass for the config they were made from;
    dropping a layer, adding one or another hidden size is refused, naming the tensors."""
    from mkc.runtime.inputs import check_hf_weights
    package, dims, raw, hf = _hf_of(config)
    check_hf_weights(hf, package, dims, raw)
    last = dims.num_hidden_layers - 1
    dropped = {n: v for n, v in hf.items() if not n.startswith(f"model.layers.{last}.")}
    added = dict(hf, **{f"model.layers.{last + 1}.mlp.down_proj.weight": np.zeros((2, 2))})
    narrow = dict(hf, **{"model.embed_tokens.weight": np.empty((dims.vocab_size, 8), np.float32)})
    cases = [(dropped, f"missing tensor(s): model.layers.{last}."),
             (added, f"1 unexpected tensor(s): model.layers.{last + 1}.mlp.down_proj.weight")]
    if config != "kimi_k3":     # a wrong shape measures its fields on 497,052-tensor tables
        cases.append((narrow, f"model.embed_tokens.weight: shape [{dims.vocab_size}, 8], expected "
                              f"[{dims.vocab_size}, {dims.hidden_size}] (set by hidden_size)"))
    for bad, says in cases:
        with pytest.raises(ValueError, match=f"the weights do not match {config}, the config") as e:
            check_hf_weights(bad, package, dims, raw)
        assert says in str(e.value)


def test_every_wrong_tensor_is_named_in_one_error_with_the_fields_that_set_its_shape():
    """One column short, transposed, 1-D, of an integer dtype, missing: all in one error,
    nothing packed; a checkpoint made with another intermediate_size names every MLP matrix."""
    from mkc.runtime.inputs import check_hf_weights
    package, dims, raw, hf = _hf_of("qwen3_8_mini")
    down = "model.layers.0.mlp.down_proj.weight"
    gate = "model.layers.1.mlp.gate_proj.weight"
    norm = "model.layers.2.input_layernorm.weight"
    out, inp = hf[down].shape
    bad = dict(hf, **{down: np.zeros((out, inp - 1), np.float32), gate: hf[gate].T,
                      norm: np.zeros((hf[norm].shape[0], 1), np.float32),
                      "model.norm.weight": hf["model.norm.weight"].astype(np.int32)})
    del bad["model.layers.3.mlp.up_proj.weight"]
    with pytest.raises(ValueError) as e:
        check_hf_weights(bad, package, dims, raw)
    text = str(e.value)
    assert f"{down}: shape [{out}, {inp - 1}], expected [{out}, {inp}] (set by " in text
    assert "intermediate_size" in text.split(down)[1].splitlines()[0]
    assert f"{gate}: shape {list(hf[gate].T.shape)}" in text and f"{norm}: shape" in text
    assert "model.norm.weight: dtype int32, expected bfloat16 or float16 or float32" in text
    assert "1 missing tensor(s)" in text and "nothing was packed" in text

    from mkc.runtime.inputs import expected_hf_weights
    other = dict(raw, intermediate_size=raw["intermediate_size"] * 2)
    theirs = {n: np.broadcast_to(np.zeros((), d), shape)
              for n, (shape, d) in expected_hf_weights(package, other).items()}
    with pytest.raises(ValueError) as e:
        check_hf_weights(theirs, package, dims, raw)
    mlp = [n for n in hf if ".mlp." in n]
    assert f"and {len(mlp) - 12} more of the wrong shape" in str(e.value)
    assert str(e.value).count("(set by intermediate_size)") == 12


def test_commit_refuses_a_verify_output_of_other_batches_and_clamps_device_counts():
    """`commit` checks its state and verify output against each other (S sequences, R rows)
    and its host-side counts; counts on a device are not read back but clamped to 0..R, as its
    docstring says (a count past R gathered past the rows: NaN states)."""
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import load_generated
    qwen = load_generated(SPEC, "qwen3_8_mini")

    def arrays(S, R=1):
        out = {}
        for name, (shape, dtype) in qwen.state_shapes(S, R).items():
            a = np.zeros((qwen.RANKS, *shape), dtype)
            if name in qwen.ROW_STATES:      # entry e of a row state holds e + 1
                axis = qwen.ROW_STATES[name] + 2
                index = [None] * a.ndim
                index[axis] = slice(None)
                a[...] = (np.arange(shape[axis - 1]) + 1)[tuple(index)]
            out[name] = a
        return out

    state, verified = arrays(2), arrays(2, 3)
    rows = {n: state[n] for n in qwen.ROW_STATES}
    exact = qwen.commit(rows, verified, np.array([3, 1]))
    clamped = qwen.commit(rows, verified, jnp.array([9, 1]))
    for name in qwen.ROW_STATES:
        np.testing.assert_array_equal(np.asarray(clamped[name]), np.asarray(exact[name]))
        assert np.all(np.isfinite(np.asarray(clamped[name], np.float32)))
    with pytest.raises(ValueError, match="accepted\\[0\\] = 4 is outside 0 to 3"):
        qwen.commit(rows, verified, np.array([4, 1]))
    with pytest.raises(ValueError, match="pass what verify_step returned for these 1 sequences"):
        qwen.commit({n: arrays(1)[n] for n in qwen.ROW_STATES}, verified, np.array([1]))
    with pytest.raises(ValueError, match="holds 6 rows of .*, not R rows \\(1 to 8\\) of the state's 4"):
        qwen.commit({n: arrays(4)[n] for n in qwen.ROW_STATES}, verified, np.array([1, 1, 1, 1]))
