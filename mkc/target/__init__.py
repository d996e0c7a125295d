"""TPU targets: chip facts from JAX's own tables and topologies mapped onto TensorCore meshes.

Nothing about a chip's layout is assumed: how many mesh ranks (devices) a chip holds, how many
TensorCores a device is, which host each device sits on and the order of the devices all come
from libtpu's compile-only topologies (`jax.experimental.topologies.get_topology_desc`), which
need no TPU. Capacities and rates come from `pltpu.get_tpu_info_for_chip`.
"""
from __future__ import annotations

import os
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from math import prod



@dataclass(frozen=True)
class Generation:
    """How a spec and JAX spell one TPU generation."""

    name: str              # as a spec writes it: `target v6e topology 2x4`
    version: str           # the `pltpu.ChipVersion` member
    prefix: str            # as `jax.experimental.topologies` spells it ("v6e=2x4")
    ndims: int             # the grid's dimensions, as JAX writes the generation's topologies
    max_chips: int         # the largest slice (a bigger grid cannot exist)
    unsupported: str = ""  # why mkc refuses the generation, if it does
    # Whether Mosaic takes FP8 (e4m3) values as a matmul operand (a bf16 x fp8 dot), measured
    # by benchmarks/format_probe.py: v4 refuses it (E2001 CompileTimeMosaicUnsupportedRhsType
    # vector<..xf8E4M3FN>); v5e, v5p, v6e and tpu7x compile it.
    fp8_operand: bool = True
    # Whether Mosaic takes FP4 (e2m1) values as a matmul operand (a bf16 x fp4 dot, the codes
    # two a byte, `format CLASS fp4 block N`), measured by benchmarks/format_probe.py: tpu7x
    # compiles it (its LLO unpacks the nibbles to bytes, `vunpack.c.{l,u}.s4.s8`, and pushes
    # them as f8e4m3, `vmatpush1.f8e4m3`: `--bundles`);
    # v4, v5e, v5p and v6e refuse it (Mosaic: "Bad lhs/rhs type: 'vector<16x..xbf16>'
    # 'vector<..xf4E2M1FN>'").
    fp4_operand: bool = False


# Every generation both JAX's chip table and libtpu's compile-only topologies know (jax 0.12,
# libtpu 0.0.50). Prefixes and dimensionality are JAX's own spelling
# (`jax.experimental.topologies._DEVICE_KIND_TO_TOPOLOGY`: "v6e=1x1", "v5p=1x1x1"; a test
# keeps this table equal to it). TPU_7, TPU_8I and TPU_8T are in the chip table but libtpu
# has no topology for them ("Invalid TPU external name"). The pod sizes are the largest
# slices of Google Cloud's TPU documentation: JAX does not know them. v2, v3 and v4i are
# known but refused, each for the reason given (tests/test_tpu_compile.py compiles a MINI
# kernel for every other generation).
_NO_BF16_MATMUL = ("Mosaic has no bf16 matmul on {}: libtpu rejects every mkc kernel "
                   "(E2001 CompileTimeMosaicUnsupportedRhsType)")
_GENERATIONS = {g.name: g for g in (
    Generation("v2", "TPU_V2", "v2", 2, 256, _NO_BF16_MATMUL.format("v2")),
    Generation("v3", "TPU_V3", "v3", 2, 1024, _NO_BF16_MATMUL.format("v3")),
    Generation("v4i", "TPU_V4I", "v4 lite", 2, 1,
               "an inference chip Cloud TPU does not offer: no slice shapes to check against"),
    Generation("v4", "TPU_V4", "v4", 3, 4096, fp8_operand=False),
    Generation("v5e", "TPU_V5E", "v5e", 2, 256),
    Generation("v5p", "TPU_V5P", "v5p", 3, 8960),
    Generation("v6e", "TPU_V6E", "v6e", 2, 256),
    Generation("tpu7x", "TPU_7X", "tpu7x", 3, 9216, fp4_operand=True),
)}


class TargetError(Exception):
    """A target mkc cannot map: what is wrong and how to fix it (resolve adds the span)."""

    def __init__(self, message: str, hint: str):
        super().__init__(message)
        self.message, self.hint = message, hint


@dataclass(frozen=True)
class Chip:
    name: str
    version: str             # pltpu.ChipVersion member
    cores_per_chip: int      # mesh ranks (libtpu devices) per chip: 2 on v4 and tpu7x, else 1
    tensorcores_per_rank: int  # TensorCores one device drives (2 on v5p: megacore)
    vmem_bytes: int          # per TensorCore
    smem_bytes: int
    hbm_bytes: int           # per rank
    hbm_bytes_per_s: float   # per rank
    bf16_flops: float        # per rank
    lanes: int
    sublanes: int
    topology_prefix: str     # as jax.experimental.topologies spells the chip
    topology_ndims: int
    max_chips: int


def known_chips() -> list[str]:
    """The generations mkc compiles for, oldest first."""
    return [n for n, g in _GENERATIONS.items() if not g.unsupported]


