"""The serving engine's continuous batching and on-device sampling, on a stand-in module (no
kernel runs: serve_fakes)."""
from __future__ import annotations

import asyncio
import re
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from serve_fakes import (VERIFY_ROWS, VOCAB, fake_greedy, fake_mesh, fake_module, fake_prefill,
                         fake_prompt_logprobs)

from conftest import ROOT

from mkc.compiler import compile_spec, module_name
from mkc.serve.device import row_states_of
from mkc.serve.drafting import prompt_lookup
from mkc.serve.engine import Engine, QueueFull, Request
from mkc.serve.model import import_generated
from mkc.serve.sampling import SamplingParams, greedy_rows, logprob_width, row_arrays, sample_rows


def make_engine(batch=2, max_queue=8, prefill="decode", **kw) -> Engine:
    if prefill == "reference":
        kw.setdefault("prefiller", fake_prefill)
    if prefill == "auto, no verify line":
        return Engine(fake_module(verify=False), {}, fake_mesh(), batch, None, max_queue=max_queue, **kw)
    return Engine(fake_module(), {}, fake_mesh(), batch, None, max_queue=max_queue, prefill=prefill, **kw)


async def generate(engine: Engine, prompt, max_tokens, *, delay=0.0, cancel_after=None, **sampling):
    await asyncio.sleep(delay)
    req = Request(prompt=list(prompt), loop=asyncio.get_running_loop(),
                  sampling=SamplingParams(max_tokens=max_tokens, **{"temperature": 0.0, **sampling}))
    engine.submit(req)
    req.seen = []                     # the token events, for the logprob tests
    while True:
        event = await req.events.get()
        if event.token is not None:
            req.seen.append(event)
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


@pytest.mark.parametrize("prefill", ["decode", "verify", "reference", "auto, no verify line"])
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
    if prefill == "reference":      # the prompt but its last token prefilled: a step a token
        assert engine.stats.busy_row_steps == sum(n for _, n in prompts)
    if prefill == "auto, no verify line":   # the prompt through decode steps
        assert engine.prefill == "decode"
        assert engine.stats.busy_row_steps == sum(len(p) + n - 1 for p, n in prompts)


def _readme_first_spec() -> str:
    text = (ROOT / "README.md").read_text()
    return re.search(r"```sched\n(.*?)```", text[text.index("## Your first spec"):], re.S).group(1)


@pytest.mark.parametrize("spec, model, context", [
    (None, "qwen3_8_mini", "context 256"),              # the README's first spec
    ("deepseek_v3.sched", "deepseek_v3_mini_fp8", "context 4096")])
def test_the_shipped_specs_without_verify_have_their_row_states_found(tmp_path, spec, model, context):
    # `mkc serve` died on these (AttributeError: no ROW_STATES) before its first step; the
    # states found are the ones the same spec with a verify line lists
    text = _readme_first_spec() if spec is None else (ROOT / "schedules" / spec).read_text()
    found = {}
    for verify in ("", "\n  verify 4 sequences 1 to 2"):
        path = tmp_path / f"spec{len(found)}.sched"
        path.write_text(text.replace(context, context + verify, 1))
        c = compile_spec(str(path), model)
        gen = import_generated(c.module_source, f"{module_name(c)}_{len(found)}")
        assert hasattr(gen, "ROW_STATES") == bool(verify)
        found[verify] = gen.ROW_STATES if verify else dict(row_states_of(gen))
    assert found[""] == found["\n  verify 4 sequences 1 to 2"]
    assert bool(found[""]) == (spec is None)              # the MINI Qwen's gdn states; MLA has none


@pytest.mark.parametrize("name", ["qwen3_8_27b", "kimi_k3", "llama_3_1_8b"])
def test_a_module_without_row_states_has_them_found_as_its_row_states_would_list_them(name):
    # a module compiled without `verify` exports no ROW_STATES: the engine finds its per-row
    # states (the ones a new request's row has zeroed) from its states and kinds' caches; on
    # shipped modules that have the list (recurrent and conv states, or none), the same list
    gen = import_generated((ROOT / "generated" / f"{name}.py").read_text(), f"row_states_{name}")
    assert dict(row_states_of(gen)) == gen.ROW_STATES


def test_reference_prefill_needs_a_prefiller():
    with pytest.raises(ValueError, match="--prefill reference needs the family reference's prefill"):
        Engine(fake_module(), {}, fake_mesh(), 2, None, prefill="reference")


def test_reference_prefill_runs_on_one_process_only():
    # the state it writes is made on process 0's host, not a launch the other processes run
    with pytest.raises(ValueError, match="--prefill reference runs on one process only"):
        make_engine(prefill="reference", lockstep=object())


