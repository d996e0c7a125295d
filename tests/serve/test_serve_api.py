"""The HTTP API's schema and refusals, in process (FastAPI's TestClient) over the engine on a
stand-in module (serve_fakes): no kernel runs. The real server is tests/serve/test_serve_server.py."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient
from serve_fakes import CONTEXT, EOS, fake_greedy, fake_mesh, fake_module

from mkc.serve.api import create_app
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


def test_models_and_health(client):
    assert client.get("/health").status_code == 200
    data = client.get("/v1/models").json()["data"]
    assert [m["id"] for m in data] == [NAME] and data[0]["max_model_len"] == CONTEXT


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
    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1, 2]})):
        r = client.post(path, json=body)
        assert r.status_code == 400 and "needs a tokenizer" in r.json()["error"]["message"]
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
        assert r.status_code == 429
        assert "the server is busy: all 1 rows are busy" in r.json()["error"]["message"]
    finally:
        loop.close()
