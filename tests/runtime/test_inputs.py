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
               in qwen._hbm_shapes().items()}
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


@pytest.mark.parametrize("config", ["qwen3_8_mini", "qwen3_5_moe_mini", "kimi_k3_mini", "kimi_k3"])
def test_hf_weights_of_the_compiled_config_pass_and_of_another_do_not(config):
    """Every family's upstream parameter names (`param_shapes`) pass for the dims they were made
    from; dropping a layer, adding one or changing the hidden size is refused."""
    import json

    from mkc import families
    from mkc.runtime.inputs import check_hf_weights
    raw = json.loads((ROOT / "mkc" / "model" / "configs" / f"{config}.json").read_text())
    family = families.for_model_type(raw.get("model_type"))
    dims = family.read_dims(raw, config)
    reference = family.module("reference")
    shapes = reference.param_shapes(reference.load_config(raw))
    hf = {name: np.empty(shape, np.int8) if name.endswith("embed_tokens.weight") else 0
          for name, (shape, _) in shapes.items()}
    check_hf_weights(hf, dims)
    last = dims.num_hidden_layers - 1
    for bad in ({n: v for n, v in hf.items() if not n.startswith(f"model.layers.{last}.")},
                dict(hf, **{f"model.layers.{last + 1}.mlp.down_proj.weight": 0}),
                dict(hf, **{"model.embed_tokens.weight": np.empty((dims.vocab_size, 8))})):
        with pytest.raises(ValueError, match=f"the weights are not {config}'s"):
            check_hf_weights(bad, dims)
