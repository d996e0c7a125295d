"""What a model family's modules must provide, declared: the dims base the core reads, one
`Protocol` per module role the core and generated modules call (`Lowering`, `Weights`,
`Reference`), and where a compute body is found (`body_of`: the lowering module's `BODIES`).

The ops a family lowers are its composition's (`Family.layers`, read without importing jax).
`Family.module` checks, when it imports a role's module, that the module has every function
of the role's protocol and that its lowering module's `BODIES` holds the composition's ops.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol


@dataclass(frozen=True)
class Dims:
    """The dimensions of one model, as a family's `read_dims` returns them: the fields every
    stage of the core reads, first. A family's subclass adds its own and, in the place its
    field order keeps, `layer_kinds: tuple[str, ...]` (one layer kind per iteration of the
    layer loop). MoE families also have `experts` and `top_k`, which the range check reads.
    The generated module prints the dims as a literal of the subclass, fields in order."""

    family: str                 # the family's name (the registry's key)
    name: str                   # the model's name: an identifier (generated file names)
    hidden_size: int
    num_hidden_layers: int
    vocab_size: int


class Lowering(Protocol):
    """A family's `lowering` module: besides its bodies (`BODIES`, keyed by layer kind and op),
    what the generated module calls around the layer loop and on the host."""

    def prologue(self, k: Any) -> None:
        """Kernel-wide setup before the first layer (`k`: `mkc.runtime.context.Kernel`)."""

    def final_hidden(self, k: Any, head_norm: Any) -> Any:
        """The normed hidden state the lm_head multiplies, after the last layer."""

    def host_inputs(self, dims: Any, positions: Any) -> dict[str, Any]:
        """The VMEM inputs of a step computed on the host (`Family.vmem_inputs` lists them)."""


class Weights(Protocol):
    """A family's `weights` module: the upstream (HF-named) tensors cut into one rank's
    pieces, as `mkc.runtime.host` packs them. A family with routed experts also has
    `expert(hf, dims, per_rank, layer, local_expert, rank, shards, formats)`."""

    def matrix(self, hf: Mapping, dims: Any, per_rank: dict, layer: int, kind: str, name: str,
               rank: int, shards: Any) -> Any: ...

    def layer_vector(self, hf: Mapping, dims: Any, per_rank: dict, layer: int, kind: str,
                     name: str, rank: int, shards: Any) -> Any: ...

    def head_vectors(self, hf: Mapping, dims: Any, rank: int, shards: Any) -> Any: ...

    def embedding(self, hf: Mapping, dims: Any, rank: int, shards: Any) -> Any: ...

    def reference_states(self, state: Mapping, dims: Any, per_rank: dict, shards: Any,
                         kind_layers: Any) -> dict: ...

    def kernel_states(self, ref_states: Mapping, dims: Any, per_rank: dict, shards: Any,
                      kind_layers: Any, shapes: Mapping) -> dict:
        """The inverse of `reference_states`: the reference's states as the kernel's per-rank
        arrays (leading rank axis) of the per-rank state table `shapes`."""


class Reference(Protocol):
    """A family's `reference` module: the pure-JAX decode step the kernels are judged against,
    and its table of the upstream tensors (which the checkpoint loader and the generated
    module's weight check read)."""

    def load_config(self, path_or_dict: Any) -> Any:
        """The reference's config, built from the family's `read_dims` (one config reader)."""

    def param_shapes(self, cfg: Any) -> dict[str, tuple[tuple[int, ...], str]]: ...

    def init_params(self, cfg: Any, seed: int) -> dict[str, Any]: ...

    def init_cache(self, cfg: Any, batch: int, context: int) -> dict[str, Any]: ...

    def decode_step(self, params: Mapping, cfg: Any, cache: Mapping, tokens: Any,
                    positions: Any, rounding: Any = None) -> tuple[Any, dict]: ...


ROLES: dict[str, type] = {"lowering": Lowering, "weights": Weights, "reference": Reference}


class ContractError(TypeError):
    """A family module does not provide what its role promises (a family's bug, not a spec's)."""


def members(protocol: type) -> list[str]:
    """The functions a role protocol lists."""
    return sorted(n for n, v in vars(protocol).items() if not n.startswith("_") and callable(v))


def missing_members(module: ModuleType, protocol: type) -> list[str]:
    return [n for n in members(protocol) if not callable(getattr(module, n, None))]


def body_of(module: Any, kind: str, op: str) -> Callable[..., Any] | None:
    """The compute body of op `op` in layer kind `kind`: the lowering module's `BODIES[(kind,
    op)]` (its layer kinds composed from the layer library, `mkc.layers.sublayer.body_table`),
    or None."""
    return getattr(module, "BODIES", {}).get((kind, op))
