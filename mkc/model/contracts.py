"""What a model family's modules must provide, declared: the dims base the core reads, one
`Protocol` per module role the core and generated modules call (`Lowering`, `Weights`,
`Reference`), and `@lowers("op")`, which registers a compute body for a graph op.

The set of ops a family lowers is read from its lowering module's source (the `@lowers`
decorators), not imported: checking a spec must not load jax. `Family.module` checks, when it
imports a role's module, that the module has every function of the role's protocol and that
what the decorators registered at import is what the source declares.
"""
from __future__ import annotations

import ast
import functools
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Protocol, TypeVar


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
    """A family's `lowering` module: besides one body per op (`@lowers`), what the generated
    module calls around the layer loop and on the host."""

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


F = TypeVar("F", bound=Callable[..., Any])
_TAG = "__mkc_lowers__"


def lowers(op: str, kind: str | None = None) -> Callable[[F], F]:
    """Register the decorated function as the compute body of graph op `op`, in every layer
    kind or (`kind`) in that one. The generated module calls a body as `lower.<op>(c, ...)`,
    so the function is named after its op, or `<kind>_<op>` for one kind's."""
    name = op if kind is None else f"{kind}_{op}"

    def register(fn: F) -> F:
        if fn.__name__ != name:
            raise ContractError(f"@lowers({op!r}{'' if kind is None else f', kind={kind!r}'}) is on "
                                f"{fn.__name__}: a body is named {name}")
        setattr(fn, _TAG, op if kind is None else (kind, op))
        return fn
    return register


def body_of(module: Any, kind: str, op: str) -> Callable[..., Any] | None:
    """The compute body of op `op` in layer kind `kind`: the module's `BODIES[(kind, op)]` (a
    kind composed from the layer library), else its body registered for that kind, else its
    function named after the op; None if it has none."""
    body = getattr(module, "BODIES", {}).get((kind, op))
    if body is None and isinstance(kind, str):
        body = getattr(module, f"{kind}_{op}", None)
        body = body if getattr(body, _TAG, None) == (kind, op) else None
    return body if body is not None else getattr(module, op, None)


def registered_ops(module: ModuleType) -> frozenset[str]:
    """The ops whose bodies an imported lowering module holds (its own and re-exported, for
    every kind or for one)."""
    ops = set()
    for n, v in vars(module).items():
        tag = getattr(v, _TAG, None)
        if tag == n or (isinstance(tag, tuple) and n == f"{tag[0]}_{tag[1]}"):
            ops.add(tag if isinstance(tag, str) else tag[1])
    return frozenset(ops)


def declared_ops(module_name: str) -> frozenset[str]:
    """The ops a lowering module registers, read from its source without importing it: its
    functions decorated `@lowers("op")`, and names it imports from another `.lowering` module
    that registers them there."""
    return _declared(module_name)


@functools.cache
def _declared(module_name: str) -> frozenset[str]:
    spec = importlib.util.find_spec(module_name)
    if spec is None or not spec.origin:
        raise ContractError(f"no module {module_name}")
    with open(spec.origin, encoding="utf-8") as f:
        tree = ast.parse(f.read(), spec.origin)
    ops: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            ops.update(op for d in node.decorator_list if (op := _lowers_arg(d)) is not None)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.endswith(".lowering"):
            there = _declared(node.module)
            ops.update(a.asname or a.name for a in node.names if a.name in there)
    return frozenset(ops)


def _lowers_arg(decorator: ast.expr) -> str | None:
    """`op` of a `@lowers("op")` or `@lowers("op", kind="k")` (or `@<module>.lowers(...)`)
    decorator, else None."""
    if not (isinstance(decorator, ast.Call) and len(decorator.args) == 1
            and all(k.arg == "kind" for k in decorator.keywords)):
        return None
    func, arg = decorator.func, decorator.args[0]
    named = (isinstance(func, ast.Name) and func.id == "lowers") or \
        (isinstance(func, ast.Attribute) and func.attr == "lowers")
    return arg.value if named and isinstance(arg, ast.Constant) and isinstance(arg.value, str) else None
