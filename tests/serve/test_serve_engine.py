"""The serving engine's continuous batching and on-device sampling, on a stand-in module (no
kernel runs: serve_fakes)."""
from __future__ import annotations

import asyncio

import jax.numpy as jnp
import numpy as np
import pytest
from serve_fakes import VERIFY_ROWS, VOCAB, fake_greedy, fake_mesh, fake_module

from mkc.serve.engine import Engine, QueueFull, Request
from mkc.serve.sampling import SamplingParams, row_arrays, sample_rows


def make_engine(batch=2, max_queue=8, prefill="decode", **kw) -> Engine:
    return Engine(fake_module(), {}, fake_mesh(), batch, None, max_queue=max_queue, prefill=prefill, **kw)


async def generate(engine: Engine, prompt, max_tokens, *, delay=0.0, cancel_after=None, **sampling):
    await asyncio.sleep(delay)
    req = Request(prompt=list(prompt), loop=asyncio.get_running_loop(),
                  sampling=SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}))
    engine.submit(req)
    while True:
        event = await req.events.get()
        if event.token is not None and cancel_after is not None and len(req.generated) >= cancel_after:
            engine.cancel(req)
        if event.finish_reason is not None:
            return req, event.finish_reason


def run(engine: Engine, *coroutines):
    async def main():
        return await asyncio.gather(*coroutines)
    engine.start()
    try:
        return asyncio.run(main())
    finally:
        engine.stop()


@pytest.mark.parametrize("prefill", ["decode", "verify"])
def test_requests_share_rows_and_reuse_them_from_a_clean_state(prefill):
    # 5 requests on 2 rows, arriving at different times, so rows are reused mid-run and sit at
    # different positions in one step; with verify prefill, prompts of 1 to 2 chunks
    engine = make_engine(batch=2, prefill=prefill)
    prompts = [([3, 5, 7], 4), ([11], 6), ([2, 2], 3), ([9, 1, 4, 4, 8], 2), ([6], 5)]
    out = run(engine, *(generate(engine, p, n, delay=0.01 * i) for i, (p, n) in enumerate(prompts)))
    for (prompt, n), (req, finish) in zip(prompts, out):
        assert req.generated == fake_greedy(prompt, n), prompt
        assert finish == "length"
    assert engine.busy_rows() == 0
    # every row was shared: fewer steps than running the requests one after another
    assert engine.stats.steps < sum(len(p) + n - 1 for p, n in prompts)
    if prefill == "verify":         # a launch per chunk of up to VERIFY_ROWS prompt tokens
        assert engine.stats.prefill_launches == sum(-(-len(p) // VERIFY_ROWS) for p, _ in prompts)


def test_without_clearing_a_reused_row_the_output_differs(monkeypatch):
    # the check above can fail: a row reused with its recurrent state kept gives other tokens
    import mkc.serve.engine as engine_module
    monkeypatch.setattr(engine_module, "_clear_rows", lambda state, rows, names: state)
    engine = make_engine(batch=1)
    out = run(engine, generate(engine, [3, 5], 2), generate(engine, [4], 3, delay=0.01))
    assert out[1][0].generated != fake_greedy([4], 3)


def test_cancel_frees_the_row_and_others_finish():
    engine = make_engine(batch=1)
    out = run(engine, generate(engine, [1, 2], 20, cancel_after=1),
              generate(engine, [5], 3, delay=0.01))
    (cancelled, reason), (other, finish) = out
    assert reason == "cancelled" and len(cancelled.generated) < 20
    assert other.generated == fake_greedy([5], 3) and finish == "length"


def test_stop_token_ends_a_request():
    engine = make_engine()
    expected = fake_greedy([3, 5, 7], 6)
    req, finish = run(engine, generate(engine, [3, 5, 7], 6, stop_token_ids=frozenset({expected[2]})))[0]
    assert finish == "stop" and req.generated == expected[:3]


def test_a_full_queue_refuses():
    engine = make_engine(batch=1, max_queue=1)        # not started: nothing leaves the queue
    loop = asyncio.new_event_loop()
    try:
        def request():
            return Request(prompt=[1], sampling=SamplingParams(max_tokens=1), loop=loop)
        engine.submit(request())       # takes the free row at the next step
        engine.submit(request())       # waits
        with pytest.raises(QueueFull, match="queue holds 1"):
            engine.submit(request())
    finally:
        loop.close()


def test_batch_outside_the_module_range():
    with pytest.raises(ValueError, match="batches 1 to 4"):
        make_engine(batch=5)


def test_verify_prefill_needs_a_verify_step_and_auto_chooses_it_where_there_is_one():
    assert Engine(fake_module(), {}, fake_mesh(), 2, None).prefill == "verify"
    gen = fake_module()
    del gen.VERIFY_ROWS
    assert Engine(gen, {}, fake_mesh(), 2, None).prefill == "decode"
    with pytest.raises(ValueError, match="add `verify R sequences 1 to N`"):
        Engine(gen, {}, fake_mesh(), 2, None, prefill="verify")


def test_sampling_per_row_on_device():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, VOCAB)), jnp.float32)
    params = [SamplingParams(1, temperature=0.0), SamplingParams(1, temperature=1.0, top_k=1, seed=3),
              SamplingParams(1, temperature=0.7, top_p=1e-6, seed=4), None]
    tokens = np.asarray(sample_rows(logits, *map(jnp.asarray, row_arrays(params, [0, 5, 2, 0]))))
    best = np.argmax(np.asarray(logits), axis=-1)
    # greedy, top-k 1 and a tiny top-p all take the most likely token; an idle row is greedy
    assert tokens.tolist() == best.tolist()


def test_sampling_is_seeded_per_request_not_per_row():
    rng = np.random.default_rng(1)
    row = rng.normal(size=VOCAB).astype(np.float32)
    hot = SamplingParams(1, temperature=2.0, seed=11)
    other = SamplingParams(1, temperature=2.0, seed=12)

    def draw(params, counters):
        logits = jnp.asarray(np.stack([row] * len(params)))
        return np.asarray(sample_rows(logits, *map(jnp.asarray, row_arrays(params, counters)))).tolist()

    # the same request's draw in row 0 or row 2, beside other requests: the same token
    assert draw([hot, other, other], [3, 0, 1])[0] == draw([other, other, hot], [0, 1, 3])[2]
    # over its tokens a sampled request does not repeat one token (temperature 2 over 64)
    assert len({draw([hot], [n])[0] for n in range(20)}) > 3
