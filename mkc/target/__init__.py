"""TPU targets: chip facts from JAX's own tables and topologies mapped onto TensorCore meshes."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from jax.experimental.pallas import tpu as pltpu

# Spec chip names -> JAX chip versions. Facts (VMEM, HBM, ...) are never copied by hand.
# Only generations whose core count, host layout and libtpu compile mkc has verified are listed;
# other generations get a diagnostic rather than a kernel libtpu would reject.
_CHIPS = {
    "tpu7x": ("TPU_7X", 2, "tpu7x"),
}
# Chips per host for the topologies we map (a TPU7x host holds 4 chips).
_CHIPS_PER_HOST = {"tpu7x": 4}
# The largest pod of a generation, in chips: a bigger grid cannot exist.
MAX_CHIPS = {"tpu7x": 9216}


@dataclass(frozen=True)
class Chip:
    name: str
    cores_per_chip: int
    vmem_bytes: int          # per TensorCore
    smem_bytes: int
    hbm_bytes: int           # per TensorCore
    hbm_bytes_per_s: float   # per TensorCore
    bf16_flops: float
    lanes: int
    sublanes: int
    topology_prefix: str     # as jax.experimental.topologies spells the chip


def known_chips() -> list[str]:
    return sorted(_CHIPS)


@lru_cache(maxsize=None)
def chip(name: str) -> Chip:
    """Chip facts per TensorCore, from `pltpu.get_tpu_info_for_chip`."""
    version_name, cores, prefix = _CHIPS[name]
    info = pltpu.get_tpu_info_for_chip(getattr(pltpu.ChipVersion, version_name), 1)
    return Chip(name=name, cores_per_chip=cores, vmem_bytes=info.vmem_capacity_bytes,
                smem_bytes=info.smem_capacity_bytes, hbm_bytes=info.hbm_capacity_bytes,
                hbm_bytes_per_s=float(info.mem_bw_bytes_per_second),
                bf16_flops=float(info.bf16_ops_per_second), lanes=info.num_lanes,
                sublanes=info.num_sublanes, topology_prefix=prefix)


@dataclass(frozen=True)
class Topology:
    """Ranks over a chip grid: cores of a chip are adjacent, chips of a host are adjacent.

    Everything is arithmetic on the grid, so a topology of any size costs nothing to describe
    (the mesh check can then reject a wrong size before any per-rank work)."""

    chip: Chip
    dims: tuple[int, int, int]
    chips_per_host: int

    @property
    def num_chips(self) -> int:
        return self.dims[0] * self.dims[1] * self.dims[2]

    @property
    def num_cores(self) -> int:
        return self.num_chips * self.chip.cores_per_chip

    @property
    def cores_per_host(self) -> int:
        return min(self.chips_per_host, self.num_chips) * self.chip.cores_per_chip

    @property
    def num_hosts(self) -> int:
        return -(-self.num_cores // self.cores_per_host)

    @property
    def spec(self) -> str:
        """The string `jax.experimental.topologies.get_topology_desc` takes."""
        return f"{self.chip.topology_prefix}={'x'.join(map(str, self.dims))}"

    def siblings(self, rank: int) -> list[int]:
        """Other TensorCores on the same chip (the fast link)."""
        first = rank - rank % self.chip.cores_per_chip
        return [r for r in range(first, first + self.chip.cores_per_chip) if r != rank]

    def same_host(self, rank: int) -> list[int]:
        first = rank - rank % self.cores_per_host
        return list(range(first, min(first + self.cores_per_host, self.num_cores)))


def topology(chip_name: str, dims: tuple[int, int, int]) -> Topology:
    """This matches the device order `get_topology_desc` returns for tpu7x (core fastest)."""
    return Topology(chip=chip(chip_name), dims=dims, chips_per_host=_CHIPS_PER_HOST[chip_name])
