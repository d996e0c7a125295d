"""The step-time simulator against analytic answers on small synthetic traces."""
import pytest

from mkc.compiler import check_spec
from mkc.diagnostics import Span
from mkc.perf import constants
from mkc.perf.sim import DmaEngine, Model, simulate
from mkc.perf.work import KernelWork, OpWork, Work
from mkc.tags import LayerBegins, OpBegins, RingTile
from mkc.trace import TraceBuilder
from tests_support import SPEC

SPAN = Span.unknown("t.sched")
BW = 1e12          # bytes/s after efficiency
ISSUE = 1e-6


@pytest.fixture(scope="module")
def qwen_ir():
    return check_spec(SPEC, "qwen3_8_mini").ir


def _rates(**kw):
    base = constants.rates("tpu7x").replace(
        hbm_efficiency=1.0, dma_overhead_bytes=0.0, dma_issue_s=ISSUE,
        step_fixed_s=0.0, op_overhead_s=0.0, dma_queues=1)
    return base.replace(hbm_bytes_per_s=BW, **kw)


def _feed_only(batch: int) -> KernelWork:
    """Work of a kernel whose one op (gdn.matmul) only multiplies by the weights it reads: a
    weight value costs its MXU load, nothing else."""
    op = OpWork("gdn", "matmul", weights=Work(matrix={("bf16", batch): 1.0}))
    return KernelWork(batch, {("gdn", "matmul"): op}, Work(), "synthetic")


class _Trace:
    """Build synthetic events: starts, waits and weight reads (compute) of one op."""

    def __init__(self):
        self.tb = TraceBuilder()
        self.events = self.tb.events
        self.tb.begin_layer(LayerBegins("gdn", 0), "", SPAN)    # inside a layer (not the prologue)
        self.tb.begin_op(OpBegins("gdn", "matmul", 0), "", SPAN)

    def start(self, sem, nbytes):
        self.tb.start(dst=f"buf{sem}", slot=None, sem=(f"buf{sem}",), nbytes=nbytes, tag=None,
                      where="", span=SPAN)

    def wait(self, sem):
        self.tb.wait(sem=(f"buf{sem}",), nbytes=0, where=f"wait {sem}", span=SPAN)

    def compute(self, nbytes):
        """A weight read of `nbytes` bf16: nbytes / 2 values fed to the MXU."""
        self.tb.read("weights", 0, RingTile(0), "", SPAN, nbytes)


def _run(s, trace, batch=1, **kw):
    return simulate(Model(s, batch, 0, _rates(**kw), work=_feed_only(batch)), trace.events)


def test_one_copy_takes_its_bytes_over_bandwidth_plus_issue_cost(qwen_ir):
    X = 8 << 20
    tr = _Trace()
    tr.start(0, X)
    tr.wait(0)
    res = _run(qwen_ir, tr)
    assert res.step_s == pytest.approx(ISSUE + X / BW, rel=1e-12)
    assert res.by_cause["stalls"] == pytest.approx(res.step_s)


def test_per_copy_overhead_makes_small_copies_less_efficient(qwen_ir):
    small = _Trace()
    for i in range(16):
        small.start(i, 4096)
    for i in range(16):
        small.wait(i)
    one = _Trace()
    one.start(0, 16 * 4096)
    one.wait(0)
    kw = {"dma_overhead_bytes": 2048.0}
    assert _run(qwen_ir, small, **kw).step_s == pytest.approx(ISSUE + 16 * (4096 + 2048) / BW)
    assert _run(qwen_ir, one, **kw).step_s == pytest.approx(ISSUE + (16 * 4096 + 2048) / BW)