def all_generations() -> list[str]:
    """Every generation JAX's chip table and libtpu's topologies share, refused ones too."""
    return list(_GENERATIONS)


def generation(name: str) -> Generation:
    return _GENERATIONS[name]


@contextmanager
def _quiet_stderr():
    """libtpu prints TPU-VM discovery warnings (accelerator type, worker hostnames) straight
    to fd 2 when it loads on a machine without a TPU; compile-only topologies need neither."""
    sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:            # no fd 2 to quiet
        yield
        return
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


_HOST_BOUNDS = re.compile(r'chips_per_host_bounds "(\d+(?:x\d+)*)"')


def _within_one_host(spec: str, error: str) -> tuple[int, ...] | None:
    """The slice's own shape as its host bounds when libtpu refused it only for being smaller
    than a host (an older libtpu, 0.0.48 of vLLM TPU's pin, lays out tpu7x=1x1x1 only so);
    None for any other refusal."""
    bounds = _HOST_BOUNDS.search(error)
    shape = spec.partition("=")[2]
    if bounds is None or not re.fullmatch(r"\d+(?:x\d+)*", shape):
        return None
    dims = tuple(int(d) for d in shape.split("x"))
    host = tuple(int(d) for d in bounds.group(1).split("x"))
    if len(host) != len(dims) or any(d > h for d, h in zip(dims, host)):
        return None
    return dims


def topology_devices(spec: str) -> list:
    """libtpu's compile-only devices of topology `spec` ("tpu7x=2x2x1"), in rank order: by
    process (host), then device id, as generated modules' `make_mesh` orders them. Raises
    RuntimeError (JAX's) if libtpu refuses the topology or is not installed."""
    # libtpu holds /tmp/libtpu_lockfile for the life of a process that loads it; compile-only
    # topologies touch no TPU, so a second mkc (or test worker) may load it as well.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies
    with _quiet_stderr():
        try:
            devices = topologies.get_topology_desc(spec, platform="tpu").devices
        except RuntimeError as e:
            within = _within_one_host(spec, str(e))
            if within is None:
                raise
            devices = topologies.get_topology_desc(spec, platform="tpu",
                                                   chips_per_host_bounds=within).devices
    return sorted(devices, key=lambda d: (d.process_index, d.id))


@lru_cache(maxsize=256)
def _devices(spec: str) -> tuple[tuple[tuple[int, ...], int, int], ...]:
    """(chip coordinates, host, TensorCores) per device of a compile-only topology, in rank
    order. Raises TargetError with libtpu's message if libtpu refuses the topology."""
    try:
        devices = topology_devices(spec)
    except RuntimeError as e:   # JaxRuntimeError, or libtpu not installed
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise TargetError(f"libtpu cannot lay out topology {spec}: {text}",
                          "write a slice shape of the generation") from None
    return tuple((tuple(d.coords), d.process_index, int(getattr(d, "num_cores", 1)))
                 for d in devices)


@lru_cache(maxsize=None)
def chip(name: str) -> Chip:
    """Chip facts: capacities per TensorCore from `pltpu.get_tpu_info_for_chip`, the layout of
    one chip (devices, TensorCores per device) from libtpu's one-chip topology."""
    g = _GENERATIONS[name]
    one = _devices(f"{g.prefix}={'x'.join(['1'] * g.ndims)}")
    tcs = one[0][2]
    from jax.experimental.pallas import tpu as pltpu    # JAX loads only once a chip is needed
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, g.version), tcs)
    # JAX's facts are per TensorCore; a rank (device) owns `tcs` of them. VMEM stays per
    # TensorCore: a grid-less kernel runs on one.
    return Chip(name=name, version=g.version, cores_per_chip=len(one), tensorcores_per_rank=tcs,
                vmem_bytes=info.vmem_capacity_bytes, smem_bytes=info.smem_capacity_bytes,
                hbm_bytes=info.hbm_capacity_bytes * tcs,
                hbm_bytes_per_s=float(info.mem_bw_bytes_per_second) * tcs,
                bf16_flops=float(info.bf16_ops_per_second) * tcs, lanes=info.num_lanes,
                sublanes=info.num_sublanes, topology_prefix=g.prefix, topology_ndims=g.ndims,
                max_chips=g.max_chips)


@dataclass(frozen=True)
class Topology:
    """Ranks over a chip grid, in libtpu's device order: the ranks of a chip are adjacent and
    the chips of a host are adjacent (`topology` checks both), so groups are arithmetic."""

    chip: Chip
    dims: tuple[int, ...]
    num_cores: int           # mesh ranks (devices)
    cores_per_host: int

    @property
    def num_chips(self) -> int:
        return prod(self.dims)

    @property
    def num_hosts(self) -> int:
        return self.num_cores // self.cores_per_host

    @property
    def chips_per_host(self) -> int:
        return self.cores_per_host // self.chip.cores_per_chip

    @property
    def shape(self) -> str:
        return "x".join(map(str, self.dims))

    @property
    def spec(self) -> str:
        """The string `jax.experimental.topologies.get_topology_desc` takes."""
        return f"{self.chip.topology_prefix}={self.shape}"

    def siblings(self, rank: int) -> list[int]:
        """Other ranks on the same chip (the fast link); none on a one-core chip."""
        first = rank - rank % self.chip.cores_per_chip
        return [r for r in range(first, first + self.chip.cores_per_chip) if r != rank]

    def same_host(self, rank: int) -> list[int]:
        first = rank - rank % self.cores_per_host
        return list(range(first, first + self.cores_per_host))


