"""The HTTP API's schema and refusals, in process (FastAPI's TestClient) over the engine on a
stand-in module (serve_fakes): no kernel runs. The real server is tests/serve/test_serve_server.py."""
from __future__ import annotations

import json

import numpy as np
import pytest
from fastapi.testclient import TestClient
from serve_fakes import CONTEXT, EOS, VOCAB, fake_greedy, fake_mesh, fake_module, fake_prompt_logprobs

from mkc.serve.api import MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS, create_app
from mkc.serve.drafting import prompt_lookup
from mkc.serve.engine import Engine
from mkc.serve.model import Served

NAME = "fake_mini"


@pytest.fixture(scope="module")
def client():
    gen = fake_module()
    served = Served(name=NAME, gen=gen, weights={}, mesh=fake_mesh(), interpret=None, tokenizer=None,
                    eos_token_ids=frozenset({EOS}))
    engine = Engine(gen, {}, served.mesh, 2, None, max_queue=4, eos_token_ids=served.eos_token_ids)
    engine.start()
    with TestClient(create_app(served, engine)) as c:
        yield c
    engine.stop()


def complete(client, **body):
    return client.post("/v1/completions", json={"model": NAME, "temperature": 0, **body})


def test_completion_schema_and_usage(client):
    r = complete(client, prompt=[3, 5, 7], max_tokens=4)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == NAME
    choice = body["choices"][0]
    assert choice["token_ids"] == fake_greedy([3, 5, 7], 4) and choice["finish_reason"] == "length"
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_streaming_equals_non_streaming(client):
    with client.stream("POST", "/v1/completions",
                       json={"model": NAME, "temperature": 0, "prompt": [[4, 4]], "max_tokens": 5,
                             "stream": True, "stream_options": {"include_usage": True}}) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    tokens = [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]]
    assert tokens == complete(client, prompt=[4, 4], max_tokens=5).json()["choices"][0]["token_ids"]
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"]["completion_tokens"] == 5


def test_vllm_bench_serve_s_request_shape(client):
    # what `vllm bench serve` sends to /v1/completions (its openai backend), and what it reads:
    # the model's root, text chunks, then the usage chunk
    assert client.get("/v1/models").json()["data"][0]["root"] == NAME
    body = {"model": NAME, "prompt": [5, 6, 7], "temperature": 0.0, "repetition_penalty": 1.0,
            "max_tokens": 4, "logprobs": None, "stream": True, "stream_options": {"include_usage": True},
            "ignore_eos": True}
    with client.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line for line in r.iter_lines() if line]
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    assert [t for c in chunks for ch in c["choices"] for t in ch["token_ids"]] == fake_greedy([5, 6, 7], 4)
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_models_and_health(client):
    assert client.get("/health").status_code == 200
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [NAME] and data[0]["max_model_len"] == CONTEXT
    assert data[0]["root"] == NAME              # `vllm bench serve` reads it
    assert client.get("/stats").json()["interpret"] is False


@pytest.mark.parametrize("body, status, message", [
    ({"model": "other", "prompt": [1]}, 404, "the model 'other' does not exist"),
    ({"model": NAME, "prompt": [1], "max_tokens": -1}, 400, "max_tokens: Input should be greater"),
    ({"model": NAME, "prompt": [1], "max_tokens": 10**6}, 400, f"at most {CONTEXT - 1}"),
    ({"model": NAME, "prompt": [1] * (CONTEXT + 1)}, 400, f"the model's context is {CONTEXT}"),
    ({"model": NAME, "prompt": []}, 400, "the prompt is empty"),
    ({"model": NAME, "prompt": ""}, 400, "the prompt is empty"),
    ({"model": NAME, "prompt": [1, 999]}, 400, "outside the vocabulary"),
    ({"model": NAME, "prompt": "hello"}, 400, "a text prompt needs a tokenizer"),
    ({"model": NAME, "prompt": [1], "stop": "x"}, 400, "a stop string needs a tokenizer"),
    ({"model": NAME, "prompt": [[1], [2]]}, 400, "2 prompts in one request"),
    ({"model": NAME, "prompt": [1], "n": 2}, 400, "one choice per request"),
    ({"model": NAME}, 400, "prompt: Field required"),
    ({"model": NAME, "prompt": [1], "max_tokens": 0}, 400, "max_tokens = 0 generates nothing"),
    ({"model": NAME, "prompt": [1], "echo": True, "stream": True}, 400, "echo is served without stream"),
])
def test_bad_completion_requests(client, body, status, message):
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    assert message in r.json()["error"]["message"]


