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

import functools
import importlib
import json
from collections.abc import Callable, Mapping

import jax
import numpy as np

from mkc.model.family import stored_dtypes

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


def check_commit(state: Mapping, verified: Mapping, accepted, *, state_shapes: Callable[..., Shapes],
                 ranks: int, row_states: Mapping[str, int], verify_rows: int) -> int:
    """A commit's inputs: the row states of a decode state of S sequences, the output of a
    verify step of R rows for those S sequences, and S accepted counts (``check_accepted``);
    R. A verify output of another batch would otherwise gather a malformed state."""
    name, axis = next(iter(row_states.items()))
    if name not in state or name not in verified:
        raise ValueError(f"commit needs the row states {sorted(row_states)} in both the state and "
                         "the verify step's output")
    S = np.shape(state[name])[axis + 2]                    # past the rank and layer axes
    _same_arrays("state", {n: state[n] for n in row_states if n in state},
                 {n: state_shapes(S)[n] for n in row_states}, ranks,
                 f"pass the state of {S} sequences the verify step started from")
    entries = np.shape(verified[name])[axis + 2]
    R = entries // S
    if entries % S or not 1 <= R <= verify_rows:
        raise ValueError(f"the verify output holds {entries} rows of {name}, not R rows (1 to "
                         f"{verify_rows}) of the state's {S} sequences: commit the output of the "
                         "verify step that started from this state")
    _same_arrays("verify output", verified, state_shapes(S, R), ranks,
                 f"pass what verify_step returned for these {S} sequences")
    check_accepted(accepted, S, R)
    return R


_MAX_LISTED = 12


def expected_hf_weights(package: str, config: Mapping) -> dict[str, tuple[tuple[int, ...], str]]:
    """The HF tensors a module compiled for `config` packs: name -> (shape, dtype), from the
    table (``param_shapes``) of the reference of the family in `package`, whose upstream names
    the packing reads."""
    return _table(package, json.dumps(config, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _table(package: str, config_json: str) -> dict[str, tuple[tuple[int, ...], str]]:
    # cached: pack_rank checks once per rank, and full K3's table has 497,052 tensors (2.4 s)
    reference = importlib.import_module(f"{package}.reference")
    return reference.param_shapes(reference.load_config(json.loads(config_json)))


def _integer_fields(config: Mapping, prefix: str = "") -> list[tuple[str, int]]:
    out = []
    for key, value in config.items():
        if type(value) is int and value > 0:
            out.append((prefix + key, value))
        elif isinstance(value, Mapping):
            out += _integer_fields(value, f"{prefix}{key}.")
    return out


def _with(config: Mapping, path: str, value: int) -> dict:
    head, _, rest = path.partition(".")
    out = dict(config)
    out[head] = _with(config[head], rest, value) if rest else value
    return out


def deciding_fields(package: str, config: Mapping, names: list[str]) -> dict[str, dict[int, list[str]]]:
    """For each of `names`, per axis of its shape, the config fields that set it: measured, not
    listed by hand, by changing each integer field (doubled, else plus one, where the family
    accepts it) and seeing which axes of which tensors move."""
    base = expected_hf_weights(package, config)
    out: dict[str, dict[int, list[str]]] = {n: {} for n in names}
    for path, value in _integer_fields(config):
        for trial in (2 * value, value + 1):
            try:
                shapes = expected_hf_weights(package, _with(config, path, trial))
            except Exception:       # a value the family refuses (divisibility, ranges): next
                continue
            for n in names:
                if n in shapes:
                    for axis, (a, b) in enumerate(zip(shapes[n][0], base[n][0])):
                        if a != b:
                            out[n].setdefault(axis, []).append(path)
            break
    return out


def check_hf_weights(hf: Mapping, package: str, dims, config: Mapping) -> None:
    """HF-named weights against the config a module was compiled for, before anything is packed:
    every tensor its family's table names present, no other, each of its shape, integer codes
    (MXFP4) as uint8 and floats as bf16, f16 or f32. Every mismatch is listed in one
    ValueError, a wrong shape with the config fields that decide it (a tensor one column off
    would otherwise be padded or truncated into the kernel, and a transposed or missing one end
    in a broadcast or KeyError deep in the packing)."""
    expected = expected_hf_weights(package, config)
    missing = [n for n in expected if n not in hf]
    unexpected = sorted(n for n in hf if n not in expected)
    wrong: dict[str, str] = {}
    # numpy dtypes, not names: a dtype's `.name` costs 4 us, 2 s over full K3's tensors
    accepted = {d: frozenset(map(np.dtype, stored_dtypes(d)))
                for d in {dtype for _, dtype in expected.values()}}
    for name, (shape, dtype) in expected.items():      # 497,052 tensors for full K3: kept lean
        a = hf.get(name)
        if a is None:
            continue
        if not hasattr(a, "dtype"):
            a = np.asarray(a)
        if a.shape != tuple(shape):
            wrong[name] = f"shape {list(a.shape)}, expected {list(shape)}"
        elif a.dtype not in accepted[dtype]:
            wanted = " or ".join(sorted(stored_dtypes(dtype)))
            wrong[name] = f"dtype {a.dtype.name}, expected {wanted}"
    if not (missing or unexpected or wrong):
        return
    shown = list(wrong.items())[:_MAX_LISTED]
    misshapen = [n for n, why in shown if why.startswith("shape")]
    # each field perturbed costs a whole table (0.7 s for full K3): only when a shape is wrong
    fields = deciding_fields(package, config, misshapen) if misshapen else {}
    lines = []
    for name, why in shown:
        want, got = expected[name][0], tuple(np.shape(hf[name]))
        axes = fields.get(name, {})
        # the axes that differ (all of them when the rank does)
        off = [a for a in axes if len(got) != len(want) or got[a] != want[a]]
        decided = sorted({f for a in off for f in axes[a]})
        lines.append(f"{name}: {why}" + (f" (set by {', '.join(decided)})" if decided else ""))
    if len(wrong) > _MAX_LISTED:
        lines.append(f"... and {len(wrong) - _MAX_LISTED} more of the wrong shape or dtype")
    for what, names in (("missing", missing), ("unexpected", unexpected)):
        if names:
            shown = ", ".join(names[:_MAX_LISTED])
            more = f" ... and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
            lines.append(f"{len(names)} {what} tensor(s): {shown}{more}")
    raise ValueError(
        f"the weights do not match {dims.name}, the config this module was compiled for "
        f"({dims.num_hidden_layers} layers, hidden {dims.hidden_size}); nothing was packed:\n  "
        + "\n  ".join(lines) + "\nCompile the spec against the checkpoint's config (`mkc compile "
        "SPEC --model DIR`), or load the weights its config describes")


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
