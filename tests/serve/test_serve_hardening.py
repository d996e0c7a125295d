"""`mkc serve` under hostile requests and clients, over the stand-in module (serve_fakes): strict
field types and bounds (OpenAI's 400 body naming the field), nesting at any depth, a hostile
request beside a good one (the good one unharmed), a client that leaves freeing its row,
tokenizing off the event loop, the body, prompt, header-time, body-time, connection and
buffered-body caps, the API docs routes off."""
from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient
from serve_fakes import EOS, LetterTokenizer, fake_greedy, fake_mesh, fake_module, fake_prefill, fake_server

from mkc.serve.api import Limits, create_app
from mkc.serve.engine import Engine, Request, Unfit
from mkc.serve.model import Served
from mkc.serve.sampling import SamplingParams

NAME = "fake_mini"


def make_client(limits: Limits = Limits(), tokenizer=None) -> tuple[TestClient, Engine]:
    gen = fake_module()
    served = Served(name=NAME, gen=gen, weights={}, mesh=fake_mesh(), interpret=None,
                    tokenizer=tokenizer or LetterTokenizer(), eos_token_ids=frozenset({EOS}))
    engine = Engine(gen, {}, served.mesh, 2, None, max_queue=4, eos_token_ids=served.eos_token_ids)
    return TestClient(create_app(served, engine, limits)), engine


@pytest.fixture(scope="module")
def client():
    c, engine = make_client()
    engine.start()
    with c:
        yield c
    engine.stop()


def openai_400(r: httpx.Response, param: str | None) -> str:
    """The message of OpenAI's 400 error body, checked to be one, naming `param` (or a part
    of it: `stop_token_ids.0`)."""
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == 400
    assert error["type"] == "invalid_request_error", error
    assert error["param"] == param or error["param"].startswith(f"{param}."), error
    return error["message"]


COMPLETION = {"model": NAME, "prompt": [1], "max_tokens": 1, "temperature": 0}
CHAT = {"model": NAME, "max_tokens": 1, "temperature": 0, "messages": [{"role": "user", "content": "a"}]}


@pytest.mark.parametrize("field, value", [
    ("top_k", 2**31), ("top_k", "1"), ("top_k", True), ("top_k", 1.5), ("top_k", ["7"]),
    ("seed", 2**64), ("seed", "1"), ("temperature", "1"), ("temperature", True),
    ("top_p", "yes"), ("max_tokens", "1"), ("max_tokens", True), ("max_tokens", ["7"]),
    ("stream", "yes"), ("stream", 1), ("ignore_eos", "true"), ("echo", 0), ("n", "1"),
    ("logprobs", True), ("stop_token_ids", ["7"]), ("stop_token_ids", [True]), ("stop", 5),
    ("stop", [1]), ("model", 5), ("stream_options", {"include_usage": "yes"}),
    ("prompt", [True]), ("prompt", ["7", 1]), ("prompt", [[1], "a"]), ("prompt", {"a": 1}),
    ("prompt", 5), ("prompt", None), ("prompt", [1.0]), ("prompt", [[True]]),
])
def test_a_completion_field_of_the_wrong_type_or_range_is_a_400_naming_it(client, field, value):
    openai_400(client.post("/v1/completions", json={**COMPLETION, field: value}), field)


@pytest.mark.parametrize("messages", [
    [{"role": "user", "content": [{"type": "text", "text": 5}]}],
    [{"role": "user", "content": [{"type": "text", "text": None}]}],
    [{"role": "user", "content": [{"type": "text", "text": ["a"]}]}],
    [{"role": "user", "content": [{"type": "text"}]}],
    [{"role": "user", "content": [{"type": ["text"], "text": "a"}]}],
    [{"role": "user", "content": [{"type": {"text": 1}, "text": "a"}]}],
    [{"role": "user", "content": ["a"]}],
    [{"role": ["user"], "content": "a"}],
    [{"role": {"user": 1}, "content": "a"}],
    [{"role": "user", "content": "a", "name": 5}],
    [{"role": "user", "content": {"text": "a"}}],
])
def test_a_chat_message_of_the_wrong_shape_is_a_400(client, messages):
    openai_400(client.post("/v1/chat/completions", json={**CHAT, "messages": messages}), "messages")


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", '{"model": "fake_mini", "prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"model": "fake_mini", "prompt": ["\\udfff"], "max_tokens": 1}', "prompt"),
    ("/v1/completions", '{"model": "fake_mini", "prompt": [1], "max_tokens": 1, "stop": "\\ud800"}',
     "stop"),
    ("/v1/chat/completions", '{"model": "fake_mini", "max_tokens": 1, "messages": '
                             '[{"role": "user", "content": "\\ud800"}]}', "messages"),
    ("/v1/chat/completions", '{"model": "fake_mini", "max_tokens": 1, "messages": [{"role": "user", '
                             '"content": [{"type": "text", "text": "\\ud800"}]}]}', "messages"),
    ("/tokenize", '{"prompt": "\\ud800"}', "prompt"),
    ("/v1/completions", '{"model": "\\ud800", "prompt": [1]}', "model"),
])
def test_a_lone_surrogate_is_a_400(client, path, body, param):
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert "lone surrogate" in openai_400(r, param)