@pytest.mark.parametrize("content, message", [
    (b'{"model": "fake_mini", "prompt": [1], "temperature": NaN}', "temperature: Input should be a finite"),
    (b'{"model": "fake_mini", "prompt": [1', "the body is not valid JSON"),
    (b'{"model": "\xc3\x28", "prompt": [1]}', "it must be UTF-8 JSON"),
])
def test_bad_bodies(client, content, message):
    r = client.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]


def test_text_endpoints_without_a_tokenizer(client):
    chat = client.post("/v1/chat/completions",
                       json={"model": NAME, "messages": [{"role": "user", "content": "hi"}]})
    assert chat.status_code == 400 and "no chat template" in chat.json()["error"]["message"]
    assert "`mkc serve --tokenizer bytes`" in chat.json()["error"]["message"]
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]}),
                       ("/v1/completions", {"model": NAME, "prompt": "hi"})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "needs a tokenizer" in r.json()["error"]["message"]
        assert "`mkc serve --tokenizer bytes`" in r.json()["error"]["message"]
    info = client.get("/tokenizer_info")
    assert info.status_code == 400 and "/tokenizer_info needs a tokenizer" in info.json()["error"]["message"]
    assert complete(client, prompt=[2], max_tokens=1).status_code == 200     # still serving


def test_a_full_server_answers_429():
    import asyncio

    from mkc.serve.engine import Request
    from mkc.serve.sampling import SamplingParams
    gen = fake_module()
    served = Served(name=NAME, gen=gen, weights={}, mesh=fake_mesh(), interpret=None, tokenizer=None,
                    eos_token_ids=frozenset())
    engine = Engine(gen, {}, served.mesh, 1, None, max_queue=0)     # never started: stays full
    loop = asyncio.new_event_loop()
    try:
        engine.submit(Request(prompt=[1], sampling=SamplingParams(max_tokens=1), loop=loop))
        with TestClient(create_app(served, engine)) as c:
            r = c.post("/v1/completions", json={"model": NAME, "prompt": [1], "max_tokens": 1})
            assert r.status_code == 429     # the row is free, but the waiter will take it
            assert ("the server is busy: 0 of 1 rows are busy and 1 requests wait for a row"
                    in r.json()["error"]["message"])
            engine.scheduler.admit()        # the waiter takes the row, as the engine's thread would
            r = c.post("/v1/completions", json={"model": NAME, "prompt": [1], "max_tokens": 1})
            assert r.status_code == 429
            assert ("the server is busy: all 1 rows are busy and 0 requests wait"
                    in r.json()["error"]["message"])
    finally:
        loop.close()