def test_two_copies_in_flight_share_bandwidth(qwen_ir):
    X = 1 << 20
    eng = DmaEngine(BW, ISSUE, 0.0)
    a, b = eng.issue(0.0, X), eng.issue(0.0, 3 * X)
    # issued together: their issue costs overlap, their bytes share the bandwidth, in order
    assert eng.landing(a) == pytest.approx(ISSUE + X / BW)
    assert eng.landing(b) == pytest.approx(ISSUE + 4 * X / BW)
    assert eng.busy(eng.landing(b)) == pytest.approx(4 * X / BW)
    # a copy issued while another moves waits for the bandwidth it is using
    eng = DmaEngine(BW, 0.0, 0.0)
    a = eng.issue(0.0, 2 * X)
    b = eng.issue(X / BW, 2 * X)
    assert eng.landing(a) == pytest.approx(2 * X / BW)
    assert eng.landing(b) == pytest.approx(4 * X / BW)
    # the same through the simulator: two copies waited together
    tr = _Trace()
    tr.start(0, X)
    tr.start(1, 3 * X)
    tr.wait(0)
    tr.wait(1)
    assert _run(qwen_ir, tr).step_s == pytest.approx(ISSUE + 4 * X / BW)


def test_two_queues_share_bandwidth_one_queue_keeps_order(qwen_ir):
    X = 1 << 20
    # two copies issued together on two queues: both flow at once, each at half the bandwidth,
    # and land together; the engine moves bytes at the full bandwidth all along
    two = DmaEngine(BW, ISSUE, 0.0, queues=2)
    a, b = two.issue(0.0, X), two.issue(0.0, X)
    assert two.queue_of[a] != two.queue_of[b]
    assert two.landing(a) == pytest.approx(ISSUE + 2 * X / BW)
    assert two.landing(b) == pytest.approx(ISSUE + 2 * X / BW)
    assert two.begins[a] == two.begins[b] == pytest.approx(ISSUE)
    assert two.busy(two.landing(b)) == pytest.approx(2 * X / BW)
    # on one queue the second waits for the first: the first lands after its own bytes
    one = DmaEngine(BW, ISSUE, 0.0, queues=1)
    a, b = one.issue(0.0, X), one.issue(0.0, X)
    assert one.landing(a) == pytest.approx(ISSUE + X / BW)
    assert one.landing(b) == pytest.approx(ISSUE + 2 * X / BW)
    assert one.begins[b] == pytest.approx(one.landing(a))
    # the same through the simulator: waiting for the first copy costs twice as long on two
    # queues, the step (both copies) the same
    tr = _Trace()
    tr.start(0, X)
    tr.start(1, X)
    tr.wait(0)
    res = {q: _run(qwen_ir, tr, dma_queues=q) for q in (1, 2)}
    assert res[1].step_s == pytest.approx(ISSUE + X / BW)
    assert res[2].step_s == pytest.approx(ISSUE + 2 * X / BW)
    tr.wait(1)
    for q in (1, 2):
        assert _run(qwen_ir, tr, dma_queues=q).step_s == pytest.approx(ISSUE + 2 * X / BW)


def test_a_small_copy_takes_the_least_loaded_queue_past_a_large_one():
    X = 1 << 20
    eng = DmaEngine(BW, 0.0, 0.0, queues=2)
    big, small = eng.issue(0.0, 8 * X), eng.issue(0.0, X)
    assert eng.queue_of[small] != eng.queue_of[big]
    # they share the bandwidth until the small one lands, then the large one has it alone
    assert eng.landing(small) == pytest.approx(2 * X / BW)
    # a third copy joins the queue with fewer bytes left (the small one's, now empty)
    third = eng.issue(4 * X / BW, X)
    assert eng.queue_of[third] == eng.queue_of[small]
    # from 4X/BW the large one has 5X left, the third X: shared until the third lands at 6X/BW
    assert eng.landing(third) == pytest.approx(6 * X / BW)
    assert eng.landing(big) == pytest.approx(10 * X / BW)
    single = DmaEngine(BW, 0.0, 0.0, queues=2)
    assert single.landing(single.issue(0.0, 8 * X)) == pytest.approx(8 * X / BW)
    with pytest.raises(ValueError):
        single.issue(0.0, X)                 # issued before what the engine already moved
    # on one queue the small copy waits behind the large one
    one = DmaEngine(BW, 0.0, 0.0, queues=1)
    one.issue(0.0, 8 * X)
    assert one.landing(one.issue(0.0, X)) == pytest.approx(9 * X / BW)