def test_without_clearing_a_reused_row_the_output_differs(monkeypatch):
    # the check above can fail: a row reused with its recurrent state kept gives other tokens
    import mkc.serve.device as device_module
    monkeypatch.setattr(device_module, "_clear_rows", lambda state, rows, names: state)
    engine = make_engine(batch=1)
    out = run(engine, generate(engine, [3, 5], 2), generate(engine, [4], 3, delay=0.01))
    assert out[1][0].generated != fake_greedy([4], 3)


def test_cancel_frees_the_row_and_others_finish():
    engine = make_engine(batch=1)
    # after its first token the engine waits for the cancel (however late a loaded host runs
    # the client), so the request cannot finish first
    cancelled, step, cancel = threading.Event(), engine.device.run, engine.cancel

    def run_step(launch):
        out = step(launch)
        if engine.stats.steps >= 2 and not cancelled.is_set():
            cancelled.wait(30)
        return out
    engine.device.run = run_step
    engine.cancel = lambda req: (cancel(req), cancelled.set())
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
    tokens = np.asarray(sample_rows(logits, *map(jnp.asarray, row_arrays(params, [0, 5, 2, 0]))).tokens)
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
        out = sample_rows(logits, *map(jnp.asarray, row_arrays(params, counters)))
        return np.asarray(out.tokens).tolist()

    # the same request's draw in row 0 or row 2, beside other requests: the same token
    assert draw([hot, other, other], [3, 0, 1])[0] == draw([other, other, hot], [0, 1, 3])[2]
    # over its tokens a sampled request does not repeat one token (temperature 2 over 64)
    assert len({draw([hot], [n])[0] for n in range(20)}) > 3


def test_logprobs_are_the_models_distribution_in_one_transfer():
    logits = jnp.asarray(np.random.default_rng(2).normal(size=(3, VOCAB)), jnp.float32)
    params = [SamplingParams(1, temperature=0.0, logprobs=3), SamplingParams(1, temperature=2.0, seed=5),
              SamplingParams(1, temperature=0.5, top_k=4, seed=6, logprobs=0)]
    assert logprob_width(params) == 5 and logprob_width([None, params[1]]) is None
    out = sample_rows(logits, *map(jnp.asarray, row_arrays(params, [0, 0, 0])), width=5)
    logp = np.asarray(jax.nn.log_softmax(logits, axis=-1))
    tokens = np.asarray(out.tokens)
    # the chosen token's logprob under the model's distribution, whatever the temperature
    np.testing.assert_allclose(np.asarray(out.logprob), logp[np.arange(3), tokens], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.top_ids), np.argsort(-logp, axis=-1)[:, :5])
    np.testing.assert_allclose(np.asarray(out.top_logprobs), -np.sort(-logp, axis=-1)[:, :5], rtol=1e-6)
    assert sample_rows(logits, *map(jnp.asarray, row_arrays(params, [0, 0, 0]))).logprob is None
    zero = greedy_rows(logits, width=0)
    assert zero.top_ids.shape == (3, 0) and np.asarray(zero.tokens).tolist() == np.argmax(logp, -1).tolist()


def test_engine_events_carry_logprobs():
    engine = make_engine(batch=2)
    (req, _), (plain, _) = run(engine, generate(engine, [3, 5], 3, logprobs=2),
                               generate(engine, [4], 2))
    logp = np.asarray(jax.nn.log_softmax(jax.nn.one_hot(np.array(req.generated), VOCAB) * 10.0))
    for event, row in zip(req.seen, logp):
        assert event.logprob == pytest.approx(row[event.token], rel=1e-6)
        assert len(event.top) == 2 and event.top[0][0] == event.token
    assert all(e.logprob is None and e.top is None for e in plain.seen)


@pytest.mark.parametrize("prefill", ["decode", "verify", "reference"])
def test_prompt_logprobs_are_each_prompt_token_s_under_the_logits_before_it(prefill):
    # echo with logprobs (lm-eval's loglikelihood requests): each prompt token's logprob under
    # the logits of the position before it (a verify launch's rows, or a decode step's output,
    # also with reference prefill); then the completion as without them; with max_tokens 0,
    # the prompt's logprobs alone
    engine = make_engine(batch=2, prefill=prefill)
    prompt = [3, *fake_greedy([3], 2), 9, 9]           # two tokens the model predicts, two it does not
    out = run(engine, generate(engine, prompt, 3, logprobs=2, prompt_logprobs=True),
              generate(engine, prompt, 0, logprobs=0, prompt_logprobs=True, delay=0.01),
              generate(engine, [4], 0, logprobs=1, prompt_logprobs=True, delay=0.02),
              generate(engine, prompt, 0, delay=0.03))                  # echo without logprobs
    (req, finish), (scored, scored_finish), (one, one_finish), (bare, bare_finish) = out
    for r in (req, scored):
        seen = [e for e in r.seen if e.prompt]
        assert [e.token for e in seen] == prompt[1:]
        assert [e.logprob for e in seen] == pytest.approx(fake_prompt_logprobs(prompt), abs=1e-6)
        assert all(len(e.top) == (2 if r is req else 0) for e in seen)
    assert req.generated == fake_greedy(prompt, 3) and finish == "length"
    assert [e.token for e in req.seen if not e.prompt] == req.generated
    assert scored.generated == [] and scored_finish == "length"
    assert one.seen == [] and one_finish == "length"
    if prefill == "verify":         # scored from the verify launches' logits: 2 chunks each
        assert engine.stats.prefill_launches == 4
    assert bare.seen == [] and bare_finish == "length"