@pytest.mark.parametrize("depth", [970, 1100, 1500, 100_000])
@pytest.mark.parametrize("path, head", [
    ("/v1/completions", '{"model": "fake_mini", "prompt": [1], "max_tokens": 1, "x": '),
    ("/v1/chat/completions", '{"model": "fake_mini", "max_tokens": 1, "messages": [{"role": "user", '
                             '"content": "a", "x": '),
    ("/tokenize", '{"prompt": "a", "x": ')], ids=["completion", "chat", "tokenize"])
def test_a_field_nested_too_deep_is_a_400(client, path, head, depth):
    """An ignored field nested 970 to 1100 deep once passed the JSON parser and ran the Unicode
    check out of recursion: a plain-text 500. Any depth past MAX_DEPTH is now a 400."""
    nested = "[" * (depth // 2) + '{"a": ' * (depth - depth // 2) + "1" + "}" * (depth - depth // 2) \
        + "]" * (depth // 2)
    body = head + nested + ("}]}" if "messages" in head else "}")
    r = client.post(path, content=body.encode(), headers={"content-type": "application/json"})
    assert "deep, past the 100 this server reads" in openai_400(r, None)


def test_brackets_inside_strings_are_not_nesting(client):
    stop = ['[{"' * 200, '\\"[' * 200]              # an escaped quote does not end the string
    r = client.post("/v1/completions", json={**COMPLETION, "stop": stop, "x": [[[[[[]]]]]] * 50})
    assert r.status_code == 200, r.text


def test_the_unicode_check_takes_any_depth():
    from mkc.serve.parsing import ApiError, check_unicode
    value: Any = ["\ud800"]
    for _ in range(20_000):
        value = [{"a": value}]
    with pytest.raises(ApiError, match="lone surrogate"):
        check_unicode(value, "x")


@pytest.mark.parametrize("ids", [[64], [-1], [3, 2**40]])
def test_stop_token_ids_outside_the_vocabulary_are_a_400(client, ids):
    for path, body in (("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT)):
        r = client.post(path, json={**body, "stop_token_ids": ids})
        assert "outside the vocabulary (0 to 63)" in openai_400(r, "stop_token_ids")


def test_a_chat_limit_past_the_context_is_named_as_sent(client):
    for limit in ("max_completion_tokens", "max_tokens"):
        r = client.post("/v1/chat/completions", json={**CHAT, "max_tokens": None, limit: 2**63})
        assert openai_400(r, limit).startswith(f"{limit} = {2**63} with a prompt of 1 tokens")


def test_head_health_is_a_200(client):
    assert client.head("/health").status_code == 200


def test_detokenize_takes_integers_only(client):
    for tokens in (["1"], [True], [1.0], 5):
        openai_400(client.post("/detokenize", json={"tokens": tokens}), "tokens")
    assert client.post("/detokenize", json={"tokens": [0, 1]}).json() == {"prompt": "ab"}


def test_a_hostile_request_beside_a_good_one_leaves_it_unharmed():
    """top_k past int32 once passed validation and overflowed where the engine packs sampling
    settings, failing every busy row; now it is a 400 and the request beside it completes."""
    prompt, n = [3, 5, 7], 24
    with fake_server(batch=2, limits=Limits()) as url:
        results: dict[str, httpx.Response] = {}

        def send(name: str, body: dict) -> None:
            results[name] = httpx.post(url + "/v1/completions", json=body, timeout=60)
        good = threading.Thread(target=send, args=("good", {**COMPLETION, "prompt": prompt,
                                                            "max_tokens": n, "ignore_eos": True}))
        good.start()
        for k in (2**31, 2**40, 2**63):
            send("hostile", {**COMPLETION, "prompt": [2, 4], "max_tokens": 8, "temperature": 0.7,
                             "top_k": k})
            openai_400(results["hostile"], "top_k")
        good.join()
    assert results["good"].status_code == 200, results["good"].text
    assert results["good"].json()["choices"][0]["token_ids"] == fake_greedy(prompt, n)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_client_that_disconnects_frees_its_row_within_a_step(stream):
    """A waiting (non-streaming) client's disconnect was seen only when no token came for a
    second: while tokens came faster, its row generated to max_tokens for nobody."""
    step, n = 0.1, 29                  # 2.9 s of steps: the row would be busy that long
    body = {**COMPLETION, "prompt": [3, 5], "max_tokens": n, "ignore_eos": True, "stream": stream}
    with fake_server(batch=1, step_seconds=step) as url, httpx.Client() as http:
        http.post(url + "/v1/completions", json=COMPLETION, timeout=60)     # the step compiled
        if stream:
            with http.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
                next(r.iter_lines())               # the first token, then the client leaves
        else:
            with pytest.raises(httpx.ReadTimeout):   # the client gives up and closes its connection
                http.post(url + "/v1/completions", json=body, timeout=httpx.Timeout(30, read=0.5))
        left = time.monotonic()
        while (stats := http.get(url + "/stats").json())["busy_rows"] and time.monotonic() < left + 10:
            time.sleep(step / 4)
        freed = time.monotonic() - left
    assert stats["busy_rows"] == 0 and freed < 1.0, (freed, stats)
    assert stats["steps"] < n                    # it stopped short of max_tokens


def test_the_engine_refuses_what_does_not_fit_a_launch_and_serves_the_rest():
    """An engine given a request whose settings overflow the sampler's int32 arrays (or tokens
    outside the vocabulary) refuses that request alone at submit."""
    import asyncio
    gen = fake_module()
    engine = Engine(gen, {}, fake_mesh(), 2, None, eos_token_ids=frozenset({EOS}))
    engine.start()
    loop = asyncio.new_event_loop()
    try:
        good = Request(prompt=[3, 5], sampling=SamplingParams(max_tokens=20, temperature=0.0), loop=loop)
        engine.submit(good)
        for sampling, prompt, field in ((SamplingParams(max_tokens=4, top_k=2**31), [1], "top_k"),
                                        (SamplingParams(max_tokens=4, seed=-2**40), [1], "seed"),
                                        (SamplingParams(max_tokens=4), [2**31], "prompt")):
            with pytest.raises(Unfit) as e:
                engine.submit(Request(prompt=prompt, sampling=sampling, loop=loop))
            assert e.value.field == field
        tokens = []
        while True:
            event = loop.run_until_complete(asyncio.wait_for(good.events.get(), 60))
            if event.finish_reason is not None:
                break
            tokens.append(event.token)
        assert event.finish_reason == "length" and tokens == fake_greedy([3, 5], 20)
    finally:
        engine.stop()
        loop.close()


def _thread_cpu(name: str) -> float:
    """CPU seconds of this process's thread `name` so far."""
    thread = next(t for t in threading.enumerate() if t.name == name)
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def test_health_answers_while_a_long_prompt_is_tokenized():
    """A 3 MB text prompt is tokenized in the thread pool: the event loop's thread spends a
    small part of the tokenizer's CPU time on the request, and /health answers throughout.
    Judged by CPU time (the loop thread's, against the tokenizer's), which load does not move."""
    text = "abcdefghij" * 300_000
    tokenizer = LetterTokenizer()
    t0 = time.thread_time()
    tokenizer.encode(text)
    encode_cpu = time.thread_time() - t0
    with fake_server(tokenizer=tokenizer, limits=Limits(max_body_bytes=8 << 20)) as url:
        with httpx.Client(timeout=60) as http:
            http.get(url + "/health")
            latencies: list[float] = []
            done = threading.Event()

            def poll() -> None:
                # a bounded number of polls: each costs the loop's thread CPU time of its own
                while not done.is_set() and len(latencies) < 10:
                    t = time.perf_counter()
                    assert http.get(url + "/health").status_code == 200
                    latencies.append(time.perf_counter() - t)
                    time.sleep(0.02)
            loop_cpu = _thread_cpu("mkc-serve-http")
            poller = threading.Thread(target=poll)
            poller.start()
            try:
                r = httpx.post(url + "/v1/completions", timeout=120,
                               json={"model": NAME, "prompt": text, "max_tokens": 1})
            finally:
                done.set()
                poller.join()
            loop_cpu = _thread_cpu("mkc-serve-http") - loop_cpu
    assert "the prompt has 3000000 tokens" in openai_400(r, "prompt")
    print(f"encode {encode_cpu * 1e3:.0f} ms CPU; loop thread {loop_cpu * 1e3:.0f} ms CPU; /health "
          f"{len(latencies)} answers, max {max(latencies) * 1e3:.0f} ms")
    assert latencies and loop_cpu < max(0.1, encode_cpu / 2), (loop_cpu, encode_cpu)


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _head(path: str, length: int) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def _refusal(s: socket.socket) -> tuple[int, dict]:
    """The status and OpenAI error of the answer on `s`, read until the server closes it."""
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status = int(head.split()[1])
    error = json.loads(body)["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status, error
    return status, error


def test_a_body_past_the_cap_is_a_413():
    with fake_server(limits=Limits(max_body_bytes=1000)) as url:
        big = json.dumps({**COMPLETION, "prompt": [1] * 400}).encode()
        assert len(big) > 1000
        for content in (big, iter([big[:600], big[600:]])):     # with a Content-Length, and chunked
            r = httpx.post(url + "/v1/completions", content=content,
                           headers={"content-type": "application/json"}, timeout=30)
            assert r.status_code == 413, r.text
            assert "cap of 1000 bytes (mkc serve --max-body-bytes)" in r.json()["error"]["message"]
        r = httpx.post(url + "/v1/completions", json={**COMPLETION, "prompt": [1] * 20}, timeout=30)
        assert r.status_code == 200, r.text


def test_a_client_still_sending_a_body_past_the_cap_reads_its_413():
    """A connection closed with bytes unread is reset: a client still sending a body far past
    the cap (more than the sockets' buffers hold) saw its send fail, not the 413. The rest of
    the body is now read first."""
    body = b" " * (8 << 20)
    with fake_server() as url, _connect(url) as s:               # the default 4 MiB cap
        s.sendall(_head("/v1/completions", len(body)))
        s.sendall(body)
        status, error = _refusal(s)
    assert status == 413 and "(mkc serve --max-body-bytes)" in error["message"]


def test_prompts_and_tokenize_past_the_prompt_cap_are_400s():
    c, engine = make_client(Limits(max_prompt_tokens=4))
    engine.start()
    try:
        with c:
            r = c.post("/v1/completions", json={**COMPLETION, "prompt": [1] * 5})
            cap = "more than this server's cap (mkc serve --max-prompt-tokens) of 4"
            assert cap in openai_400(r, "prompt")
            r = c.post("/v1/chat/completions",
                       json={**CHAT, "messages": [{"role": "user", "content": "abcde"}]})
            assert "--max-prompt-tokens" in openai_400(r, "messages")
            r = c.post("/tokenize", json={"prompt": "abcde"})
            assert "--max-prompt-tokens" in openai_400(r, "prompt")
            assert c.post("/tokenize", json={"prompt": "abcd"}).json()["count"] == 4
            assert c.post("/v1/completions", json={**COMPLETION, "prompt": [1] * 4}).status_code == 200
    finally:
        engine.stop()


def test_a_client_slow_to_send_its_headers_is_cut_off():
    """uvicorn's keep-alive timeout stops at a request's first byte: a client trickling its
    headers would hold its connection for ever."""
    with fake_server(limits=Limits(header_seconds=0.5)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET /health HTTP/1.1\r\n")
            deadline = time.monotonic() + 20
            closed = False
            while not closed and time.monotonic() < deadline:
                try:
                    s.sendall(b"X")
                    s.settimeout(0.2)
                    closed = s.recv(1024) == b""
                except socket.timeout:
                    continue
                except OSError:
                    closed = True
            assert closed, "the connection is still open after 20 s"
        assert httpx.get(url + "/health", timeout=10).status_code == 200    # a prompt client is served


def test_a_body_dribbled_past_the_body_timeout_is_a_408():
    """The header timeout ends at the headers: a body sent a byte at a time held its connection
    (and its bytes) for as long as the client liked."""
    with fake_server(limits=Limits(body_seconds=0.5)) as url, _connect(url) as s:
        s.sendall(_head("/v1/completions", 100))
        t0 = time.monotonic()
        with contextlib.suppress(OSError):
            for _ in range(20):
                s.sendall(b" ")
                time.sleep(0.1)
        status, error = _refusal(s)
        assert status == 408 and "within 0.5 s of its headers (mkc serve --body-timeout)" in error["message"]
        assert time.monotonic() - t0 < 5
        assert httpx.post(url + "/v1/completions", json=COMPLETION, timeout=30).status_code == 200


def test_connections_past_the_cap_are_a_503():
    with fake_server(limits=Limits(max_connections=3)) as url:
        idle = [_connect(url) for _ in range(3)]
        try:
            with _connect(url) as s:
                s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
                status, error = _refusal(s)
            assert status == 503 and "(3, mkc serve --max-connections)" in error["message"]
            idle.pop().close()
            deadline = time.monotonic() + 10
            while (r := httpx.get(url + "/health", timeout=10)).status_code != 200:
                assert r.status_code == 503 and time.monotonic() < deadline     # until it is counted out
        finally:
            for s in idle:
                s.close()


def test_bodies_being_received_are_bounded_together():
    """Each connection could hold up to --max-body-bytes in its body buffer, with no bound across
    them; a Content-Length is held from the start, so slow bodies cannot creep past the bound."""
    body = json.dumps(COMPLETION).encode().ljust(1000)
    with fake_server(limits=Limits(max_body_bytes=1000, max_buffered_bytes=2500)) as url:
        with _connect(url) as a, _connect(url) as b, _connect(url) as c:
            a.sendall(_head("/v1/completions", 1000) + body[:10])
            b.sendall(_head("/v1/completions", 1000))
            time.sleep(0.5)                            # both are being received
            c.sendall(_head("/v1/completions", 1000))
            status, error = _refusal(c)
            assert status == 503 and "(2500 bytes, mkc serve --max-buffered-bytes)" in error["message"]
            with _connect(url) as d:                       # without a length: counted as it arrives
                d.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked"
                          b"\r\n\r\n258\r\n" + b" " * 600 + b"\r\n")
                assert _refusal(d)[0] == 503
            for s, rest in ((a, body[10:]), (b, body)):
                s.sendall(rest)
                assert s.recv(100).startswith(b"HTTP/1.1 200")


def test_api_docs_are_off_unless_asked_for():
    for limits, status in ((Limits(), 404), (Limits(api_docs=True), 200)):
        c, _ = make_client(limits)
        with c:
            for path in ("/docs", "/redoc", "/openapi.json"):
                assert c.get(path).status_code == status, (path, limits)


def _refuses_13(what):
    def step(tokens, *rest):
        if 13 in tokens:
            raise ValueError(f"{what} cannot take token 13")
        return fake_prefill(tokens) if what == "prefill" else fake_greedy(tokens, rest[0])
    return step


@pytest.mark.parametrize("kw", [{"drafter": _refuses_13("draft")},
                                {"prefill": "reference", "prefiller": _refuses_13("prefill")}],
                         ids=["drafter", "prefiller"])
def test_an_engine_error_from_one_requests_tokens_fails_that_request_alone(kw):
    """The drafter and the reference's prefill work on one request's tokens: when either fails,
    that request ends with the error and the row beside it goes on exactly."""
    import asyncio
    engine = Engine(fake_module(), {}, fake_mesh(), 2, None, **{"prefill": "decode", **kw})

    async def generate(prompt: list[int], n: int) -> tuple[list[int], Any]:
        req = Request(prompt=prompt, loop=asyncio.get_running_loop(),
                      sampling=SamplingParams(max_tokens=n, temperature=0.0))
        engine.submit(req)
        while (event := await asyncio.wait_for(req.events.get(), 60)).finish_reason is None:
            pass
        return req.generated, event

    async def both():
        return await asyncio.gather(generate([3, 5, 7, 3, 5], 16), generate([2, 13, 4], 8))
    engine.start()
    try:
        (good, good_end), (_, bad_end) = asyncio.run(both())
    finally:
        engine.stop()
    assert bad_end.finish_reason == "error" and "cannot take token 13" in bad_end.error
    assert good_end.finish_reason == "length" and good == fake_greedy([3, 5, 7, 3, 5], 16)
    assert engine.failure is None
