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