def test_a_round_robin_engine_lands_each_copy_later_the_more_are_in_flight():
    """TPU7x's DMA engine round-robins among the outstanding descriptors (`dma_queues` 0): n
    equal copies issued together all land at n x their time, so the copy needed first lands
    later with every copy issued beside it; the bytes still move at the full bandwidth."""
    X = 1 << 20
    for n in (1, 3, 6):
        eng = DmaEngine(BW, 0.0, 0.0, queues=0)
        ids = [eng.issue(0.0, X) for _ in range(n)]
        assert [eng.landing(i) for i in ids] == pytest.approx([n * X / BW] * n)
    # a copy issued later joins the others in flight; lanes are reused once free
    eng = DmaEngine(BW, 0.0, 0.0, queues=0)
    first, second = eng.issue(0.0, 2 * X), eng.issue(0.0, X)
    assert eng.landing(second) == pytest.approx(2 * X / BW)       # shared until it lands
    third = eng.issue(2 * X / BW, X)
    assert eng.queue_of[third] == eng.queue_of[second]
    assert eng.landing(first) == eng.landing(third) == pytest.approx(4 * X / BW)
    with pytest.raises(ValueError, match="0: one per copy in flight"):
        DmaEngine(BW, 0.0, 0.0, queues=-1)
    # more queues than copies in flight change nothing
    for q in (1, 4):
        e = DmaEngine(BW, ISSUE, 0.0, queues=q)
        assert e.landing(e.issue(0.0, X)) == pytest.approx(ISSUE + X / BW)


def test_wait_on_a_late_copy_stalls_compute_by_the_difference(qwen_ir):
    r = _rates()
    X, W = 64 << 20, 4 << 20                      # a big copy, a short matmul
    compute = (W / 2) / r.feed_values_per_s("bf16")
    landing = ISSUE + X / BW
    assert compute < landing
    tr = _Trace()
    tr.start(0, X)
    tr.compute(W)
    tr.wait(0)
    res = _run(qwen_ir, tr)
    assert res.step_s == pytest.approx(landing)
    assert res.by_cause["stalls"] == pytest.approx(landing - compute)
    assert res.stalls[0].buffer == "buf0" and res.stalls[0].count == 1
    # and a copy that lands during compute costs no stall
    W = 256 << 20
    compute = (W / 2) / r.feed_values_per_s("bf16")
    assert compute > ISSUE + 1024 / BW
    tr = _Trace()
    tr.start(0, 1024)
    tr.compute(W)
    tr.wait(0)
    res = _run(qwen_ir, tr)
    assert res.by_cause["stalls"] == 0 and res.step_s == pytest.approx(compute)


def _stream(n, ahead, tile, work):
    """n tiles through a ring `ahead` deep: wait tile t, compute on it, start tile t + ahead."""
    tr = _Trace()
    for t in range(min(ahead, n)):
        tr.start(t, tile)
    for t in range(n):
        tr.wait(t)
        tr.compute(work)
        if t + ahead < n:
            tr.start(t + ahead, tile)
    return tr


def test_deeper_prefetch_never_makes_a_dma_bound_stream_slower(qwen_ir):
    tile, work = 2 << 20, 1 << 20           # the copy of a tile takes longer than its compute
    times = [_run(qwen_ir, _stream(64, ahead, tile, work)).step_s for ahead in range(1, 12)]
    assert all(b <= a * (1 + 1e-12) for a, b in zip(times, times[1:])), [t * 1e6 for t in times]
    # deep enough, the stream runs at the bandwidth: all bytes, one issue cost, the last compute
    r = _rates()
    last = (work / 2) / r.feed_values_per_s("bf16")
    assert times[-1] == pytest.approx(ISSUE + 64 * tile / BW + last, rel=1e-6)
    assert times[0] > times[-1]
    # On several queues the copies in flight share the bandwidth, so a deeper prefetch can
    # land the next copy a little later (under 1 % here); deep enough, the stream still runs
    # at the bandwidth, and never beats one queue.
    for q in (2, 4):
        qt = [_run(qwen_ir, _stream(64, ahead, tile, work), dma_queues=q).step_s
              for ahead in range(1, 12)]
        assert all(b <= a * 1.01 for a, b in zip(qt, qt[1:])), [t * 1e6 for t in qt]
        assert qt[-1] == pytest.approx(times[-1], rel=0.01) and min(qt) >= times[-1] * (1 - 1e-9)


