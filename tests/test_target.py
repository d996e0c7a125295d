import pytest
from jax.experimental import topologies
from jax.experimental.pallas import tpu as pltpu

from mkc import target


def test_chip_facts_come_from_jax():
    c = target.chip("tpu7x")
    assert c.vmem_bytes == 64 << 20 and c.cores_per_chip == 2 and c.lanes == 128


def test_topology_maps_cores_chips_and_hosts():
    t = target.topology("tpu7x", (2, 2, 4))
    assert t.num_chips == 16 and t.num_cores == 32 and t.num_hosts == 4
    assert t.siblings(5) == [4]
    assert t.same_host(9) == list(range(8, 16))
    assert t.spec == "tpu7x=2x2x4"


def test_generations_are_spelled_as_jax_spells_them():
    """The table's prefixes and grid dimensionality are JAX's own (its device-kind table), and
    every chip version is a real `pltpu.ChipVersion` member."""
    jax_spelling = {name.split("=")[0]: len(name.split("=")[1].split("x"))
                    for name, platform in topologies._DEVICE_KIND_TO_TOPOLOGY.values()}
    for name in target.all_generations():
        g = target.generation(name)
        assert jax_spelling[g.prefix] == g.ndims, name
        assert isinstance(getattr(pltpu.ChipVersion, g.version), pltpu.ChipVersion)
    assert {"v4", "v5e", "v5p", "v6e", "tpu7x"} <= set(target.known_chips())
    assert {target.generation(n).prefix for n in target.all_generations()} == set(jax_spelling)


# generation: (ranks per chip, TensorCores per rank, VMEM MiB per TensorCore, HBM GB per rank),
# as JAX's chip table and libtpu's one-chip topology give them (jax 0.12.0.1, libtpu 0.0.50.1).
FACTS = {"v4": (2, 1, 16, 17.2), "v5e": (1, 1, 128, 17.2), "v5p": (1, 2, 64, 103.0),
         "v6e": (1, 1, 128, 34.4), "tpu7x": (2, 1, 64, 103.0)}


@pytest.mark.parametrize("name", sorted(FACTS))
def test_per_generation_chip_facts(name):
    c = target.chip(name)
    ranks, tcs, vmem_mib, hbm_gb = FACTS[name]
    assert (c.cores_per_chip, c.tensorcores_per_rank) == (ranks, tcs)
    assert c.vmem_bytes == vmem_mib << 20 and round(c.hbm_bytes / 1e9, 1) == hbm_gb


# (generation, grid): (ranks, hosts, siblings of rank 1, ranks on rank 5's host)
LAYOUTS = {("v6e", (2, 4)): (8, 2, [], [4, 5, 6, 7]),
           ("v5e", (4, 4)): (16, 4, [], [4, 5, 6, 7]),
           ("v5p", (2, 2, 2)): (8, 2, [], [4, 5, 6, 7]),
           ("v4", (2, 2, 1)): (8, 1, [0], list(range(8))),
           ("tpu7x", (2, 2, 2)): (16, 2, [0], list(range(8)))}


@pytest.mark.parametrize("name, dims", sorted(LAYOUTS))
def test_device_counts_and_groups_follow_libtpu(name, dims):
    t = target.topology(name, dims)
    ranks, hosts, sib, host5 = LAYOUTS[name, dims]
    assert (t.num_cores, t.num_hosts) == (ranks, hosts)
    assert t.siblings(1) == sib and t.same_host(5) == host5
    # The rank order is the generated module's (by process, then device id), and the groups
    # above are the chips and hosts of libtpu's own devices.
    devices = sorted(topologies.get_topology_desc(t.spec, platform="tpu").devices,
                     key=lambda d: (d.process_index, d.id))
    assert len(devices) == t.num_cores
    for r, d in enumerate(devices):
        assert [p for p in range(t.num_cores) if p != r and
                tuple(devices[p].coords) == tuple(d.coords)] == t.siblings(r)
        assert [p for p in range(t.num_cores)
                if devices[p].process_index == d.process_index] == t.same_host(r)


@pytest.mark.parametrize("name, dims, words", [
    ("v6e", (2, 2, 2), "v6e topologies have 2 dimensions, not 3"),
    ("tpu7x", (2, 4), "tpu7x topologies have 3 dimensions, not 2"),
    ("v6e", (3, 3), "libtpu cannot lay out topology v6e=3x3"),
    ("v6e", (0, 4), "has no chips"),
    ("v6e", (32, 32), "the largest v6e pod has 256")])
def test_impossible_topologies_say_what_would_do(name, dims, words):
    with pytest.raises(target.TargetError) as e:
        target.topology(name, dims)
    assert words in e.value.message
    assert f"{name} slices: " in e.value.hint and ("2x4," if name == "v6e" else "2x2x1,") in e.value.hint


def test_standard_shapes_start_at_one_chip_and_double():
    assert target.standard_shapes("v6e")[:4] == ["1x1", "2x2", "2x4", "4x4"]
    assert target.standard_shapes("tpu7x")[:5] == ["1x1x1", "2x2x1", "2x2x2", "2x2x4", "2x4x4"]


def test_a_slice_smaller_than_a_host_retries_with_its_own_bounds_only():
    # libtpu 0.0.48's refusal of tpu7x=1x1x1 (vLLM TPU's pin); any other refusal is libtpu's
    refused = ('INVALID_ARGUMENT: Topology layout "tpu7x=1x1x1" is not divisible by the given (or '
               'default) chips_per_host_bounds "2x2x1"')
    assert target._within_one_host("tpu7x=1x1x1", refused) == (1, 1, 1)
    assert target._within_one_host("tpu7x=2x2x1", refused) == (2, 2, 1)
    assert target._within_one_host("tpu7x=2x2x2", refused) is None      # more than a host
    assert target._within_one_host("tpu7x=1x1", refused) is None        # another rank of grid
    assert target._within_one_host("tpu7x", refused) is None
    assert target._within_one_host("tpu7x=1x1x1", "UNAVAILABLE: no libtpu") is None
