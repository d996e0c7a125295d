"""The Kimi K3 schedule: VMEM budget, pool views that never overlap, the expert-slot protocol
and the cross-layer prefetch, proven over the full unrolled trace."""
import pytest

from mkc.checks import vmem_budget
from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from mkc.trace import (CopyStart, CopyWait, Read, TraceOptions, ViewClose, ViewOpen, build_trace,
                       periodic_tiles_traced)
from tests_support import K3_SPEC, k3_mini_text


@pytest.fixture(scope="module")
def k3():
    s = check_spec(K3_SPEC).ir
    return s, build_trace(s)


def test_budget_fits_at_batch_1_and_8_with_the_pool_as_largest_class(k3):
    s, events = k3
    budget = s.vmem_limit - s.vmem_reserve
    peaks = {b: vmem_budget(s, events, b)[0] for b in (1, 8)}
    assert peaks[1] < peaks[8] <= budget
    pool = s.buffer("staging")
    # The pool is its largest view: the attention matrices held whole (the reference holds
    # KDA's four, 29.84 MiB; the shipped spec streams the rest through the ring) or the expert
    # slots.
    assert pool.vmem_bytes == max(v.nbytes for v in s.pools[0].views)
    assert pool.vmem_bytes < 29.8 * 2**20


def test_views_of_the_pool_alternate_attention_experts_attention(k3):
    s, events = k3
    opens = [e for e in events if isinstance(e, ViewOpen)]
    closes = [e for e in events if isinstance(e, ViewClose)]
    # a layer's attention, its MoE's latent_down (the same view) and its experts
    assert len(opens) == len(closes) == 93 + 92 + 92
    seq = [e for e in events if isinstance(e, (ViewOpen, ViewClose))]
    for a, b in zip(seq[::2], seq[1::2]):                # strictly open, close, open, close ...
        assert (type(a), type(b)) == (ViewOpen, ViewClose) and a.view == b.view
    # Layer L+1's attention is opened inside layer L's MoE sublayer, L's latent_down inside
    # L's attention (prefetches).
    attention = [e for e in events if isinstance(e, ViewOpen) and e.view == "staging.attention"]
    assert attention[0].where == "prologue"
    assert [str(e.tag) for e in attention[:4]] == ["layer 0 kda", "layer 1 kda", "layer 1 moe",
                                                   "layer 2 kda"]
    for e in attention[1:]:
        opened_in = ("moe", "dense") if e.tag.label.split()[-1] != "moe" else ("kda", "mla")
        assert any(f" {kind} " in e.where for kind in opened_in), (e.where, e.tag)


def test_worst_case_routed_experts_cycle_through_the_slots(k3):
    """The checks' trace keeps a whole period of the worst case's 112 experts a layer, with its
    residue (`periodic_tiles_traced`); the step-time model's unrolls every one."""
    s, events = k3
    local = s.per_rank["local_experts"]
    count = min(s.top_k * s.batch_max, local)          # every row picks 16 local experts
    slots = s.pools[0].view("experts").slots
    traced = periodic_tiles_traced(count, slots, slots)
    assert count == 112 and traced < count and traced % slots == count % slots

    def layer3(events):                                # layer 3 is the first MoE sublayer
        return [e for e in events if isinstance(e, Read) and e.buffer == "staging.experts"
                and e.tag.layer == 3]
    reads = layer3(events)
    assert len(reads) == traced
    assert {e.slot for e in reads} == set(range(slots))
    assert [e.tag.expert for e in reads][-1] == traced - 1
    whole = layer3(build_trace(s, TraceOptions(whole_runs=True)))
    assert len(whole) == count


def test_each_routed_expert_is_one_copy_of_its_slot_image(k3):
    """Fetching an expert is one copy of all its matrices (`mkc.runtime.experts`): one start
    and one wait a fetched expert, each of the slot's bytes, which HBM holds for every local
    expert of every MoE layer, as the capacity check counts them."""
    s, events = k3
    view = s.pools[0].view("experts")
    starts = [e for e in events if isinstance(e, CopyStart) and e.buffer == "staging.experts"]
    waits = [e for e in events if isinstance(e, CopyWait) and e.sem[0] == "staging.experts"]
    fetched = {(e.tag.layer, e.tag.expert) for e in starts}
    assert len(starts) == len(waits) == len(fetched) > 92 * view.slots
    assert {e.nbytes for e in starts + waits} == {view.slot_bytes}
    assert [name for name, _ in starts[0].tag.matrices] == list(s.experts)
    moe_layers = s.layer_kinds.count("moe")
    assert s.hbm_bytes_per_rank["routed experts"] == (moe_layers * s.per_rank["local_experts"]
                                                      * view.slot_bytes)


def test_prefetch_during_routing_is_an_overlap():
    text = K3_SPEC.read_text().replace("prefetch next staging.attention after routed_experts",
                                       "prefetch next staging.attention after route")
    spec = K3_SPEC.parent.parent / "tests" / "broken_specs" / "k3_pool_views_overlap.sched"
    assert text in spec.read_text()
    with pytest.raises(MkcError) as e:
        check_spec(spec)
    d = next(d for d in e.value.diagnostics if d.code == "E-POOL-OVERLAP")
    # Routing at layer 1 opens both the experts and layer 2's attention: the diagnostic names
    # both views, points at the moved prefetch (the statement to change) and names the fetch.
    assert "staging.attention of layer 2 kda" in d.message
    assert "staging.experts of layer 1 moe" in d.message
    lines = spec.read_text().splitlines()
    assert lines[d.span.line - 1].strip() == "prefetch next staging.attention after route"
    assert lines[int(d.notes[0].split()[-1]) - 1].strip().startswith("fetch experts ->")


def test_topology_rederives_per_rank_shapes_and_collectives(tmp_path):
    """The same spec on 2 hosts (16 cores) with the MINI model: heads, experts and the
    two-level all-reduce's second stage follow the topology."""
    spec = tmp_path / "k3_16.sched"
    spec.write_text(k3_mini_text(K3_SPEC.read_text()))
    mini = check_spec(spec, "kimi_k3_mini").ir
    full = check_spec(K3_SPEC).ir
    assert full.kinds["kda"].allreduces[0].stages == ((8, 1), (4, 8))
    assert mini.kinds["kda"].allreduces[0].stages == ((8, 1), (2, 8))
    assert (full.per_rank["heads"], mini.per_rank["heads"]) == (3, 1)
    assert (full.per_rank["local_experts"], mini.per_rank["local_experts"]) == (112, 8)
    gathers = {g.after_op: (g.size, g.stride) for g in mini.kinds["moe"].allgathers}
    assert gathers == {"latent_down": (16, 1), "latent_up": (8, 1)}