def test_deeper_ring_in_a_real_spec_is_hardly_slower(tmp_path):
    """In a real spec the ring's tiles share the in-order queue with KV tiles and state copies:
    tiles issued further ahead can delay a KV copy queued behind them, so a deeper ring may cost
    a little; it never costs more than 3 % from one depth to the next, and the spec's 19 ahead
    beats 1 ahead."""
    text = SPEC.read_text()
    assert "stream weights ahead 19" in text
    steps = []
    for ahead in (1, 2, 4, 8, 14, 19):
        p = tmp_path / f"ahead{ahead}.sched"
        p.write_text(text.replace("stream weights ahead 19", f"stream weights ahead {ahead}"))
        c = check_spec(p, "qwen3_8_mini")
        from mkc.perf.run import step_model
        steps.append(step_model(c.ir, 1, 256, keep_timeline=False).step_s)
    assert all(b <= a * 1.03 for a, b in zip(steps, steps[1:])), steps
    assert steps[-1] < steps[0]


def test_counted_work_is_priced_by_the_unit_that_runs_it(qwen_ir):
    """A matmul class costs the longer of loading its values into the MXU and its FLOPs (at
    decode rows loading bounds it); f32 operands take their bf16 passes; vector and
    transcendental work go at the VPU and EUP rates."""
    r = _rates()
    m = Model(qwen_ir, 1, 0, r, work=_feed_only(1))
    values = float(1 << 20)
    feed = values / r.feed_values_per_s("bf16")
    assert m.seconds(Work(matrix={("bf16", 1): values})) == pytest.approx(feed)
    assert m.seconds(Work(matrix={("bf16", 8): values})) == pytest.approx(feed)
    assert m.seconds(Work(matrix={("bf16", 4096): values})) == pytest.approx(
        2 * 4096 * values / r.mxu_ops_per_s["bf16"])          # many rows: FLOP-bound
    assert m.seconds(Work(matrix={("f32", 1): values})) == pytest.approx(feed * r.f32_matmul_passes)
    assert m.seconds(Work(matrix={("fp8", 1): values})) == pytest.approx(
        values / r.feed_values_per_s("fp8"))
    assert m.seconds(Work(vector=3e6, transcendental=1e6)) == pytest.approx(
        3e6 / r.vpu_ops_per_s + 1e6 / r.eup_ops_per_s)
    with pytest.raises(KeyError, match="no fp4 matrix unit"):
        constants.rates("v5e").mxu_rate("fp4")


def test_sibling_exchange_is_cheaper_than_a_cross_chip_round(qwen_ir):
    m = Model(qwen_ir, 8, 0, _rates())
    nbytes = 64 << 10
    sibling = m.stage_seconds(2, 1, nbytes)            # ranks 0, 1: one chip
    cross = m.stage_seconds(2, 2, nbytes)              # ranks 0, 2: next chip, one hop
    r = m.rates
    entry = r.collective_entry_s
    assert sibling == pytest.approx(r.sibling_copy_s - entry + nbytes / r.sibling_bytes_per_s)
    assert cross == pytest.approx(r.ici_copy_s - entry + nbytes / r.ici_link_bytes_per_s)
    assert sibling < cross


def _measure(rows: list[dict]) -> dict:
    """A `mkc.perf.bundles` measure of a kernel with these rows (only what the model reads)."""
    base = {"bundles": 0.0, "cycles": 0.0, "per_iteration": 0.0, "read_cycles": 0.0, "reads": 0,
            "spec_line": 0, "group": "op"}
    return {"rows": [base | r for r in rows], "libtpu": "test", "kernel": "decode", "batch": 1}