def oracle(context, n):
    """The fake model's own greedy continuation: every draft is accepted."""
    return fake_greedy(context, n)


def corrupted(context, n):
    """The greedy continuation with its second draft wrong: one accepted a launch."""
    return [(t + 1) % (VOCAB - 1) if i == 1 else t for i, t in enumerate(fake_greedy(context, n))]


@pytest.mark.parametrize("batch, prefill", [(2, "verify"), (2, "decode"), (4, "verify")])
@pytest.mark.parametrize("drafter", [oracle, corrupted, prompt_lookup])
def test_speculative_greedy_equals_plain_greedy(batch, prefill, drafter):
    # batch 2: the verify step takes the whole batch (an idle row beside a busy one); batch 4:
    # more rows than a launch takes, so the busy rows' states are taken out and put back
    engine = make_engine(batch=batch, prefill=prefill, drafter=drafter)
    prompts = [([3, 5, 7], 7), ([11], 8), ([2, 2], 5)]
    out = run(engine, *(generate(engine, p, n, delay=0.01 * i) for i, (p, n) in enumerate(prompts)))
    for (prompt, n), (req, finish) in zip(prompts, out):
        assert req.generated == fake_greedy(prompt, n), prompt
        assert finish == "length"
        spec = req.speculation
        assert spec.drafted >= spec.accepted
        if drafter is oracle:
            assert spec.accepted == spec.drafted and spec.launches > 0
    if drafter is prompt_lookup:
        return
    rows_per_launch = VERIFY_ROWS if drafter is oracle else 2
    assert engine.stats.verify_launches > 0
    assert engine.stats.accepted == sum(r.speculation.accepted for r, _ in out)
    # fewer launches than tokens: each launch gives a busy row up to `rows_per_launch` tokens
    assert engine.stats.steps + engine.stats.verify_launches < sum(n for _, n in prompts)
    assert rows_per_launch > 1


def test_speculative_keeps_stop_tokens_and_max_tokens():
    engine = make_engine(batch=1, drafter=oracle)
    expected = fake_greedy([3, 5, 7], 9)
    (stopped, why), = run(engine, generate(engine, [3, 5, 7], 9, stop_token_ids=frozenset({expected[4]})))
    assert why == "stop" and stopped.generated == expected[:5]
    engine = make_engine(batch=1, drafter=oracle)
    (cut, why), = run(engine, generate(engine, [3, 5, 7], 4))
    assert why == "length" and cut.generated == expected[:4]


def test_sampled_rows_fall_back_to_decode_steps():
    # a sampled request beside a greedy one: decode steps for both while both are busy
    engine = make_engine(batch=2, drafter=oracle)
    (sampled, _), (greedy, _) = run(engine, generate(engine, [1, 2], 6, temperature=1.0, seed=1),
                                    generate(engine, [3], 3))
    assert sampled.speculation.launches == 0 and greedy.speculation.launches == 0
    assert greedy.generated == fake_greedy([3], 3)
    assert engine.stats.verify_launches == 0


def test_speculative_logprobs_equal_plain_logprobs():
    def logprobs(drafter):
        engine = make_engine(batch=1, drafter=drafter)
        (req, _), = run(engine, generate(engine, [6, 1], 5, logprobs=3))
        return [(e.token, e.logprob, e.top) for e in req.seen], engine.stats.verify_launches
    plain, none = logprobs(None)
    spec, launches = logprobs(oracle)
    assert none == 0 and launches > 0
    assert [t for t, _, _ in spec] == [t for t, _, _ in plain]
    for (_, a, top_a), (_, b, top_b) in zip(spec, plain):
        assert a == pytest.approx(b, abs=1e-5)
        assert [t for t, _ in top_a] == [t for t, _ in top_b]


def test_speculation_needs_a_verify_step():
    gen = fake_module()
    del gen.VERIFY_ROWS
    with pytest.raises(ValueError, match="speculative decoding needs a verify step"):
        Engine(gen, {}, fake_mesh(), 2, None, prefill="decode", drafter=oracle)


@pytest.mark.parametrize("batch, compiled", [(1, {1}), (2, {1, 2}), (4, {1, 2})])
def test_warm_up_compiles_every_verify_launch_speculation_uses(batch, compiled):
    # 1 for verify prefill; the whole batch when the verify step takes it, else 1 to 2 busy rows
    engine = make_engine(batch=batch, prefill="verify", drafter=oracle)
    engine.warm_up()
    assert set(engine.device.verifiers) == compiled
