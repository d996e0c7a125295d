"""The host side of every generated module: building its pallas_call, sharding it over a mesh,
the decode and verify steps, committing a verify step, packing and placing weights, zeroed
states and the checks of a step's inputs.

A generated module holds what is specific to its schedule (its constants, shapes and kernel
body) and binds one `Host` to them; the module's public functions (``build_kernel``,
``make_decode_step``, ``pack_rank``, ...) are this class's methods. The kernel's operands are
bound by name: inputs, outputs and scratch follow the orders of the module's shape tables, and
the kernel body is handed them as attributes of one namespace.
"""
from __future__ import annotations

import functools
import importlib
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import Mesh, PartitionSpec as P

from mkc.runtime import experts as expert_slots, inputs, pool, ring, shapes
from mkc.runtime.ring import Ring, StreamedMatrix
from mkc.runtime.shapes import Scratch, Shapes
from mkc.runtime.vectors import Parity

# The kernel's SMEM inputs, before the module's VMEM inputs, HBM weights and states.
SMEM_INPUTS = ("tokens", "positions", "tables", "tile_class")


def kind_layers(layer_kind: tuple[int, ...], kind_ids: Mapping[str, int]) -> dict[str, list[int]]:
    """The layers of each kind, in order."""
    return {k: [i for i, v in enumerate(layer_kind) if v == kid] for k, kid in kind_ids.items()}


def state_index(layer_kind: tuple[int, ...]) -> tuple[int, ...]:
    """Each layer's index among the layers of its kind (its entry in the kind's state arrays)."""
    return tuple(layer_kind[:i].count(v) for i, v in enumerate(layer_kind))