def test_compiled_price_charges_cycles_where_the_kernel_spends_them(qwen_ir):
    """An op's cycles outside its copy-waiting loop where it begins, its loop's cycles where
    its weights are read (at its cycles per weight value of the kernel measured), the layer's
    copies at the layer's start, the kernel's own statements at the step's: all at the clock;
    an op the compiled kernel lacks is counted unless libtpu merged it into its neighbours."""
    rates = _rates()
    c = rates.cycle_s
    tr = _Trace()
    sizes = (4096, 1 << 20, 64)
    for size in sizes:
        tr.compute(size)
    values = sum(sizes) / 2                 # bf16: what one call of the measured op reads

    def work(call_values: float) -> KernelWork:
        return KernelWork(1, {("gdn", "matmul"): OpWork(
            "gdn", "matmul", weights=Work(matrix={("bf16", 1): call_values}))}, Work(), "synthetic")
    measure = _measure([
        {"key": "gdn.matmul", "kind": "gdn", "name": "matmul", "cycles": 1000 + 3 * 25000,
         "read_cycles": 3 * 25000, "reads": 3},
        {"key": "gdn: copies", "group": "copies", "kind": "gdn", "name": "copies", "cycles": 40},
        {"key": "entry barrier", "group": "kernel", "kind": "", "name": "entry barrier",
         "cycles": 100}])
    m = Model(qwen_ir, 1, 0, rates, work=work(values), compiled=measure)
    res = simulate(m, tr.events)
    assert res.step_s == pytest.approx((100 + 40 + 1000 + 3 * 25000) * c, rel=1e-9)
    assert res.op_costs["gdn", "matmul"].seconds == pytest.approx((1000 + 75000) * c, rel=1e-9)
    assert not m.counted_ops
    # another geometry priced by this measure (a tuner's candidate): the measured call read
    # twice these values, so these reads cost half its loop
    other = simulate(Model(qwen_ir, 1, 0, rates, work=work(values), compiled=measure,
                           compiled_work=work(2 * values)), tr.events)
    assert other.op_costs["gdn", "matmul"].seconds == pytest.approx((1000 + 37500) * c, rel=1e-9)
    # a loop libtpu schedules in fewer cycles than the MXU takes to load its weights costs the
    # loading: the static schedule issues a push a bundle, the MXU takes it in over many cycles
    fast = _measure([{"key": "gdn.matmul", "kind": "gdn", "name": "matmul", "cycles": 1000 + 3,
                      "read_cycles": 3, "reads": 3}])
    pushed = simulate(Model(qwen_ir, 1, 0, rates, work=work(values), compiled=fast), tr.events)
    assert pushed.op_costs["gdn", "matmul"].seconds == pytest.approx(
        1000 * c + values / rates.feed_values_per_s("bf16"), rel=1e-9)
    counted = Model(qwen_ir, 1, 0, rates, work=_feed_only(1), compiled=_measure([]))
    simulate(counted, tr.events)
    assert counted.counted_ops == {("gdn", "matmul")}
    # Another gdn op has a row and this one has none: libtpu merged its code into its
    # neighbours' rows, which hold its cycles, so it costs nothing more...
    beside = _measure([{"key": "gdn.conv", "kind": "gdn", "name": "conv", "cycles": 500}])
    merged = Model(qwen_ir, 1, 0, rates, work=work(values), compiled=beside)
    res = simulate(merged, tr.events)
    assert res.op_costs["gdn", "matmul"].seconds == 0.0 and not merged.counted_ops
    # ...but in a measure built per op, a missing op failed to compile alone: counted.
    per_op = Model(qwen_ir, 1, 0, rates, work=work(values),
                   compiled=beside | {"op_level": {"ops_counted": {"gdn.matmul": "failed"}}})
    res = simulate(per_op, tr.events)
    assert res.op_costs["gdn", "matmul"].seconds > 0 and per_op.counted_ops == {("gdn", "matmul")}


