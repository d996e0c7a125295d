"""A library layer kind's lowered bodies (`mkc.layers.<kind>.lowering`, the functions the
generated module calls) run on values against its f32 reference (`mkc.layers.<kind>.reference.
forward`): the ops in program order, each passed the values it reads (as `mkc.resolve.phases`
lists them: not a tensor, not x), on a stand-in for the kernel's `Layer` that holds one rank's
weights as the kind's `weights` module packs them (one rank: every shard class one way), caches
and states in the kernel's layouts (`weights.kernel_states`), the host's rotary table
(`mkc.layers.rope.host_inputs`) and the residual stream. What the stand-in does is the runtime's
(a matmul, a pooled read, a KV tile, a slot's expert), dense f32 here; everything else is the
body's own, so an error in a body shows as a difference from the reference."""
from __future__ import annotations

import contextlib
import math
import sys
import types
from collections.abc import Callable, Mapping
from typing import Any
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np

from mkc.layers import rope
from mkc.layers.sublayer import Sublayer
from mkc.model.sharding import ShardTable
from mkc.runtime import kv as kv_cache

F32 = jnp.float32
PREFIX = "model.layers.0."
CLASSES = ("expert_mlp", "experts", "heads", "latent_down", "latent_up", "mlp", "router", "vocab")
ONE_RANK = ShardTable(1, tuple((c, 1, 1) for c in CLASSES))
HIGHEST = jax.lax.Precision.HIGHEST


class Buffer:
    """A VMEM ref stand-in: reads index the array, writes replace it."""

    def __init__(self, value: Any) -> None:
        self.value = jnp.asarray(value)

    def __getitem__(self, index):
        return self.value[index]

    def __setitem__(self, index, new) -> None:
        self.value = self.value.at[index].set(jnp.asarray(new).astype(self.value.dtype))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.value.shape


def bf16(a: np.ndarray) -> np.ndarray:
    """Values a bf16 cache holds exactly, as f32."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(F32))


def draw_params(sub: Sublayer, d: Any, seed: int, spread: float = 0.3) -> dict[str, np.ndarray]:
    """The kind's upstream parameters under `PREFIX`, f32: the kind's own draws where it has
    them (`reference.init_weight`), norm weights `1 + N(0, spread)` (never all one, so a norm's
    weight acts; a zero-centred norm then weighs by about 2), biases N(0, spread), matrices
    N(0, 1/fan_in)."""
    rng = np.random.default_rng(seed)
    ref = sub.module("reference")
    out = {}
    for name, (shape, _) in ref.param_shapes(sub, d, PREFIX).items():
        if name in out:             # drawn with another tensor (scales with their codes)
            continue
        drawn = ref.init_weight(sub, name, shape, rng, 1.0) if hasattr(ref, "init_weight") else None
        if isinstance(drawn, dict):
            out |= {n: np.asarray(w, np.float32) for n, w in drawn.items()}
            continue
        if drawn is None:
            if name.endswith("norm.weight"):
                drawn = 1.0 + rng.normal(0.0, spread, shape)
            elif name.endswith(("bias", "sinks")):
                drawn = rng.normal(0.0, spread, shape)
            else:
                drawn = rng.normal(0.0, 1.0 / math.sqrt(shape[-1]), shape)
        out[name] = np.asarray(drawn, np.float32)
    return out


def layer_params(hf: Mapping[str, np.ndarray]) -> dict[str, jax.Array]:
    """The reference's `lp`: names relative to the layer, f32."""
    return {n[len(PREFIX):]: jnp.asarray(w, F32) for n, w in hf.items() if n.startswith(PREFIX)}