def _check_shape(g: Generation, dims: tuple[int, ...]) -> None:
    """What can be said without libtpu (which crashes on a zero dimension)."""
    shape = "x".join(map(str, dims))
    if len(dims) != g.ndims:
        raise TargetError(
            f"{g.name} topologies have {g.ndims} dimensions, not {len(dims)} ({shape})",
            f"write the {g.name} chip grid as JAX does; {_slices(g.name)}")
    if min(dims) < 1:
        raise TargetError(f"topology {shape} has no chips",
                          f"every topology dimension must be at least 1; {_slices(g.name)}")
    if prod(dims) > g.max_chips:
        raise TargetError(f"topology {shape} has {prod(dims)} chips; the largest {g.name} pod "
                          f"has {g.max_chips}",
                          f"write the chip grid of the slice you run on; {_slices(g.name)}")


@lru_cache(maxsize=256)
def rank_chip_coords(chip_name: str, dims: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """Each rank's chip coordinates in the slice, as libtpu lays the ranks out (3 per chip,
    2-D grids too)."""
    g = _GENERATIONS[chip_name]
    return tuple(coords for coords, _, _ in _devices(f"{g.prefix}={'x'.join(map(str, dims))}"))


def topology(chip_name: str, dims: tuple[int, ...]) -> Topology:
    """The generation's slice `dims` as libtpu lays it out; TargetError if it cannot exist."""
    g = _GENERATIONS[chip_name]
    _check_shape(g, dims)
    c = chip(chip_name)
    shape = "x".join(map(str, dims))
    try:
        devices = _devices(f"{g.prefix}={shape}")
    except TargetError as e:
        raise TargetError(e.message, _slices(chip_name)) from None
    # Group sizes as libtpu reports them, then the contiguity the arithmetic above relies on.
    per_chip: dict[tuple[int, ...], list[int]] = {}
    per_host: dict[int, list[int]] = {}
    for rank, (coords, host, _) in enumerate(devices):
        per_chip.setdefault(coords, []).append(rank)
        per_host.setdefault(host, []).append(rank)
    host_size = len(next(iter(per_host.values())))
    runs = list(per_chip.values()) + list(per_host.values())
    if (any(len(r) != c.cores_per_chip for r in per_chip.values())
            or any(len(r) != host_size for r in per_host.values())
            or any(r != list(range(r[0], r[0] + len(r))) for r in runs)):
        raise TargetError(f"libtpu's devices for {g.prefix}={shape} do not keep the ranks of a "
                          "chip and of a host adjacent, as mkc's rank groups need",
                          _slices(chip_name))
    return Topology(chip=c, dims=dims, num_cores=len(devices), cores_per_host=host_size)


def _slices(chip_name: str) -> str:
    return f"{chip_name} slices: {', '.join(standard_shapes(chip_name))}"


def _accepted(g: Generation, dims: tuple[int, ...]) -> bool:
    try:
        _devices(f"{g.prefix}={'x'.join(map(str, dims))}")
        return True
    except TargetError:
        return False


@lru_cache(maxsize=None)
def standard_shapes(chip_name: str) -> list[str]:
    """The generation's slice shapes, smallest first: one chip, then the power-of-two grids
    Cloud TPU sells (2-D: 2x2, 2x4, 4x4, 4x8, ...; 3-D: 2x2x1, 2x2x2, 2x2x4, 2x4x4, ...),
    up to the pod, each one libtpu accepts."""
    g = _GENERATIONS[chip_name]
    grids = [(1,) * g.ndims]
    dims = [2, 2] + [1] * (g.ndims - 2)
    while prod(dims) <= g.max_chips:
        grids.append(tuple(dims))
        # double the rightmost smallest dimension: 2x2x1 -> 2x2x2 -> 2x2x4 -> 2x4x4 -> 4x4x4
        small = min(dims)
        dims[max(i for i, d in enumerate(dims) if d == small)] *= 2
    return ["x".join(map(str, d)) for d in grids if prod(d) <= g.max_chips and _accepted(g, d)]


def shapes_of_ranks(chip_name: str, ranks: int) -> list[str]:
    """The generation's slice shapes (`standard_shapes`) that hold `ranks` mesh ranks."""
    per_chip = chip(chip_name).cores_per_chip
    return [shape for shape in standard_shapes(chip_name)
            if prod(int(d) for d in shape.split("x")) * per_chip == ranks]