def _overlapped_trace(a, work_bytes: int, overlap: bool, advances: int | None = None):
    """The all-reduce `a` (its step) after an op, then an op reading `work_bytes` of weights,
    then what reads the result: run at once, or overlapped (start, `advances` advances, by
    default one per stage of its widest form past the first, as the program emits them,
    finish)."""
    from mkc.steps.collectives import AllReduce, OverlapAdvance, OverlapFinish, OverlapStart
    step = AllReduce(0, op=a.after_op, entry=a)
    tr = _Trace()
    if not overlap:
        tr.tb.collective(step, "", SPAN)
        tr.compute(work_bytes)
        return tr
    tr.tb.collective(OverlapStart(0, collective=step), "", SPAN)
    tr.compute(work_bytes)
    for _ in range(step.most_stages() - 1 if advances is None else advances):
        tr.tb.collective(OverlapAdvance(0, collective=step), "", SPAN)
    tr.tb.collective(OverlapFinish(0, collective=step), "", SPAN)
    return tr


@pytest.mark.parametrize("scatter", [None, 1])
def test_an_overlapped_collective_costs_only_what_compute_does_not_cover(qwen_ir, scatter):
    """Run at once, a collective costs its rounds and sums. Overlapped under an op longer than
    its first round, that round costs nothing (the later ones start at the advances after the
    op, here none in between, so they are exposed); under an op shorter than it, compute waits
    only the difference."""
    from mkc import ir
    a = ir.AllReduce("down", "two_level", "bf16", ((2, 1), (4, 2)), 5120, SPAN, scatter,
                     finish_before="post_norm")
    m = Model(qwen_ir, 8, 0, _rates(), work=_feed_only(8))
    from mkc.steps.collectives import AllReduce
    rounds = AllReduce(0, op="down", entry=a).rounds(8, qwen_ir.cores_per_chip)
    wire = [m.round_seconds(rd, first=i == 0) for i, rd in enumerate(rounds)]
    sums = sum(rd.sums for rd in rounds) / m.rates.vpu_ops_per_s
    per_byte = 1 / 2 / m.rates.feed_values_per_s("bf16")
    long_op = int(2 * sum(wire) / per_byte)
    blocking = simulate(m, _overlapped_trace(a, long_op, False).events)
    assert blocking.by_cause["collectives"] == pytest.approx(sum(wire) + sums)
    hidden = simulate(m, _overlapped_trace(a, long_op, True).events)
    # every round but the first lands after the op, so only the first hides under it
    assert hidden.by_cause["collectives"] == pytest.approx(sum(wire[1:]) + sums)
    assert hidden.step_s == pytest.approx(blocking.step_s - wire[0])
    short_op = int(wire[0] / 2 / per_byte)
    short = simulate(m, _overlapped_trace(a, short_op, True).events)
    op_s = short_op * per_byte
    assert short.by_cause["collectives"] == pytest.approx(sum(wire) - op_s + sums)
    at_once = simulate(m, _overlapped_trace(a, short_op, False).events)
    assert short.step_s == pytest.approx(at_once.step_s - op_s)


def test_an_advance_past_a_narrow_kernel_s_last_stage_leaves_it_in_flight(qwen_ir):
    """`direct ... scatter from 8 rows overlap`: its widest form has two stages, so the program
    advances it once; a kernel of one row runs the one-shot stage alone, where that advance
    does nothing (`InFlight.advance`): the stage stays in flight and the finish lands it, at
    the cost of the same collective overlapped without the advance."""
    from mkc import ir
    a = ir.AllReduce("down", "direct", "bf16", ((8, 1),), 5120, SPAN, 8, finish_before="post_norm")
    m = Model(qwen_ir, 1, 0, _rates(), work=_feed_only(1))
    advanced = simulate(m, _overlapped_trace(a, 1000, True).events)
    plain = simulate(m, _overlapped_trace(a, 1000, True, advances=0).events)
    assert advanced.step_s == pytest.approx(plain.step_s)
    assert advanced.by_cause["collectives"] == pytest.approx(plain.by_cause["collectives"])