class StandIn:
    """The `Layer` a body is called with, on one rank (`ONE_RANK`) and one row per sequence."""

    def __init__(self, sub: Sublayer, d: Any, hf: Mapping[str, np.ndarray], x: np.ndarray,
                 positions: np.ndarray, caches: Mapping[str, np.ndarray] | None = None, tile: int = 8,
                 ring: int = 0, per_rank: Mapping[str, int] | None = None, kind: str = "kind") -> None:
        part = sub.part(d, {c: 1 for c in CLASSES if c != "vocab"})
        self.part, self.sub, self.dims, self.kind = part, sub, d, kind
        self.B = self.S = x.shape[0]
        self.R = 1
        self.per_rank = dict(part.per_rank) | dict(per_rank or {})
        w = sub.module("weights")
        self.vectors = {n: jnp.asarray(w.vector(sub, hf, d, PREFIX, n, 0, ONE_RANK), F32)
                        for n, t in part.tensors.items() if t.role == "vector"}
        self.matrices = {n: jnp.asarray(w.matrix(sub, hf, d, PREFIX, n, 0, ONE_RANK), F32)
                         for n, t in part.tensors.items() if t.role == "matrix"}
        rotates = getattr(sub, "rope", True) and hasattr(d, "rope_theta")
        table = rope.host_inputs(d, jnp.asarray(positions, jnp.int32))["rope"] if rotates else None
        # the VMEM activations the kind's bodies keep (`MoE.activations`), at B rows
        acts = sub.activations(d) if hasattr(sub, "activations") else {}
        dtypes = {"f32": F32, "bf16": jnp.bfloat16}
        self.refs = types.SimpleNamespace(
            x=Buffer(jnp.asarray(x, F32)), rope=table, positions=jnp.asarray(positions, jnp.int32),
            **{n: Buffer(jnp.zeros(tuple(self.B if e == -1 else e for e in shape), dtypes[dtype]))
               for n, (shape, dtype) in acts.items()})
        # caches bf16, as the kernel stores them
        self.caches = [Buffer(jnp.asarray(caches[n], jnp.bfloat16)) for n, t in part.tensors.items()
                       if t.role == "cache"] if caches else []
        self.states = {n: Buffer(a) for n, a in (caches or {}).items() if n in part.tensors
                       and part.tensors[n].role == "state"}
        self.tile, self.kv = tile, kv_cache.KvTiles(tokens=tile, slots=2, ahead=1, ring=ring)
        self.picked = None
        self.plan = types.SimpleNamespace(streamed={})      # every matrix pooled: products as wide

    # what a body reads of its layer
    def vector(self, name: str) -> jax.Array:
        return self.vectors[name]

    def matmul(self, name: str, h: jax.Array) -> jax.Array:
        return jnp.dot(h, self.matrices[name], precision=HIGHEST)

    def pooled(self, name: str) -> jax.Array:
        return self.matrices[name]

    def sequence(self, b: int) -> int:
        return b

    def state_source(self, b: int) -> int:
        return b

    def waves(self) -> list[tuple[slice, slice]]:
        return [(slice(0, self.B), slice(0, self.B))]

    def state(self, name: str) -> Buffer:
        return self.states[name]

    def kv_write(self, new: list[jax.Array]) -> None:
        slots = self.refs.positions % self.kv.ring if self.kv.ring else self.refs.positions
        for cache, rows in zip(self.caches, new):
            cache[jnp.arange(self.B), slots] = rows

    def kv_positions(self, tokens: jax.Array, position) -> jax.Array:
        return kv_cache.held(self.kv, tokens, position)

    def kv_fold(self, body: Callable, init):
        carry = init
        slots = self.caches[0].value.shape[1]
        for t in range(slots // self.tile):
            tokens = t * self.tile + jnp.arange(self.tile)[None, :]
            tiles = tuple(c.value[:, t * self.tile:(t + 1) * self.tile] for c in self.caches)
            carry = body(t, tiles, tokens, carry)
        return carry

    def select_experts(self, ids: jax.Array) -> None:
        self.picked = ids

    def fold_experts(self, body: Callable, acc):
        for k in range(self.dims.experts):
            acc = body(k, acc)
        return acc

    def expert_weight(self, weights: jax.Array, k) -> jax.Array:
        return weights[:, k:k + 1]


def run_bodies(c: StandIn, experts: list[Mapping[str, jax.Array]] | None = None) -> dict[str, Any]:
    """Every op of the kind in program order, each body passed the values it reads -> the
    values written (the last of each name; `c.written`: every op's result, in order).
    `experts`: every routed expert's matrices in the slot's layout (dense f32, `gate_up [H, 2 *
    width]`, `down [width, H]`, bias rows where the kind has them), which the routed experts'
    slot reads are replaced by (every expert visited, each weighted by its routing weight, zero
    where a row did not pick it)."""
    not_values = set(c.part.tensors) | {"x"}
    bodies = c.sub.bodies()
    values: dict[str, Any] = {}
    c.written = []
    with contextlib.ExitStack() as patches:
        if experts is not None:
            module = sys.modules[c.sub.module("lowering").__name__]
            patches.enter_context(mock.patch.object(
                module, "expert_matmul",
                lambda c_, k, h, name, group: jnp.dot(h, experts[k][name], precision=HIGHEST)))
            patches.enter_context(mock.patch.object(module, "_expert_bias",
                                                    lambda c_, k, name: experts[k][name]))
        for op in c.part.ops:
            out = bodies[op.name](c, *[values[n] for n in op.reads if n not in not_values])
            c.written.append((op.name, out))
            writes = [n for n in op.writes if n not in not_values]
            if len(writes) == 1:
                values[writes[0]] = out
            elif writes:
                values |= dict(zip(writes, out))
    return values


@contextlib.contextmanager
def results_of(module: Any, name: str):
    """Function `name` of `module` as it is, its results kept in the yielded list (what a
    reference computes inside a layer: a value a later norm hides)."""
    kept: list = []
    real = getattr(module, name)

    def kept_call(*args, **kwargs):
        kept.append(real(*args, **kwargs))
        return kept[-1]
    with mock.patch.object(module, name, kept_call):
        yield kept


def reference(sub: Sublayer, d: Any, hf: Mapping[str, np.ndarray], x: np.ndarray, positions: np.ndarray,
              cache: Mapping[str, Any] | None = None, kind: str = "kind", keep: tuple[Any, str] | None = None
              ) -> tuple[np.ndarray, dict]:
    """The kind's f32 reference layer (`reference.forward`, no rounding): (x after it, caches),
    jitted (one compile costs less CPU than the eager ops' many). `keep`: (module, function)
    whose results inside it `cache["kept"]` lists (`results_of`)."""
    def forward(x: jax.Array, cache: dict) -> tuple[jax.Array, dict]:
        cache = dict(cache)
        with results_of(*keep) if keep else contextlib.nullcontext([]) as kept:
            out = sub.module("reference").forward(sub, layer_params(hf), d, x, cache, 0,
                                                  jnp.asarray(positions, jnp.int32), None, kind)
        return out, cache | ({"kept": kept} if keep else {})
    out, cache = jax.jit(forward)(jnp.asarray(x, F32), dict(cache or {}))
    return np.asarray(out, np.float64), cache


def kernel_states(sub: Sublayer, d: Any, c_part, ref_cache: Mapping[str, Any], batch: int, kind: str = "kind"
                  ) -> dict[str, np.ndarray]:
    """The reference's caches and states in the kernel's layouts, rank 0's, by tensor name."""
    shapes = {}
    for n, t in c_part.tensors.items():
        if t.role == "cache":       # [layers, S, slots, row]; a reference cache's slots axis is -2
            slots = next(iter(ref_cache.values())).shape[-2]
            shapes[f"{kind}__{n}"] = ((1, batch, slots, math.prod(t.shape)), np.float32)
        elif t.role == "state":     # [layers, *lead, S, *rest]
            lead = t.shape[:getattr(t, "lead_dims", 0)]
            shapes[f"{kind}__{n}"] = ((1, *lead, batch, *t.shape[len(lead):]), np.float32)
    ref = {n: np.asarray(a, np.float32) for n, a in ref_cache.items()}
    states = sub.module("weights").kernel_states(sub, ref, d, dict(c_part.per_rank), ONE_RANK, kind, [0],
                                                 shapes)
    return {n.split("__", 1)[1]: a[0, 0] for n, a in states.items()}


def gap(got, want) -> float:
    """The largest difference relative to the largest value: what a tolerance bounds."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


def run_recurrent_layer(sub: Sublayer, d: Any, hf: Mapping[str, np.ndarray], x: np.ndarray,
                        conv: np.ndarray, recurrent: np.ndarray, keep: tuple[Any, str],
                        positions: tuple[int, ...] = (9, 4)) -> tuple:
    """A delta-rule kind (conv state, recurrent state) run both ways from the same states:
    (x, the reference's x after it, the kernel's, the reference's states and the kernel's in
    the kernel's layouts, (the kernel's delta-rule output, the reference's)). `keep` names the
    reference's delta-rule step, whose output before the gated norm is compared too (the
    norm hides a scale of it)."""
    batch = len(positions)
    cache_in = {"layers.0.conv_state": jnp.asarray(conv, jnp.bfloat16),
                "layers.0.recurrent_state": jnp.asarray(recurrent, jnp.float32)}
    pos = np.array(positions)
    want, cache_out = reference(sub, d, hf, x, pos, cache_in, keep=keep)
    steps = cache_out.pop("kept")
    c = StandIn(sub, d, hf, x, pos)
    c.states = StandIn(sub, d, hf, x, pos, kernel_states(sub, d, c.part, cache_in, batch)).states
    run_bodies(c)
    want_states = kernel_states(sub, d, c.part, cache_out, batch)
    got_states = {n: np.asarray(s.value) for n, s in c.states.items()}
    core = (np.asarray(dict(c.written)["delta_rule"]), np.asarray(steps[0][0]).reshape(batch, -1))
    return x, want, np.asarray(c.refs.x.value), want_states, got_states, core


def mutated_module(module: str, old: str, new: str, **names: Any) -> types.ModuleType:
    """A copy of module `module` with `old` (once in its source) replaced by `new`, `names`
    defined in it first (what a mutant's new text reads that the module does not import)."""
    import importlib
    import inspect

    real = importlib.import_module(module)
    source = inspect.getsource(real)
    assert source.count(old) == 1, old
    mutated = types.ModuleType(module)
    mutated.__file__ = real.__file__
    vars(mutated).update(names)
    exec(compile(source.replace(old, new), real.__file__, "exec"), mutated.__dict__)
    return mutated


def expert_matmul_body(fmt: Any, codes_shape: tuple[int, int], group: int) -> Callable:
    """A kernel body `(x_ref, codes_ref, scales_ref, out_ref)` running
    `expert_formats.lowering.expert_matmul` of expert 0's `gate_up` in `fmt` on a slot of
    `codes_shape` holding the packed codes and scales: the slot's reads
    (`expert_slots.matrix`, `read_u8`, `pool.pooled_u8`) return the refs, the rest is the body's
    own."""
    from mkc.layers.expert_formats import lowering

    def body(x_ref, codes_ref, scales_ref, out_ref):
        slots = types.SimpleNamespace(matrix=lambda es, refs, k, name: (0, *codes_shape),
                                      read_u8=lambda es, refs, k, name: scales_ref[...])
        pool = types.SimpleNamespace(
            pooled_u8=lambda buf, row, rows, cols, first=0, count=None: codes_ref[first:first + count])
        c = types.SimpleNamespace(refs=types.SimpleNamespace(pool=None),
                                  experts=types.SimpleNamespace(pool="pool"),
                                  weight_format={"expert.gate_up": fmt}.__getitem__)
        with mock.patch.object(lowering, "expert_slots", slots), mock.patch.object(lowering, "pool", pool):
            out_ref[...] = lowering.expert_matmul(c, 0, x_ref[...], "gate_up", group)
    return body


def lowered_expert_matmul(fmt: Any, codes: np.ndarray, scales: np.ndarray, x: np.ndarray, group: int
                          ) -> np.ndarray:
    """`expert_matmul_body` on packed `codes` and `scales`, in a kernel (interpret mode: the
    decoding bitcasts are Mosaic's)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu

    vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
    call = pl.pallas_call(expert_matmul_body(fmt, codes.shape, group),
                          out_shape=jax.ShapeDtypeStruct((x.shape[0], codes.shape[1]), jnp.float32),
                          in_specs=[vmem] * 3, out_specs=vmem, interpret=pltpu.InterpretParams())
    return np.asarray(call(jnp.asarray(x), jnp.asarray(codes), jnp.asarray(scales)))
