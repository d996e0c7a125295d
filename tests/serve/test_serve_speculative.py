"""`mkc serve --speculative prompt-lookup` for real: the MINI Qwen module in TPU interpret mode
at batch 1, through OpenAI's client. Greedy completions equal the family reference's greedy
decoding token for token with drafts accepted and rejected; logprobs come back with them; a
sampled request falls back to decode steps. `--speculative draft-model` in the extended tier."""
from __future__ import annotations

import math

import pytest

from mkc.numerics import pin_cpu_isa

pin_cpu_isa()       # the same vector routines as the server's kernel (mkc.numerics)

import openai  # noqa: E402
from serve_process import MODEL, reference_greedy, running_server, token_ids  # noqa: E402

pytestmark = pytest.mark.slow      # interpret-mode launches: about two minutes

# With the MINI model's random weights, greedy decoding after this prompt gives 1508 1747
# 1659 ...: once 1508 is generated, prompt lookup drafts 1747 57 1508 (what followed the
# earlier "57 1508"), the first of which the model accepts and the second it rejects.
PROMPT, TOKENS = [57, 1508, 1747, 57], 4


@pytest.fixture(scope="module")
def client():
    with running_server(["--batch", "1", "--speculative", "prompt-lookup"]) as url:
        yield openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def greedy():
    return reference_greedy()


def test_speculative_greedy_equals_greedy_decoding(client, greedy):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                  logprobs=2)
    expected, finish = greedy(PROMPT, TOKENS)
    choice = r.choices[0]
    assert token_ids(choice) == expected and choice.finish_reason == finish
    spec = r.usage.model_extra["speculative"]
    assert spec["launches"] >= 1 and spec["accepted"] >= 1 and spec["drafted"] > spec["accepted"]
    lp = choice.logprobs
    assert lp.tokens == [f"token_id:{t}" for t in expected]
    assert all(math.isfinite(x) and x <= 0 for x in lp.token_logprobs)
    for token, top in zip(lp.tokens, lp.top_logprobs):     # greedy: the most likely token first
        assert list(top)[0] == token and len(top) == 2


# streaming is test_serve_server's in CI; speculative streaming the extended tier's (a second
# worker would start a second server for it)
@pytest.mark.extended
def test_speculative_streaming_equals_greedy_decoding(client, greedy):
    stream = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    assert [t for c in chunks for ch in c.choices for t in token_ids(ch)] == greedy(PROMPT, TOKENS)[0]
    assert chunks[-1].usage.model_extra["speculative"]["accepted"] >= 1


def test_sampled_requests_decode_plainly(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=1.0, seed=3)
    assert len(token_ids(r.choices[0])) == r.usage.completion_tokens
    assert r.usage.model_extra["speculative"]["launches"] == 0


@pytest.mark.extended
def test_a_draft_model_speculates_and_greedy_stays_greedy(greedy):
    """`--speculative draft-model` with the served model itself as the draft (its reference in
    plain f32): most drafts are kept, and the text is still plain greedy decoding's."""
    with running_server(["--batch", "1", "--speculative", "draft-model"]) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        r = client.completions.create(model=MODEL, prompt=[5, 17, 99], max_tokens=6, temperature=0)
    assert token_ids(r.choices[0]) == greedy([5, 17, 99], 6)[0]
    spec = r.usage.model_extra["speculative"]
    assert spec["accepted"] >= 2 and spec["launches"] < 6, spec