def sse_chunks(client, path: str, body: dict) -> list[dict]:
    with client.stream("POST", path, json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    return [json.loads(line[len("data: "):]) for line in lines[:-1]]


def test_completion_logprobs_streaming_and_not(client):
    body = {"model": NAME, "temperature": 0, "prompt": [3, 5], "max_tokens": 4, "logprobs": 2}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    ids = choice["token_ids"]
    # the fake's logits are 10 on its token, 0 elsewhere
    expected = -np.log(np.exp(10.0) + VOCAB - 1) + 10.0
    assert lp["tokens"] == [f"token_id:{t}" for t in ids]
    assert lp["token_logprobs"] == pytest.approx([expected] * 4, abs=1e-6)
    assert lp["text_offset"] == [0] * 4                   # no tokenizer: the text is empty
    for token, top in zip(ids, lp["top_logprobs"]):
        assert len(top) == 2 and list(top)[0] == f"token_id:{token}"
    chunks = sse_chunks(client, "/v1/completions", {**body, "stream": True})
    streamed = [c["choices"][0]["logprobs"] for c in chunks if c["choices"][0]["token_ids"]]
    assert [s["tokens"][0] for s in streamed] == lp["tokens"]
    assert [s["top_logprobs"][0] for s in streamed] == lp["top_logprobs"]
    assert chunks[-1]["choices"][0]["logprobs"] is None
    assert complete(client, prompt=[3], max_tokens=1).json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("max_tokens", [0, 1, 3])
def test_echo_with_logprobs_scores_the_prompt_as_vllm_does(client, max_tokens):
    # lm-eval's loglikelihood requests: echo, logprobs, max_tokens 1 (or 0); the prompt's tokens
    # with their logprobs (the first's null), then the completion's
    prompt = [3, *fake_greedy([3], 2), 9, 9]
    r = complete(client, prompt=prompt, max_tokens=max_tokens, echo=True, logprobs=1)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    assert choice["token_ids"] == fake_greedy(prompt, max_tokens) and choice["text"] == ""
    assert lp["tokens"] == [f"token_id:{t}" for t in prompt + choice["token_ids"]]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["token_logprobs"][1:len(prompt)] == pytest.approx(fake_prompt_logprobs(prompt), abs=1e-6)
    for token, logprob, top in zip(lp["tokens"][1:], lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        assert top[token] == logprob and len(top) <= 2
    plain = complete(client, prompt=prompt, max_tokens=max(max_tokens, 1), logprobs=1).json()
    if max_tokens:
        assert lp["token_logprobs"][len(prompt):] == plain["choices"][0]["logprobs"]["token_logprobs"]
    assert r.json()["usage"]["completion_tokens"] == max_tokens
    bare = complete(client, prompt=prompt, max_tokens=max_tokens, echo=True).json()["choices"][0]
    assert bare["logprobs"] is None and bare["token_ids"] == choice["token_ids"]


def test_logprobs_zero_gives_the_chosen_token_only(client):
    lp = complete(client, prompt=[2], max_tokens=2, logprobs=0).json()["choices"][0]["logprobs"]
    assert [len(top) for top in lp["top_logprobs"]] == [1, 1]


@pytest.mark.parametrize("value, message", [
    (MAX_COMPLETION_LOGPROBS + 1,
     f"logprobs: Input should be less than or equal to {MAX_COMPLETION_LOGPROBS}"),
    (-1, "logprobs: Input should be greater than or equal to 0"),
    (True, "logprobs: Input should be a valid integer"),
])
def test_completion_logprobs_bounds(client, value, message):
    r = complete(client, prompt=[1], max_tokens=1, logprobs=value)
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == "logprobs"


class _FakeTokenizer:
    """Token t is the letter chr(97 + t % 26); a chat is its messages' contents."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) - 97 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def chat(self, messages: list[dict]) -> list[int]:
        return self.encode("".join(m["content"] for m in messages))


@pytest.fixture(scope="module")
def chat_client():
    gen = fake_module()
    served = Served(name=NAME, gen=gen, weights={}, mesh=fake_mesh(), interpret=None,
                    tokenizer=_FakeTokenizer(), eos_token_ids=frozenset({EOS}))
    engine = Engine(gen, {}, served.mesh, 1, None, eos_token_ids=served.eos_token_ids,
                    drafter=prompt_lookup)
    engine.start()
    with TestClient(create_app(served, engine)) as c:
        yield c
    engine.stop()


def test_chat_logprobs_streaming_and_not(chat_client):
    body = {"model": NAME, "temperature": 0, "messages": [{"role": "user", "content": "dbf"}],
            "max_tokens": 3, "logprobs": True, "top_logprobs": 3}
    r = chat_client.post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    ids = choice["token_ids"]
    assert ids == fake_greedy([3, 1, 5], 3)
    content = choice["logprobs"]["content"]
    names = [chr(97 + t % 26) for t in ids]
    assert [c["token"] for c in content] == names == list(choice["message"]["content"])
    assert [c["bytes"] for c in content] == [[ord(n)] for n in names]
    assert all(len(c["top_logprobs"]) == 3 and c["top_logprobs"][0]["token"] == c["token"] for c in content)
    chunks = sse_chunks(chat_client, "/v1/chat/completions", {**body, "stream": True})
    streamed = [e for c in chunks if (lp := c["choices"][0]["logprobs"]) for e in lp["content"]]
    assert streamed == content
    plain = chat_client.post("/v1/chat/completions", json={**body, "logprobs": False, "top_logprobs": None})
    assert plain.json()["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("extra, param, message", [
    ({"logprobs": True, "top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs",
     f"top_logprobs: Input should be less than or equal to {MAX_TOP_LOGPROBS}"),
    ({"top_logprobs": 2}, "top_logprobs", "top_logprobs needs logprobs: true"),
    ({"logprobs": 3}, "logprobs", "logprobs: Input should be a valid boolean"),
])
def test_chat_logprobs_bounds(chat_client, extra, param, message):
    r = chat_client.post("/v1/chat/completions", json={"model": NAME, "max_tokens": 1, **extra,
                                                        "messages": [{"role": "user", "content": "a"}]})
    assert r.status_code == 400 and message in r.json()["error"]["message"]
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra, param, message", [
    ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "tools is not served"),
    ({"response_format": {"type": "json_object"}}, "response_format", "response_format is not served"),
    ({"frequency_penalty": 0.5}, "frequency_penalty", "frequency_penalty is not served"),
    ({"logit_bias": {"3": 100}}, "logit_bias", "logit_bias is not served"),
    ({"messages": [{"role": "wizard", "content": "a"}]}, "messages",
     "messages[0] needs a role, one of system, developer, user, assistant, tool"),
    ({"messages": [{"content": "a"}]}, "messages", "messages[0] needs a role"),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                                                 {"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages", "messages[0].content[1] is a part of type 'image_url': the model takes text parts only"),
    ({"messages": [{"role": "user", "content": 3}]}, "messages",
     "messages[0].content must be a string or a list of text parts"),
])
def test_chat_fields_it_would_ignore_are_refused(chat_client, extra, param, message):
    r = chat_client.post("/v1/chat/completions", json={
        "model": NAME, "max_tokens": 1, "messages": [{"role": "user", "content": "a"}], **extra})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param


@pytest.mark.parametrize("extra, param, message", [
    ({"stop": ""}, "stop", "an empty stop string would end every completion"),
    ({"stop": ["b", ""]}, "stop", "an empty stop string would end every completion"),
    ({"top_k": -2}, "top_k", "top_k: Input should be greater than or equal to -1"),
    ({"stream_options": {"include_usage": True}}, "stream_options",
     "stream_options applies to a streamed response"),
])
def test_sampling_fields_that_cannot_mean_anything_are_refused(chat_client, extra, param, message):
    r = chat_client.post("/v1/completions", json={"model": NAME, "prompt": "ab", "max_tokens": 2, **extra})
    assert r.status_code == 400 and message in r.json()["error"]["message"], r.text
    assert r.json()["error"]["param"] == param
    off = chat_client.post("/v1/completions", json={"model": NAME, "prompt": "ab", "max_tokens": 2,
                                                    "top_k": -1})
    assert off.status_code == 200, off.text


def test_no_op_values_of_unserved_fields_are_accepted(chat_client, client):
    r = chat_client.post("/v1/chat/completions", json={
        "model": NAME, "max_tokens": 1, "tools": [], "tool_choice": "none", "frequency_penalty": 0,
        "presence_penalty": 0.0, "response_format": {"type": "text"}, "user": "u",
        "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "a"}]})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"model": NAME, "prompt": [1], "max_tokens": 1,
                                             "best_of": 1, "logit_bias": {}})
    assert r.status_code == 200, r.text
    r = client.post("/v1/completions", json={"model": NAME, "prompt": [1], "best_of": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"


def test_speculative_usage_counts(chat_client, client):
    # the fake's first token after 3 1 3 1 is 3, so prompt lookup drafts 1 3 (what followed
    # the earlier "1 3"), and the fake's next is not 1: drafts proposed and rejected, the text
    # still greedy's
    prompt = [3, 1, 3, 1]
    r = chat_client.post("/v1/completions", json={"model": NAME, "temperature": 0, "prompt": prompt,
                                                  "max_tokens": 3})
    body = r.json()
    assert body["choices"][0]["token_ids"] == fake_greedy(prompt, 3)
    spec = body["usage"]["speculative"]
    assert spec["launches"] >= 1 and spec["drafted"] >= 1 and 0 <= spec["accepted"] <= spec["drafted"]
    stats = chat_client.get("/stats").json()
    assert stats["speculative"] and stats["verify_launches"] >= spec["launches"]
    assert "speculative" not in complete(client, prompt=[1], max_tokens=1).json()["usage"]
