"""TPU targets: chip facts from JAX's own tables and topologies mapped onto TensorCore meshes."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from jax.experimental.pallas import tpu as pltpu

# Spec chip names -> JAX chip versions. Facts (VMEM, HBM, ...) are never copied by hand.
_CHIPS = {
    "v4": ("TPU_4", 2, "v4"),
    "v5e": ("TPU_5E", 1, "v5e"),
    "v5p": ("TPU_5P", 2, "v5p"),
    "v6e": ("TPU_6E", 1, "v6e"),
    "tpu7x": ("TPU_7X", 2, "tpu7x"),
}
# Chips per host for the topologies we map (a TPU7x host holds 4 chips).
_CHIPS_PER_HOST = {"v4": 4, "v5e": 8, "v5p": 4, "v6e": 8, "tpu7x": 4}


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
class Core:
    """One TensorCore: its rank in the flat mesh and where it sits physically."""

    rank: int
    chip: int
    core: int       # index within the chip
    host: int


@dataclass(frozen=True)
class Topology:
    chip: Chip
    dims: tuple[int, int, int]
    cores: tuple[Core, ...]

    @property
    def num_chips(self) -> int:
        return self.dims[0] * self.dims[1] * self.dims[2]

    @property
    def num_cores(self) -> int:
        return len(self.cores)

    @property
    def num_hosts(self) -> int:
        return max(c.host for c in self.cores) + 1

    @property
    def spec(self) -> str:
        """The string `jax.experimental.topologies.get_topology_desc` takes."""
        return f"{self.chip.topology_prefix}={'x'.join(map(str, self.dims))}"

    def siblings(self, rank: int) -> list[int]:
        """Other TensorCores on the same chip (the fast link)."""
        me = self.cores[rank]
        return [c.rank for c in self.cores if c.chip == me.chip and c.rank != rank]

    def same_host(self, rank: int) -> list[int]:
        me = self.cores[rank]
        return [c.rank for c in self.cores if c.host == me.host]


def topology(chip_name: str, dims: tuple[int, int, int]) -> Topology:
    """Map a chip topology onto ranks: cores of a chip are adjacent, chips of a host are adjacent.

    This matches the device order `get_topology_desc` returns for tpu7x (core fastest)."""
    c = chip(chip_name)
    per_host = _CHIPS_PER_HOST[chip_name]
    n_chips = dims[0] * dims[1] * dims[2]
    cores = tuple(Core(rank=ch * c.cores_per_chip + k, chip=ch, core=k, host=ch // per_host)
                  for ch in range(n_chips) for k in range(c.cores_per_chip))
    return Topology(chip=c, dims=dims, cores=cores)
