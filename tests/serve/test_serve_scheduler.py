"""The serving scheduler on its own: no thread, no device. Each test plays the engine's part by
hand, `admit`, then `next` and `update` with host results made up for the launch."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from mkc.serve.device import Kind
from mkc.serve.sampling import Sampled, SamplingParams
from mkc.serve.scheduler import (Clear, Event, Policy, PrefillChunk, QueueFull, ReferencePrefill,
                                 Request, Scheduler, Speculate, Step, Unfit)

R = 3


@pytest.fixture
def loop():
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def request(loop, prompt, max_tokens=4, **sampling) -> Request:
    return Request(prompt=list(prompt), loop=loop,
                   sampling=SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}))


def events(loop, req: Request) -> list[Event]:
    loop.run_until_complete(asyncio.sleep(0))          # deliver what the scheduler emitted
    out = []
    while not req.events.empty():
        out.append(req.events.get_nowait())
    return out


def sampled(*tokens: int) -> Sampled:
    return Sampled(np.array(tokens, np.int32))


def scheduler(batch=2, prefill="decode", drafter=None, max_queue=8) -> Scheduler:
    return Scheduler(Policy(batch, context=16, vocab=64, max_queue=max_queue, prefill=prefill,
                            verify_rows=R, verify_sequences=(1, 2)), drafter)


def test_admission_takes_free_rows_in_arrival_order_and_clears_them(loop):
    s = scheduler(batch=2)
    a, b, c = request(loop, [1, 2]), request(loop, [3]), request(loop, [4])
    for r in (a, b, c):
        s.submit(r)
    s.admit()
    assert (a.row, b.row, c.row) == (0, 1, None) and list(s.waiting) == [c]
    clear = s.next()
    assert isinstance(clear, Clear) and clear.launch.rows.tolist() == [1, 1]
    step = s.next()
    assert isinstance(step, Step) and step.launch.kind == Kind.DECODE
    assert step.launch.tokens.tolist() == [1, 3] and step.launch.positions.tolist() == [0, 0]
    s.update(step, sampled(9, 7), 0.0)
    assert s.next() is None                              # one step an iteration
    assert (a.fed, a.generated, b.fed, b.generated) == (1, [], 1, [7])   # a still in its prompt
    assert [e.token for e in events(loop, b)] == [7]
    assert s.stats.steps == 1 and s.stats.busy_row_steps == 2


def test_a_finished_row_is_taken_over_and_only_it_is_cleared(loop):
    s = scheduler(batch=2)
    a, b, c = request(loop, [1], stop_token_ids=frozenset({5})), request(loop, [3]), request(loop, [4])
    for r in (a, b, c):
        s.submit(r)
    s.admit()
    s.next()
    s.update(s.next(), sampled(5, 6), 0.0)               # a draws its stop token
    assert a.finished and events(loop, a)[-1].finish_reason == "stop" and s.rows[0] is None
    s.admit()
    clear = s.next()
    assert c.row == 0 and clear.launch.rows.tolist() == [1, 0]
    step = s.next()
    assert step.launch.tokens.tolist() == [4, 6] and step.launch.positions.tolist() == [0, 1]


def test_cancelled_requests_leave_at_admission(loop):
    s = scheduler(batch=1)
    a, b = request(loop, [1]), request(loop, [2])
    s.submit(a)
    s.submit(b)
    s.admit()
    a.cancelled = True
    s.admit()
    assert events(loop, a)[-1].finish_reason == "cancelled"
    assert s.rows == [b] and b.row == 0


def test_refusals(loop):
    s = scheduler(batch=1, max_queue=1)
    with pytest.raises(Unfit, match="outside the vocabulary"):
        s.submit(request(loop, [64]))
    with pytest.raises(Unfit) as e:
        s.submit(request(loop, [1], seed=2**40))
    assert e.value.field == "seed"
    s.submit(request(loop, [1]))
    s.submit(request(loop, [1]))          # one waits for the free row, one in the queue
    with pytest.raises(QueueFull, match="0 of 1 rows are busy and 2 requests wait"):
        s.submit(request(loop, [1]))


def test_verify_prefill_chunks_the_prompt_then_decodes(loop):
    s = scheduler(batch=2, prefill="verify")
    req = request(loop, [1, 2, 3, 4, 5], max_tokens=3)
    s.submit(req)
    s.admit()
    assert isinstance(s.next(), Clear)
    first = s.next()
    assert isinstance(first, PrefillChunk) and (first.start, first.end) == (0, 3)
    assert first.launch.tokens.tolist() == [[1, 2, 3]] and not first.launch.sample
    s.update(first, None, 0.0)
    last = s.next()
    assert (last.start, last.end) == (3, 5) and last.launch.sample
    assert last.launch.tokens.tolist() == [[4, 5, 5]]     # padded with the last token
    s.update(last, sampled(8), 0.0)
    assert req.generated == [8] and req.fed == 5
    step = s.next()
    assert isinstance(step, Step) and step.launch.tokens.tolist() == [8, 0]
    assert s.stats.prefill_launches == 2


def test_reference_prefill_leaves_the_last_prompt_token_to_the_step(loop):
    s = scheduler(batch=1, prefill="reference")
    req = request(loop, [1, 2, 3])
    s.submit(req)
    s.admit()
    s.next()
    work = s.next()
    assert isinstance(work, ReferencePrefill) and work.tokens == [1, 2]
    s.update(work, None, 0.0)
    step = s.next()
    assert step.launch.tokens.tolist() == [3] and step.launch.positions.tolist() == [2]


def greedy_generating(s: Scheduler, loop, *prompts, **sampling) -> list[Request]:
    """Requests of one-token prompts admitted, each past its first step (which generated
    10 + its row)."""
    reqs = [request(loop, p, max_tokens=8, **sampling) for p in prompts]
    for r in reqs:
        s.submit(r)
    s.admit()
    assert isinstance(s.next(), Clear)
    s.update(s.next(), sampled(*(10 + b for b in range(s.policy.batch))), 0.0)
    assert s.next() is None
    return reqs


def test_speculation_when_every_busy_row_is_greedy_and_has_room(loop):
    s = scheduler(batch=2, drafter=lambda context, n: [context[-1] + 1] * n)
    a, b = greedy_generating(s, loop, [1], [2])
    s.admit()
    work = s.next()
    assert isinstance(work, Speculate)
    assert work.launch.tokens.tolist() == [[10, 11, 11], [11, 12, 12]]
    assert work.launch.positions.tolist() == [1, 1] and work.drafts == (2, 2)
    # row 0 keeps its first draft (the model chose 11 after 10), row 1 none
    choices = sampled(11, 30, 31, 40, 41, 42)
    s.update(work, (choices, np.array([2, 1])), 0.0)
    assert a.generated == [10, 11, 30] and a.fed == 3
    assert b.generated == [11, 40] and b.fed == 2
    assert (s.stats.drafted, s.stats.accepted, a.speculation.accepted) == (4, 1, 1)


@pytest.mark.parametrize("why", ["a sampled row", "a drafter that fails", "no draft"])
def test_otherwise_a_decode_step(loop, why):
    def drafter(context, n):
        if why == "a drafter that fails" and context[0] == 2:
            raise RuntimeError("no drafts today")
        return [] if why == "no draft" else [1] * n
    s = scheduler(batch=2, drafter=drafter)
    a, b = greedy_generating(s, loop, [1], [2])
    if why == "a sampled row":
        b.sampling = SamplingParams(max_tokens=8, temperature=1.0)
    s.admit()
    assert isinstance(s.next(), Step)
    if why == "a drafter that fails":
        assert b.finished and "drafting failed: no drafts today" in events(loop, b)[-1].error
        assert not a.finished


def test_abort_ends_the_running_requests_and_keeps_the_waiting(loop):
    s = scheduler(batch=1)
    a, b = request(loop, [1]), request(loop, [2])
    s.submit(a)
    s.submit(b)
    s.admit()
    s.abort("decode step failed: boom")
    assert events(loop, a)[-1] == Event(finish_reason="error", error="decode step failed: boom")
    assert s.next() is None and list(s.waiting) == [b]
    s.fail_all("gone")
    assert events(loop, b)[-1].error == "gone" and s.idle()

