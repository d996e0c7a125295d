"""A generated module's inputs checked against what it was compiled for, before anything is
traced: a step's weights, state, tokens and positions, a verify step's accepted counts, and
the HF weights it packs.

A state made for another batch, weights from another module, float tokens or a position past
the KV cache would otherwise surface as an XLA shape error from inside the jitted step or, on a
TPU, as an out-of-bounds DMA. Shapes and dtypes are always checked (no device work). Token and
position values are checked when they are host values (numpy arrays, lists, ints); values
already on a device are not read back, since that would stall the step behind the previous one.
"""
from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import jax
import numpy as np

Shapes = Mapping[str, tuple[tuple[int, ...], object]]


def check_step_inputs(weights: Mapping, state: Mapping, tokens, positions, *,
                      weight_shapes: Shapes, state_shapes: Callable[[int], Shapes], ranks: int,
                      context: int, vocab: int, rows: int | None = None) -> int:
    """The number of sequences S of a decode step (tokens [S], positions [S]) or, with `rows`
    R, of a verify step (tokens [S, R], starts [S]); ValueError saying what is wrong and what
    to pass otherwise."""
    where = "positions" if rows is None else "starts"
    token_shape, position_shape = _integers("tokens", tokens), _integers(where, positions)
    want_ndim = 1 if rows is None else 2
    if len(token_shape) != want_ndim or (rows is not None and token_shape[1] != rows):
        form = "[S]" if rows is None else f"[S, {rows}]"
        raise ValueError(f"tokens has shape {token_shape}; this step takes tokens{form}")
    S = token_shape[0]
    if position_shape != (S,):
        raise ValueError(f"{where} has shape {position_shape}; {S} sequences need {where}[{S}]")
    _same_arrays("weights", weights, weight_shapes, ranks,
                 "pass what this module's place_weights or pack_weights returned")
    _same_arrays("state", state, state_shapes(S), ranks,
                 f"a state for {S} sequences comes from init_state({S}) or place_state({S}, mesh)")
    if not isinstance(tokens, jax.Array):
        _within("tokens", np.asarray(tokens), 0, vocab, f"the vocabulary has {vocab} tokens")
    if not isinstance(positions, jax.Array):
        what = "a row's position" if rows is None else f"a sequence's {rows} rows from starts[s]"
        _within(where, np.asarray(positions), 0,
                context - (rows or 1) + 1, f"{what} must stay within the KV cache of {context} "
                "tokens (the spec's context)")
    return S


def check_accepted(accepted, sequences: int, rows: int) -> None:
    """A verify step's accepted row counts: integers, one per sequence, each 0..rows when they
    are host values (a count past the rows would gather a clamped, wrong state)."""
    shape = _integers("accepted", accepted)
    if shape != (sequences,):
        raise ValueError(f"accepted has shape {shape}; {sequences} sequences need accepted"
                         f"[{sequences}]")
    if not isinstance(accepted, jax.Array):
        _within("accepted", np.asarray(accepted), 0, rows + 1,
                f"a sequence accepts 0 to {rows} rows of the verify step")


EMBEDDING = "model.embed_tokens.weight"
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_hf_weights(hf: Mapping, dims) -> None:
    """HF-named weights for the model a module was compiled for: its embedding's shape and its
    layer count (weights of another config would otherwise fail deep in the packing with a
    broadcast error, or, with more layers, pack silently)."""
    layers = {int(m.group(1)) for name in hf if (m := _LAYER.match(name))}
    embedding = tuple(np.shape(hf[EMBEDDING])) if EMBEDDING in hf else None
    want = (dims.vocab_size, dims.hidden_size)
    if embedding != want or layers != set(range(dims.num_hidden_layers)):
        found = "no embedding" if embedding is None else f"an embedding of {list(embedding)}"
        raise ValueError(
            f"the weights are not {dims.name}'s: they hold {found} and layers "
            f"{_ranges(sorted(layers))}; this module was compiled for vocabulary x hidden "
            f"{list(want)} and layers 0-{dims.num_hidden_layers - 1}. Compile the spec against "
            "the checkpoint (`mkc compile SPEC --model DIR`), or load the one its config describes")


def _ranges(values: list[int]) -> str:
    if not values:
        return "none"
    runs, start = [], values[0]
    for a, b in zip(values, values[1:] + [None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a > start else f"{a}")
            start = b
    return ", ".join(runs)


def _integers(name: str, values) -> tuple[int, ...]:
    dtype = getattr(values, "dtype", None)
    if dtype is None:
        values = np.asarray(values)
        dtype = values.dtype
    if not np.issubdtype(dtype, np.integer):
        raise ValueError(f"{name} must be integers, not {dtype}")
    return tuple(np.shape(values))


def _same_arrays(what: str, arrays: Mapping, shapes: Shapes, ranks: int, how: str) -> None:
    missing, extra = sorted(set(shapes) - set(arrays)), sorted(set(arrays) - set(shapes))
    if missing or extra:
        raise ValueError(f"{what} does not match this module: missing {missing}, unexpected "
                         f"{extra}; {how}")
    for name, (shape, dtype) in shapes.items():
        want, got = (ranks, *shape), tuple(np.shape(arrays[name]))
        got_dtype = getattr(arrays[name], "dtype", None)
        if got != want or (got_dtype is not None and np.dtype(got_dtype) != np.dtype(dtype)):
            raise ValueError(f"{what}[{name!r}] is {got_dtype}{list(got)}, this module's is "
                             f"{np.dtype(dtype)}{list(want)}; {how}")


def _within(name: str, values: np.ndarray, lo: int, hi: int, why: str) -> None:
    bad = np.argwhere((values < lo) | (values >= hi))
    if bad.size:
        at = tuple(int(i) for i in bad[0])
        index = ", ".join(map(str, at))
        raise ValueError(f"{name}[{index}] = {int(values[at])} is outside {lo} to {hi - 1}: {why}")