@dataclass(frozen=True, eq=False)
class Host:
    """One generated module's host side, from its constants (see the module for each)."""

    kernel: Callable[..., None]                 # kernel(refs namespace, B=, R=, verify=)
    # The module's shape tables (mkc.runtime.shapes: ROWS and SEQS fixed per kernel).
    hbm_table: Shapes                           # per-rank HBM weights, no rank axis
    state_table: Mapping[str, tuple]            # per-rank states of SEQS sequences
    vmem_input_table: Mapping[str, tuple]       # host-computed VMEM inputs at ROWS rows
    scratch_table: Mapping[str, Scratch]
    host_inputs: Callable                       # the lowering's host_inputs(dims, positions)
    hf_layout: types.ModuleType                 # the family's weights module (in its package)
    axis: str
    ranks: int
    context: int
    batch_range: tuple[int, int]
    vmem_limit_bytes: int
    dims: Any
    hf_config: Mapping
    per_rank: Mapping[str, int]
    formats: Mapping
    shards: Any                                  # mkc.model.sharding.ShardTable
    kind_ids: Mapping[str, int]
    layer_kind: tuple[int, ...]
    layer_tile_offset: tuple[int, ...]
    ring: Ring
    stream_order: Mapping[str, list[StreamedMatrix]]
    tail_tile_offset: int
    vectors: Parity
    view: Any = None                             # mkc.runtime.pool.WeightView
    # mkc.runtime.experts.ExpertSlots of the layer kind that fetches routed experts
    # (`expert_kind`), or one per kind where several do
    experts: Any = None
    expert_kind: str | None = None
    verify_rows: int = 0                         # 0: the schedule declares no verify step
    verify_sequences: tuple[int, int] = (0, 0)
    row_states: Mapping[str, int] = field(default_factory=dict)
    spread_row_states: tuple[str, ...] = ()
    _steps: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def expert_slots(self) -> dict:
        """Each layer kind that fetches routed experts -> the slots it fetches them into."""
        if isinstance(self.experts, Mapping):
            return dict(self.experts)
        return {self.expert_kind: self.experts} if self.experts is not None else {}

    @property
    def expert_formats(self) -> dict:
        """The formats the family's weights module takes (its routed experts'): those of the
        dense classes (one scale per column, `mkc.layers.dense_formats`) are packing's own."""
        return {c: f for c, f in self.formats.items() if not getattr(f, "channel", False)}

    # ---- shapes ----------------------------------------------------------------------------
    def hbm_shapes(self) -> Shapes:
        """Per-rank HBM inputs (no rank axis): name -> (shape, dtype)."""
        return dict(self.hbm_table)

    def state_shapes(self, S: int, R: int = 1) -> Shapes:
        """Per-rank decode state of S sequences (no rank axis); with R rows per sequence (a
        verify step's output) the recurrent states hold S * R entries, one after every row."""
        return shapes.table_at(self.state_table, S * R, S)

    def vmem_input_shapes(self, B: int) -> Shapes:
        """Host-computed VMEM inputs of a step at B rows (the lowering's host_inputs)."""
        return shapes.table_at(self.vmem_input_table, B)

    def scratch_shapes(self, B: int) -> dict[str, Any]:
        """The kernel's scratch at B rows, by the name its body reads (`r.<name>`): the
        entries a kernel of B rows allocates (`Scratch.rows`)."""
        return {name: scratch.at(B) for name, scratch in self.scratch_table.items()
                if scratch.exists_at(B)}

    # ---- the kernel ----------------------------------------------------------------------
    @property
    def tail(self) -> StreamedMatrix:
        """The matrix that ends the stream (the lm_head), whose column tiles are the logits."""
        return self.stream_order["tail"][-1]

    @property
    def kind_layers(self) -> dict[str, list[int]]:
        return kind_layers(self.layer_kind, self.kind_ids)

    def operand_names(self, B: int) -> tuple[list[str], list[str], list[str]]:
        """The kernel's (inputs, outputs, scratch) by name, in operand order."""
        states = list(self.state_shapes(1))
        ins = [*SMEM_INPUTS, *self.vmem_input_shapes(B), *self.hbm_shapes(), *[n + "_in" for n in states]]
        return ins, ["logits", *states], list(self.scratch_shapes(B))

    def build_kernel(self, B: int, interpret=None, verify_rows: int | None = None):
        """The pallas_call for one rank at batch B (interpret: None for TPU, or InterpretParams).

        With verify_rows R it is a verify kernel: B rows as B / R sequences of R consecutive
        positions (row r * S + s is sequence s's row r), which reads the states it is given and
        writes the state after every row (`state_shapes(S, R)`); KV caches are updated in place."""
        R = verify_rows or 1
        S = B // R
        lo, hi = self.verify_sequences
        if verify_rows is None:
            if not self.batch_range[0] <= B <= self.batch_range[1]:
                raise ValueError(f"batch {B} is outside the schedule's range {self.batch_range}")
        elif not self.verify_rows:
            raise ValueError("the schedule declares no verify step: add `verify R` to the spec")
        elif not (1 <= R <= self.verify_rows and S * R == B and lo <= S <= hi):
            raise ValueError(f"a verify step of {B} rows as {R} per sequence is outside the "
                             f"schedule's verify {self.verify_rows} rows for {(lo, hi)} sequences")
        states = self.state_shapes(S, R)
        scratch = self.scratch_shapes(B)
        ins, outs, scratch_names = self.operand_names(B)
        names = ins + outs + scratch_names
        n_vmem, n_hbm = len(self.vmem_input_shapes(B)), len(self.hbm_shapes())
        any_spec = pl.BlockSpec(memory_space=pl.ANY)
        vmem = pl.BlockSpec(memory_space=pltpu.VMEM)
        tail = self.tail
        out_shape = (jax.ShapeDtypeStruct((tail.col_tiles, B, tail.tile_cols), jnp.float32),
                     *[jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in states.values()])
        # A decode step updates every state in place; a verify step its KV caches and the
        # states it is handed spread over every row (`spread`).
        in_place = [i for i, name in enumerate(states) if verify_rows is None
                    or name not in self.row_states or name in self.spread_row_states]
        first_state = len(SMEM_INPUTS) + n_vmem + n_hbm

        def body(*refs):
            self.kernel(types.SimpleNamespace(**dict(zip(names, refs, strict=True))),
                        B=B, R=R, verify=verify_rows is not None)

        return pl.pallas_call(
            body,
            out_shape=out_shape,
            in_specs=([pl.BlockSpec(memory_space=pltpu.SMEM)] * len(SMEM_INPUTS) + [vmem] * n_vmem
                      + [any_spec] * (n_hbm + len(states))),
            out_specs=(vmem, *[any_spec] * len(states)),
            scratch_shapes=list(scratch.values()),
            input_output_aliases={first_state + i: 1 + i for i in in_place},
            compiler_params=pltpu.CompilerParams(vmem_limit_bytes=self.vmem_limit_bytes,
                                                 collective_id=0, has_side_effects=True),
            interpret=interpret if interpret is not None else False,
        )

    def tables(self) -> np.ndarray:
        """The kernel's SMEM layer table: each layer's kind, first ring tile, state index."""
        return np.array([self.layer_kind, self.layer_tile_offset, state_index(self.layer_kind)],
                        np.int32)

    def tile_classes(self) -> np.ndarray:
        """The tile class of every tile of the step, in stream order (an SMEM table)."""
        kinds = {v: k for k, v in self.kind_ids.items()}
        sequence = [m for v in self.layer_kind for m in self.stream_order[kinds[v]]]
        return ring.tile_classes(self.ring, sequence + list(self.stream_order["tail"]))

    # ---- steps over a mesh ---------------------------------------------------------------
    def _sharded(self, mesh: Mesh, B: int, interpret, verify_rows: int | None = None):
        """The kernel at B rows over `mesh`, on host-computed inputs -> (vocab-major logits
        [B, vocab], state outputs in `state_shapes` order)."""
        self.check_mesh(mesh)
        call = self.build_kernel(B, interpret, verify_rows)
        names = list(self.state_shapes(1))
        hbm_names = list(self.hbm_shapes())
        vmem_names = list(self.vmem_input_shapes(B))
        n_replicated = len(SMEM_INPUTS) + len(vmem_names)

        def per_rank(*args):
            outs = call(*args[:n_replicated], *[a[0] for a in args[n_replicated:]])
            return tuple(o[None] for o in outs)

        rank_spec = P(self.axis)
        sharded = jax.shard_map(per_rank, mesh=mesh,
                                in_specs=(P(),) * n_replicated + (rank_spec,) * (len(hbm_names) + len(names)),
                                out_specs=(rank_spec,) * (1 + len(names)), check_vma=False)
        holders = self.shards.holders("vocab")     # one rank per vocab part, in vocab order
        vocab_local = self.per_rank["vocab"]

        def run(weights, state, tokens, positions):
            host = self.host_inputs(self.dims, positions)
            outs = sharded(tokens, positions, jnp.asarray(self.tables()),
                           jnp.asarray(self.tile_classes()), *[host[n] for n in vmem_names],
                           *[weights[n] for n in hbm_names], *[state[n] for n in names])
            tiles = outs[0]                                   # [RANKS, col_tiles, B, tile_cols]
            if list(holders) != list(range(self.ranks)):      # vocab replicated over some ranks
                tiles = tiles[np.array(holders)]
            logits = jnp.transpose(tiles, (2, 0, 1, 3)).reshape(B, len(holders), -1)[:, :, :vocab_local]
            return logits.reshape(B, len(holders) * vocab_local), dict(zip(names, outs[1:]))
        return run

    def _jit(self, mesh: Mesh, step):
        # Logits and next tokens come back replicated, so every process (host) can read them.
        replicated = jax.sharding.NamedSharding(mesh, P())
        ranked = jax.sharding.NamedSharding(mesh, P(self.axis))
        return jax.jit(step, donate_argnums=(1,), out_shardings=(replicated, replicated, ranked))

    def make_decode_step(self, mesh: Mesh, B: int, interpret=None):
        """A jitted decode step over `mesh` (one axis named AXIS of RANKS devices).

        step(weights, state, tokens[B], positions[B]) -> (logits f32[B, vocab], next_token,
        state). Row b writes its K/V at positions[b] and attends to 0..positions[b]: positions
        must be below CONTEXT and tokens below the vocabulary size (neither is checked on
        device)."""
        run = self._sharded(mesh, B, interpret)

        def step(weights, state, tokens, positions):
            logits, state = run(weights, state, tokens, positions)
            return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), state
        return self._jit(mesh, step)

    def make_verify_step(self, mesh: Mesh, S: int, R: int, interpret=None):
        """A jitted verify step over `mesh`: R rows (an anchor and R - 1 drafts) for each of S
        sequences in one kernel launch, every matrix streamed once for all S * R rows.

        step(weights, caches, states, tokens[S, R], starts[S]) -> (logits f32[S, R, vocab],
        next_token [S, R], verified): sequence s's row r sits at position starts[s] + r, attends
        causally to its cache and its earlier rows, and writes its K/V. `verified` holds the KV
        caches (updated in place: `caches` is donated) and, per recurrent state, the state after
        every row; `commit` keeps the accepted rows' states. starts[s] + R must not pass
        CONTEXT."""
        run = self._sharded(mesh, S * R, interpret, verify_rows=R)

        def step(weights, caches, states, tokens, starts):
            states = {n: self._spread(n, a, R) if n in self.spread_row_states else a
                      for n, a in states.items()}
            rows = jnp.transpose(tokens).reshape(-1)            # wave-major: row r * S + s
            positions = (starts[None, :] + jnp.arange(R, dtype=jnp.int32)[:, None]).reshape(-1)
            logits, verified = run(weights, caches | states, rows, positions)
            logits = jnp.transpose(logits.reshape(R, S, -1), (1, 0, 2))
            return logits, jnp.argmax(logits, axis=-1).astype(jnp.int32), verified
        return self._jit(mesh, step)

    def _spread(self, name: str, state: jax.Array, R: int) -> jax.Array:
        """A row state of S entries padded to the S * R of a verify kernel's rows (the S first):
        for states whose rows are a tiled dim, which the kernel cannot load S of (they are
        small: conv taps)."""
        axis = self.row_states[name] + 2                        # past the rank and layer axes
        pad = [(0, 0)] * state.ndim
        pad[axis] = (0, state.shape[axis] * (R - 1))
        return jnp.pad(state, pad)

    def commit(self, state, verified, accepted):
        """The decode state after each sequence's first accepted[s] rows (0..R) of a verify
        step from `state`: recurrent states from `verified`'s per-row entries (or `state`'s,
        for 0), KV caches as the verify step left them (entries past the accepted rows are
        masked by position and overwritten by the next step). A state and a verify output of
        other batches, and host-side counts outside 0..R, are a ValueError; counts already on
        a device are not read back (that would stall), and are clamped to 0..R."""
        row_states = dict(self.row_states)
        if row_states:           # S sequences in `state`, S * R entries per row state in `verified`
            inputs.check_commit(state, verified, accepted, state_shapes=self.state_shapes,
                                ranks=self.ranks, row_states=row_states, verify_rows=self.verify_rows)
        accepted = jnp.asarray(accepted, jnp.int32)
        rows = _keep_accepted({n: state[n] for n in row_states}, {n: verified[n] for n in row_states},
                              accepted, tuple(row_states.items()))
        return {n: rows[n] if n in row_states else verified[n] for n in verified}

    # ---- weights and states --------------------------------------------------------------
    def pack_rank(self, hf, rank: int) -> dict[str, np.ndarray]:
        """HF-named weights -> one rank's HBM layout: the ring stream in consumption order,
        pooled matrices in pool form, each routed expert as its slot's image, per-layer vector
        blocks, the head vectors and the embedding shard. The weights are first checked against
        the compiled config."""
        inputs.check_hf_weights(hf, self.hf_layout.__package__, self.dims, self.hf_config)
        layout, dims, per_rank, shards = self.hf_layout, self.dims, self.per_rank, self.shards
        packed = {name: np.zeros(shape, dtype) for name, (shape, dtype) in self.hbm_shapes().items()}
        kinds = {v: k for k, v in self.kind_ids.items()}
        put = self._tile_putter(hf, rank)
        for layer, (kid, si) in enumerate(zip(self.layer_kind, state_index(self.layer_kind))):
            kind = kinds[kid]
            t = self.layer_tile_offset[layer]
            for m in self.stream_order[kind]:
                t = put(packed["ring_hbm"], t, layer, kind, m)
            for name in (self.view.matrices.get(kind, {}) if self.view else ()):
                matrix = layout.matrix(hf, dims, per_rank, layer, kind, name, rank, shards)
                packed[f"pool__{kind}__{name}"][si] = pool.pack_for_pool(matrix.astype(jnp.bfloat16))
            es = self.expert_slots.get(kind)
            for e in range(es.local_experts if es else 0):
                packed[es.hbm][si, e] = expert_slots.pack_expert(
                    es, layout.expert(hf, dims, per_rank, layer, e, rank, shards, self.expert_formats))
            for name, (row, rows, width) in self.vectors.layout[kind].items():
                vector = layout.layer_vector(hf, dims, per_rank, layer, kind, name, rank, shards)
                packed["vectors_hbm"][layer, row:row + rows, :width] = vector
        t = self.tail_tile_offset
        for m in self.stream_order["tail"]:
            t = put(packed["ring_hbm"], t, -1, "tail", m)
        head = layout.head_vectors(hf, dims, rank, shards)
        packed["head_norm_hbm"][:head.shape[0]] = head
        packed["embed"] = layout.embedding(hf, dims, rank, shards).astype(jnp.bfloat16)
        return packed

    def _matrices(self) -> list:
        """Every kernel matrix (`mkc.model.channel_codes.Member`): streamed ones with
        their codes, pooled ones, the tail's."""
        from mkc.model.channel_codes import Member
        kinds = {v: k for k, v in self.kind_ids.items()}
        out = []
        for layer, kid in enumerate(self.layer_kind):
            kind = kinds[kid]
            out += [Member(layer, kind, m.name, m.codes, m.format_class)
                    for m in self.stream_order[kind]]
            out += [Member(layer, kind, name) for name in (self.view.matrices.get(kind, {})
                                                           if self.view else ())]
        return out + [Member(-1, "tail", m.name, m.codes, m.format_class)
                      for m in self.stream_order["tail"]]

    def _dense_sources(self, hf) -> dict:
        """The checkpoint tensors the matrices stored as 8-bit codes read (`format CLASS
        int8 channel rounded`), each with its matrix: {} when none is."""
        from mkc.model import channel_codes as dense
        if all(m.codes == "bf16" for ms in self.stream_order.values() for m in ms):
            return {}
        return dense.sources(self.hf_layout, hf, self.dims, self.per_rank, self.shards,
                             self._matrices())

    def _tile_putter(self, hf, rank: int) -> Callable:
        """put(hbm, first tile, loop layer, kind, StreamedMatrix) -> next tile: the matrix cut
        from `hf` for `rank` into its ring tiles, bf16 values or (stored as codes) the codes
        of the checkpoint requantized with each column's scale (`mkc.layers.dense_formats`)."""
        from mkc.model import channel_codes as dense
        layout, dims, per_rank, shards = self.hf_layout, self.dims, self.per_rank, self.shards
        sources = self._dense_sources(hf)
        values, scales = dense.held(hf, sources), dense.held(hf, sources, "scales")

        def put(hbm, t: int, layer: int, kind: str, m: StreamedMatrix) -> int:
            if m.codes == "bf16":
                matrix = layout.matrix(hf, dims, per_rank, layer, kind, m.name, rank, shards)
                return ring.put_tiles(hbm, t, matrix, m)
            codes, col = dense.kernel_codes(
                layout.matrix(values, dims, per_rank, layer, kind, m.name, rank, shards),
                layout.matrix(scales, dims, per_rank, layer, kind, m.name, rank, shards),
                m.codes, f"{kind}.{m.name} of loop layer {layer}")
            return ring.put_tiles(hbm, t, codes, m, col)
        return put

    def pack_weights(self, hf) -> dict[str, np.ndarray]:
        """All ranks' HBM layouts stacked on a leading rank axis (host memory: every rank's
        copy; for full-size models use place_weights)."""
        ranks = [self.pack_rank(hf, rank) for rank in range(self.ranks)]
        return {name: np.stack([r[name] for r in ranks]) for name in ranks[0]}

    def place_weights(self, hf, mesh: Mesh) -> dict[str, jax.Array]:
        """Pack and place weights rank by rank onto `mesh` (only this process's devices), so
        the host holds one rank's packed copy at a time."""
        self.check_mesh(mesh)
        sharding = jax.sharding.NamedSharding(mesh, P(self.axis))
        shapes = self.hbm_shapes()
        pieces: dict[str, list] = {name: [] for name in shapes}
        for device, index in sharding.addressable_devices_indices_map((self.ranks,)).items():
            packed = self.pack_rank(hf, index[0].start or 0)
            for name in shapes:
                pieces[name].append(jax.device_put(packed[name][None], device))
        return {name: jax.make_array_from_single_device_arrays((self.ranks, *shape), sharding, pieces[name])
                for name, (shape, _) in shapes.items()}

    def random_weights(self, seed: int = 0) -> dict[str, np.ndarray]:
        """HF-named random weights for the config this module was compiled for (the family
        reference's `init_params`, scaled to keep activations O(1)): for trying a module
        without a checkpoint. Real weights: `mkc.checkpoint.load_checkpoint(dir)[1]`."""
        reference = importlib.import_module(f"{self.hf_layout.__package__}.reference")
        return reference.init_params(reference.load_config(dict(self.hf_config)), seed)

    def requantized_weights(self, hf) -> tuple[dict, dict[str, dict]]:
        """The checkpoint as the kernel holds its values, and how far they moved: `hf` with the
        matrices of every class whose format requantizes them (K3's `fp4 block N`) replaced by
        their requantized tensors in the checkpoint's own format (the reference and its
        rounding emulation run on these; packing either gives the same kernel weights), and
        per matrix class the error against the checkpoint's values (values changed, inexact
        blocks, max abs, relative RMS). `hf` itself and an empty report where no format
        requantizes; a FormatError (naming the spec's `format` line, the matrix and the block)
        where a class without `rounded` cannot be held exactly."""
        from mkc.model import channel_codes as dense
        changed, report = dense.requantization(hf, self._dense_sources(hf), self.formats)
        fn = getattr(self.hf_layout, "requantization", None)
        if fn is not None:
            experts, expert_report = fn(hf, self.dims, self.expert_formats, self.shards)
            changed, report = {**changed, **experts}, {**expert_report, **report}
        return ({**hf, **changed} if changed else hf), report

    def reference_states(self, state) -> dict[str, np.ndarray]:
        """The decode state gathered over ranks into the reference's (upstream) layouts."""
        return self.hf_layout.reference_states(state, self.dims, self.per_rank, self.shards,
                                               self.kind_layers)

    def kernel_state(self, ref_states, S: int) -> dict[str, np.ndarray]:
        """The inverse of `reference_states`: S sequences' states in the reference's (upstream)
        layouts as the kernel's decode state (leading rank axis), each rank holding its parts
        (replicas written to every holder, padding zero), zeros where the kernel holds nothing.
        A ValueError for a family whose weights module cannot write them."""
        fn = getattr(self.hf_layout, "kernel_states", None)
        if fn is None:
            raise ValueError(f"{self.hf_layout.__name__} has no kernel_states: the reference's "
                             "states cannot be written in the kernel's layout")
        shapes = self.state_shapes(S)
        out = fn(ref_states, self.dims, self.per_rank, self.shards, self.kind_layers, shapes)
        return {n: out[n] if n in out else np.zeros((self.ranks, *shape), dtype)
                for n, (shape, dtype) in shapes.items()}

    def init_state(self, B: int) -> dict[str, np.ndarray]:
        """Zeroed decode state, with the leading rank axis."""
        return {n: np.zeros((self.ranks, *shape), dtype)
                for n, (shape, dtype) in self.state_shapes(B).items()}

    def place_state(self, B: int, mesh: Mesh) -> dict[str, jax.Array]:
        """Zeroed decode state on `mesh`, each process creating only its own ranks' shards (the
        multi-host counterpart of init_state)."""
        self.check_mesh(mesh)
        sharding = jax.sharding.NamedSharding(mesh, P(self.axis))

        def zeros(shape, dtype):
            return jax.make_array_from_callback((self.ranks, *shape), sharding,
                                                lambda index: np.zeros((1, *shape), dtype))
        return {n: zeros(shape, dtype) for n, (shape, dtype) in self.state_shapes(B).items()}

    def abstract_inputs(self, B: int):
        """ShapeDtypeStructs of (weights, state) with the leading rank axis: for compile-only
        use."""
        def structs(table: Shapes) -> dict:
            return {n: jax.ShapeDtypeStruct((self.ranks, *shape), dtype)
                    for n, (shape, dtype) in table.items()}
        return structs(self.hbm_shapes()), structs(self.state_shapes(B))

    def make_mesh(self, devices=None) -> Mesh:
        """The mesh of RANKS devices in rank order: by process (one per host under
        jax.distributed), then device id, which keeps the cores of a chip and the chips of a
        host adjacent, as the schedule's collective groups assume. Every process builds the
        same mesh."""
        devices = sorted(jax.devices() if devices is None else devices, key=lambda d: (d.process_index, d.id))
        if len(devices) < self.ranks:
            raise ValueError(f"the schedule needs {self.ranks} devices." + self._device_hint(len(devices)))
        devices = devices[:self.ranks]
        hosts = sorted({d.process_index for d in devices})
        per_host = self.ranks // len(hosts)
        if self.ranks % len(hosts) or any(hosts.index(d.process_index) != rank // per_host
                                          for rank, d in enumerate(devices)):
            raise ValueError(f"processes {hosts} do not each hold {per_host} consecutive ranks")
        return Mesh(np.array(devices), (self.axis,))

    def check_mesh(self, mesh: Mesh) -> None:
        """A mesh this module's steps and placements can use: one axis named AXIS of RANKS
        devices (else JAX fails later, deep inside sharding, with shard shapes that differ)."""
        sizes = dict(mesh.shape)
        if sizes == {self.axis: self.ranks}:
            return
        have = ", ".join(f"{a!r}: {n}" for a, n in sizes.items())
        raise ValueError(f"this module runs on a mesh of one axis {self.axis!r} of {self.ranks} "
                         f"devices; the mesh given has {{{have}}}. Build it with make_mesh()."
                         + self._device_hint(len(jax.devices())))

    def _device_hint(self, visible: int) -> str:
        if visible >= self.ranks:
            return ""
        return (f" Only {visible} devices are visible: on CPU set XLA_FLAGS="
                f"--xla_force_host_platform_device_count={self.ranks} before jax is imported.")

    # ---- one-call steps ------------------------------------------------------------------
    def check_inputs(self, weights, state, tokens, positions, rows: int | None = None) -> int:
        """Shapes and dtypes of a step's inputs, and host-side token and position values,
        against this schedule (mkc.runtime.inputs); the number of sequences."""
        return inputs.check_step_inputs(weights, state, tokens, positions,
                                        weight_shapes=self.hbm_shapes(), state_shapes=self.state_shapes,
                                        ranks=self.ranks, context=self.context,
                                        vocab=self.dims.vocab_size, rows=rows)

    def decode_step(self, weights, state, tokens, positions, *, mesh: Mesh | None = None,
                    interpret=None):
        """One decode step; builds (and caches) the jitted step for this batch, mesh and mode.

        mesh defaults to make_mesh(); interpret is None on TPU, or InterpretParams. Inputs that
        do not fit this module are a ValueError (`check_inputs`)."""
        B = self.check_inputs(weights, state, tokens, positions)
        mesh = self.make_mesh() if mesh is None else mesh
        key = ("decode", B, mesh, interpret)
        if key not in self._steps:
            self._steps[key] = self.make_decode_step(mesh, B, interpret)
        return self._steps[key](weights, self._on_mesh(state, mesh), tokens, positions)

    def _on_mesh(self, state, mesh: Mesh):
        """Host-held state arrays (init_state's) placed rank by rank on `mesh`, as the step
        returns them: the step donates its state, and only an input sharded as the output can
        be updated in place (from a host array JAX warns that the donation was not usable, and
        the next step, on the returned state, compiles again: 16 s for K3 MINI at batch 8)."""
        ranked = jax.sharding.NamedSharding(mesh, P(self.axis))
        return {n: a if isinstance(a, jax.Array) else jax.device_put(a, ranked) for n, a in state.items()}

    def verify_step(self, weights, state, tokens, starts, *, mesh: Mesh | None = None,
                    interpret=None):
        """One verify step (`make_verify_step`) of tokens [S, R] at starts [S]; builds and
        caches the jitted step per shape, mesh and mode. The state's KV caches are donated:
        continue from `commit(state, verified, accepted)`."""
        if not self.verify_rows:
            raise ValueError("the schedule declares no verify step: add `verify R` to the spec")
        R = np.shape(tokens)[-1] if np.ndim(tokens) == 2 else self.verify_rows
        S = self.check_inputs(weights, state, tokens, starts, rows=R)
        mesh = self.make_mesh() if mesh is None else mesh
        key = ("verify", S, R, mesh, interpret)
        if key not in self._steps:
            self._steps[key] = self.make_verify_step(mesh, S, R, interpret)
        state = self._on_mesh(state, mesh)
        caches = {n: a for n, a in state.items() if n not in self.row_states}
        states = {n: a for n, a in state.items() if n in self.row_states}
        return self._steps[key](weights, caches, states, jnp.asarray(tokens, jnp.int32),
                                jnp.asarray(starts, jnp.int32))


@functools.partial(jax.jit, static_argnums=(3,))
def _keep_accepted(states, verified, accepted, row_states: tuple[tuple[str, int], ...]):
    """Per row state: sequence s's entry after its accepted[s]-th row, or (none accepted) its
    state before the verify step. One gather of S entries per layer: the rejected rows' states
    are never copied."""
    S = accepted.shape[0]
    out = {}
    for name, axis in row_states:
        axis += 2                                               # past the rank and layer axes
        R = verified[name].shape[axis] // S
        # device-held counts are not read back: clamped to 0..R, as documented in commit
        entry = (jnp.clip(accepted, 1, R) - 1) * S + jnp.arange(S)
        picked = jnp.take(verified[name], entry, axis=axis)
        shape = [1] * picked.ndim
        shape[axis] = S
        out[name] = jnp.where((accepted == 0).reshape(shape), states[name], picked)
    return out
