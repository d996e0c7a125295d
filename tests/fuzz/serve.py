"""Hostile HTTP requests against `mkc serve`, each sent beside good requests: seeded bodies that
are not JSON or not objects, numbers past the types they become, fields of the wrong type,
malformed chat messages and parts, text that is not Unicode, odd paths and methods, bodies past
the cap, fields nested hundreds to 100,000 deep, and several hostile requests at once; and
hostile clients: ones that disconnect mid-request, send their headers or body slowly, open more
connections than the server takes, or send texts near the body cap to tokenize. The fuzz
campaign's `serve` target (benchmarks/fuzz_campaign.py) runs one case per hostile request.

    python benchmarks/fuzz_serve.py --seed 0 --cases 200 [--url http://127.0.0.1:8000
        --max-body-bytes N --header-timeout S --body-timeout S --max-connections N
        --answer-seconds S]

Without --url (or MKC_FUZZ_SERVE_URL in the campaign), the server is mkc serve's API and engine
over the tests' stand-in module (tests/serve/serve_fakes.py: no kernel, so cases take
milliseconds), in a thread of this process, with the bounds of `STAND_IN` (a 256 KiB body
cap, 1 s for headers, 0.5 s for a body, 24 connections). With one, a running `mkc serve` (its
model must take the prompt [1, 2, 3]), whose bounds the options give (its `mkc serve` options'
defaults when not given).

A case's outcome: ok when every hostile request got a 2xx JSON answer (a stream of JSON events
without an error event), a 4xx with OpenAI's error body, or a 503 with it (a server at its
connection or body bound), every good request beside it got the answer it gets alone, /health
answers afterwards, and (on a server the harness has to itself) no row is still busy. Else
`traceback` (another 5xx: an exception the API did not turn into a refusal), `bad_output` (a
refusal without OpenAI's body, or an error event in a stream), `serve_harmed` (a good request
failed or changed), `hang` (no answer in ANSWER_SECONDS, or a slow client not cut off within
its timeout), `stall` (/health slower than STALL_SECONDS while a text was tokenized),
`row_kept` (a row still busy ROW_SECONDS after the case: a gone client's) or `crash` (the
connection was dropped, or /health no longer answers).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import urlsplit

import httpx

ROOT = Path(__file__).resolve().parents[2]
ANSWER_SECONDS = 20.0          # a refusal takes milliseconds; a stand-in completion, tens of them
STALL_SECONDS = 1.0            # /health while a text is tokenized (milliseconds when it does not wait)
ROW_SECONDS = 5.0              # a row freed after its requests ended (a step, on the stand-in ms)
SLACK_SECONDS = 5.0            # past a timeout, before a slow client's cut-off counts as missing


@dataclass(frozen=True)
class Bounds:
    """What the server under test bounds, as its `mkc serve` options say (the slow-client kinds
    probe them): --max-body-bytes, --header-timeout, --body-timeout, --max-connections."""
    body_cap: int = 4 << 20
    header_seconds: float = 10.0
    body_seconds: float = 60.0
    max_connections: int = 512


STAND_IN = Bounds(body_cap=256 << 10, header_seconds=1.0, body_seconds=0.5, max_connections=24)
BOUNDS = STAND_IN              # the server's under test (main() sets a --url server's)
GOOD_PROMPT = [1, 2, 3]
REQUESTS_PER_CASE = 3
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize")


@dataclass
class Hostile:
    """One hostile request: `body` raw bytes (JSON or not), sent as `content_type`."""
    method: str
    path: str
    body: bytes = b""
    content_type: str = "application/json"
    headers: dict[str, str] = field(default_factory=dict)
    desc: str = ""
    must_refuse: str | None = None   # why it must get a 4xx (a field of a type OpenAI refuses)
    # a hostile client rather than a request: url -> None, or (class, signature) of what went wrong
    action: Callable[[str], tuple[str, str] | None] | None = None


# ---- values and bodies ----------------------------------------------------------------------

# JSON literals Python's json.dumps cannot write (or would refuse): spliced into a body's text
RAW = {"__NAN__": "NaN", "__INF__": "-Infinity", "__BIG_FLOAT__": "1e400",
       "__HUGE_INT__": "9" * 5000, "__NEG_ZERO__": "-0", "__EXP_INT__": "1E2"}
VALUES: list[Any] = [
    None, True, False, 0, -1, 1, 2, 2**31 - 1, 2**31, -2**31 - 1, 2**32, 2**53 + 1, 2**63, -2**63 - 1,
    2**64, 10**30, 0.5, 1.5, -0.0, 1e308, 5e-324, -1e-300, "1", "", "yes", "true", "null", "\ud800",
    "\udfff\ud800", "\x00", "a" * 5000, [], ["7"], [1], [True], [[1]], [None], {}, {"a": 1},
    {"type": "text"}, [[[[]]]], *RAW]


# numbers at the edges of the types a request's numbers become (int32 in the sampler's arrays,
# int64 for a seed, float32 for temperature and top_p)
EDGES: list[Any] = [2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, -2**63 - 1, 2**64, 10**30,
                    -2, -1, 0, 3.4e38, 3.5e38, 1e-46, -0.0, 2.0000001, 1.0000001, "__INF__",
                    "__BIG_FLOAT__", "__HUGE_INT__", "__NAN__"]


def value(rng: random.Random) -> Any:
    return rng.choice(VALUES)


def number(rng: random.Random) -> Any:
    """A value for a numeric field: mostly a number at a type's edge."""
    return rng.choice(EDGES) if rng.random() < 0.7 else value(rng)


def to_body(obj: Any) -> bytes:
    """`obj` as JSON text (lone surrogates as \\u escapes), the RAW placeholders spliced in."""
    text = json.dumps(obj, ensure_ascii=True)
    for name, literal in RAW.items():
        text = text.replace(f'"{name}"', literal)
    return text.encode()


def good_completion(model: str) -> dict:
    return {"model": model, "prompt": GOOD_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def base_request(rng: random.Random, model: str) -> tuple[str, dict]:
    """A valid request to one of the endpoints that the hostile kinds then spoil."""
    path = rng.choice(ENDPOINTS)
    if path == "/v1/completions":
        return path, {"model": model, "prompt": rng.choice([GOOD_PROMPT, "abc"]), "max_tokens": 4}
    if path == "/v1/chat/completions":
        return path, {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "ab"}]}
    if path == "/tokenize":
        return path, {"model": model, "prompt": "abc"}
    return path, {"model": model, "tokens": [1, 2]}


NUMERIC_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens", "n",
                  "logprobs", "top_logprobs", "best_of", "presence_penalty", "min_tokens")
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", "max_tokens", "max_completion_tokens",
                   "n", "stop", "stop_token_ids", "ignore_eos", "stream", "stream_options", "logprobs",
                   "top_logprobs", "echo", "best_of", "presence_penalty", "logit_bias", "tools",
                   "response_format", "min_tokens", "model", "user", "suffix")


# what OpenAI's API takes for each field (strictly: no "1" or true for a number): int, float
# (an int too), bool, str, or an object; each may be null
FIELD_TYPES = {"temperature": float, "top_p": float, "top_k": int, "seed": int, "max_tokens": int,
               "max_completion_tokens": int, "n": int, "top_logprobs": int, "ignore_eos": bool,
               "stream": bool, "echo": bool, "model": str, "stream_options": dict}


def wrong_type(name: str, v: Any, path: str) -> str | None:
    """Why `v` cannot be field `name` of a request to `path` (None: it has the right type; its
    range is the server's to judge)."""
    chat = path == "/v1/chat/completions"
    if name in (("echo",) if chat else ("max_completion_tokens", "top_logprobs")):
        return None                      # not the endpoint's field: ignored, as vLLM does
    want = FIELD_TYPES.get(name)
    if name == "logprobs":
        want = bool if chat else int
    if want is None or v is None or (name == "model" and v is None):
        return None
    if isinstance(v, str) and v in RAW:
        ok = want in (int, float) and RAW[v] != "NaN" and "Inf" not in RAW[v] and (
            want is float or RAW[v] in ("-0", RAW["__HUGE_INT__"]))
    elif want is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool)
    elif want is int:
        ok = isinstance(v, int) and not isinstance(v, bool)
    else:
        ok = isinstance(v, want)
    return None if ok else f"{name} = {str(v)[:40]!r} is not a {want.__name__}"


def kind_sampling(rng: random.Random, model: str) -> Hostile:
    path = rng.choice(ENDPOINTS[:2])
    body = ({"model": model, "prompt": GOOD_PROMPT, "max_tokens": 4} if path == ENDPOINTS[0] else
            {"model": model, "max_tokens": 4, "messages": [{"role": "user", "content": "ab"}]})
    set_: dict[str, Any] = {}
    # mostly one field spoiled, and mostly a number: a request refused for its first bad field
    # never reaches the engine with its second
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        name = rng.choice(NUMERIC_FIELDS[:6] if rng.random() < 0.6 else SAMPLING_FIELDS)
        set_[name] = number(rng) if name in NUMERIC_FIELDS else value(rng)
        if name == "stream_options" and rng.random() < 0.5:
            set_[name] = {"include_usage": value(rng)}
    if rng.random() < 0.3:
        set_["temperature"] = rng.choice([0, 0.7, 2])     # a sampled row carries its settings
    why = next((w for name, v in set_.items() if (w := wrong_type(name, v, path))), None)
    return Hostile("POST", path, to_body(body | set_), desc=f"{path} with {set_!r}"[:300],
                   must_refuse=why)


def hostile_message(rng: random.Random) -> Any:
    shape = rng.choice([0, 1, 2, 3, 3, 3, 4, 5, 6])
    if shape == 0:
        return value(rng)
    message = {"role": rng.choice(["user", "assistant", "system", "tool", "developer"]),
               "content": "ab"}
    if shape == 1:
        message["role"] = value(rng)
    elif shape == 2:
        message["content"] = value(rng)
    elif shape == 3:
        message["content"] = [rng.choice([
            {"type": "text", "text": value(rng)}, {"type": value(rng), "text": "a"},
            {"type": rng.choice([["text"], {"text": "a"}, None, 1]), "text": "a"},
            {"type": "text", "text": rng.choice([1, None, ["a"], {"a": 1}])},
            {"type": "text"}, {"text": "a"}, value(rng),
            {"type": "image_url", "image_url": {"url": "http://x"}}, {"type": "text", "text": "ok"}])
            for _ in range(rng.randint(1, 3))]
    elif shape == 4:
        message[rng.choice(["name", "tool_calls", "tool_call_id", "extra"])] = value(rng)
    elif shape == 5:
        del message[rng.choice(["role", "content"])]
    else:
        message["content"] = None
    return message


def kind_chat(rng: random.Random, model: str) -> Hostile:
    path = rng.choice(["/v1/chat/completions", "/v1/chat/completions", "/tokenize"])
    messages: Any = [hostile_message(rng) for _ in range(rng.randint(1, 3))]
    if rng.random() < 0.1:
        messages = value(rng)
    body = {"model": model, "messages": messages}
    if path != "/tokenize":
        body["max_tokens"] = 2
    return Hostile("POST", path, to_body(body), desc=f"{path} messages={messages!r}"[:300])


TEXTS = ["\ud800", "a\udfffb", "\x00", "\u202e\u2066", "\ufeff", "\U0010ffff", "e\u0301" * 100,
         "\r\n" * 50, "😀" * 100, "a" * 100_000, "", " ", "\\u0000"]


def kind_text(rng: random.Random, model: str) -> Hostile:
    text = "".join(rng.choice(TEXTS) for _ in range(rng.randint(1, 3)))
    path, body = base_request(rng, model)
    where = rng.choice(["prompt", "stop", "model", "content", "key"])
    if where == "prompt":
        body["prompt"] = rng.choice([text, [text], [text, "a"]])
        path = rng.choice(["/v1/completions", "/tokenize"])
        body.pop("tokens", None)
        body.pop("messages", None)
    elif where == "stop":
        body["stop"] = rng.choice([text, [text], ["a", text]])
    elif where == "model":
        body["model"] = text
    elif where == "content":
        path = rng.choice(["/v1/chat/completions", "/tokenize"])
        body = {"model": model, "messages": [{"role": "user", "content": rng.choice(
            [text, [{"type": "text", "text": text}]])}]}
    else:
        body[text] = 1
    return Hostile("POST", path, to_body(body), desc=f"{path} {where}={text[:60]!r}")


def kind_body(rng: random.Random, model: str) -> Hostile:
    path = rng.choice(ENDPOINTS)
    choice = rng.randrange(9)
    if choice == 0:
        body = rng.choice([b"", b"{", b'{"model": ', b"[", b"nul", b'{"a":1}}', b"\xff\xfe{}",
                           b'{"model": "\xc3\x28"}', b"\x00" * 10])
    elif choice == 1:
        body = to_body(value(rng))                            # a JSON value that is not an object
    elif choice == 2:
        depth = rng.choice([100, 1000, 100_000])
        body = b"[" * depth + b"]" * depth
    elif choice == 3:
        _, obj = base_request(rng, model)
        body = to_body(obj).replace(b"{", b'{"model": 1, ', 1)    # a duplicated key
    elif choice == 4:
        _, obj = base_request(rng, model)
        body = to_body(obj) + b" " * BOUNDS.body_cap         # past the cap (a 413)
    elif choice == 5:
        _, obj = base_request(rng, model)
        return Hostile("POST", path, to_body(obj), content_type=rng.choice(
            ["text/plain", "", "application/x-www-form-urlencoded", "application/json; charset=latin-1"]),
            desc=f"{path} with an odd content type")
    elif choice == 6:
        _, obj = base_request(rng, model)
        body = to_body({k: "__HUGE_INT__" if rng.random() < 0.5 else v for k, v in obj.items()})
    elif choice == 7:
        body = to_body({"model": model, "prompt": [rng.randrange(64)] * rng.choice([1, 10_000, 40_000]),
                        "max_tokens": 1})
    else:
        _, obj = base_request(rng, model)
        body = to_body(obj)[:rng.randrange(1, len(to_body(obj)))]    # cut short
    return Hostile("POST", path, body, desc=f"{path} body {body[:80]!r}{'...' if len(body) > 80 else ''}")


def kind_route(rng: random.Random, model: str) -> Hostile:
    method, path = rng.choice([
        ("GET", "/v1/completions"), ("PUT", "/v1/chat/completions"), ("DELETE", "/health"),
        ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/redoc"), ("GET", "/nope"),
        ("GET", "/" + "a" * 8000), ("GET", "/%00"), ("GET", "/v1/models?x=%ff"), ("OPTIONS", "/health"),
        ("HEAD", "/v1/models"), ("GET", "/stats"), ("POST", "/health")])
    return Hostile(method, path, desc=f"{method} {path[:60]}")


def kind_stream(rng: random.Random, model: str) -> Hostile:
    path = rng.choice(ENDPOINTS[:2])
    body = ({"model": model, "prompt": GOOD_PROMPT} if path == ENDPOINTS[0] else
            {"model": model, "messages": [{"role": "user", "content": "ab"}]})
    body |= {"stream": True, "max_tokens": rng.choice([1, 5, 1000, value(rng)]),
             "stream_options": rng.choice([{"include_usage": True}, None, value(rng)]),
             "logprobs": rng.choice([True, 5, value(rng)]), "temperature": rng.choice([0, 1, value(rng)])}
    if rng.random() < 0.5:
        body["top_k"] = value(rng)
    return Hostile("POST", path, to_body(body), desc=f"{path} stream {body!r}"[:300])


def kind_nesting(rng: random.Random, model: str) -> Hostile:
    """A field nested `depth` deep somewhere in a request: an ignored field, a chat message's,
    the prompt, the stop strings. Past 100 deep it must be refused (a 400), at any depth."""
    path, body = base_request(rng, model)
    depth = rng.choice([50, 99, 101, 500, 970, 1000, 1050, 1100, 1500, 5000, 100_000])
    inner = rng.choice([("[", "]", ""), ('{"a": ', "}", "1"), ('[{"b": ', "}]", "[]")])
    nested = (inner[0] * depth + inner[2] + inner[1] * depth).encode()
    where = rng.choice(["extra", "message", "prompt", "stop"])
    if where == "message":
        path, body = "/v1/chat/completions", {"model": model, "max_tokens": 2,
                                              "messages": [{"role": "user", "content": "ab", "x": 0}]}
        text = to_body(body).replace(b'"x": 0', b'"x": ' + nested)
    else:
        name = {"extra": "x", "prompt": "prompt", "stop": "stop"}[where]
        text = to_body({**body, name: 0}).replace(f'"{name}": 0'.encode(), f'"{name}": '.encode() + nested)
    # the body's own objects add a level or three: any depth from 101 on is past the bound
    refuse = f"{where} nested {depth} deep" if depth > 100 else None
    return Hostile("POST", path, text, desc=f"{path} {where} nested {depth} deep ({inner[0]})",
                   must_refuse=refuse)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 80


def _request_bytes(method: str, path: str, body: bytes = b"", more: str = "") -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nHost: fuzz\r\nConnection: close\r\n{more}"
    if method == "POST":
        head += f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
    return (head + "\r\n").encode() + body


def _send(sock: socket.socket, data: bytes) -> None:
    """Send what the server takes: one that answers early (a refusal) may close before the
    rest, and its answer is what is judged."""
    with contextlib.suppress(OSError):
        sock.sendall(data)


def _read_answer(sock: socket.socket, seconds: float) -> tuple[int, str, bytes] | None:
    """The answer on `sock` (status, content type, body), read until the server closes it; None
    when it closed without one; TimeoutError when it neither answered nor closed in `seconds`."""
    data, deadline = b"", time.monotonic() + seconds
    while True:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except (ConnectionResetError, BrokenPipeError):
            chunk = b""
        except socket.timeout:
            raise TimeoutError from None
        if not chunk:
            break
        data += chunk
    if not data:
        return None
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.lower().split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), headers.get("content-type", ""), body


def _judge_raw(sock: socket.socket, seconds: float, method: str, what: str,
               want: tuple[int, ...] = ()) -> tuple[str, str] | None:
    """The verdict on a raw client's answer: None when it is acceptable (and among `want`, when
    given), else (class, signature)."""
    try:
        answer = _read_answer(sock, seconds)
    except TimeoutError:
        return "hang", f"{what}: neither answered nor closed in {seconds:.0f} s"
    except OSError as e:
        return "crash", f"{what}: {type(e).__name__}"
    if answer is None:
        return ("hang", f"{what}: closed without the answer {want}") if want else None
    status, content_type, body = answer
    bad = judge(status, content_type, body, method)
    if bad is None and want and status not in want:
        bad = ("bad_output", f"{status} where {want} was due")
    return bad and (bad[0], f"{what}: {bad[1]}")


def kind_disconnect(rng: random.Random, model: str) -> Hostile:
    """A client that goes away mid-request: before its body is whole, right after sending it,
    after some of the answer (streamed or not), or with a reset. Its row must be freed (checked
    after the case); nothing else may break."""
    path = rng.choice(ENDPOINTS[:2])
    body = {"model": model, "max_tokens": None, "ignore_eos": True, "temperature": rng.choice([0, 1]),
            "stream": rng.random() < 0.5}
    body |= ({"prompt": GOOD_PROMPT} if path == ENDPOINTS[0] else
             {"messages": [{"role": "user", "content": "ab"}]})
    raw = _request_bytes("POST", path, to_body(body))
    when = rng.choice(["mid-body", "sent", "after 0.05 s", "after 0.3 s", "first chunk"])
    reset = rng.random() < 0.3

    def act(url: str) -> tuple[str, str] | None:
        with socket.create_connection(_address(url), timeout=ANSWER_SECONDS) as sock:
            sock.sendall(raw[:len(raw) - 5] if when == "mid-body" else raw)
            if when.startswith("after"):
                time.sleep(float(when.split()[1]))
            elif when == "first chunk":
                with contextlib.suppress(OSError):
                    sock.recv(1)
            if reset:          # SO_LINGER 0: the close sends a reset, not a FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        return None
    return Hostile("POST", path, desc=f"{path} stream={body['stream']}, gone {when}"
                   f"{' (reset)' if reset else ''}", action=act)


def kind_slow(rng: random.Random, model: str) -> Hostile:
    """A client too slow for the server's timeouts: headers a byte at a time (closed after
    --header-timeout), headers then no body, or its body a byte at a time (a 408 after
    --body-timeout)."""
    path, body = base_request(rng, model)
    raw = _request_bytes("POST", path, to_body(body) + b" " * 200)
    how = rng.choice(["headers", "no body", "body"])
    split = raw.index(b"\r\n\r\n") + 4
    pause = rng.choice([0.1, 0.3])

    def act(url: str) -> tuple[str, str] | None:
        due = (BOUNDS.header_seconds if how == "headers" else BOUNDS.body_seconds) + SLACK_SECONDS
        sent = split if how != "headers" else 0
        with socket.create_connection(_address(url), timeout=ANSWER_SECONDS) as sock:
            if how != "headers":
                sock.sendall(raw[:split])
            start = time.monotonic()
            with contextlib.suppress(OSError):          # the server cut it off
                while how != "no body" and sent < len(raw) and time.monotonic() < start + due:
                    sock.sendall(raw[sent:sent + 1])
                    sent += 1
                    time.sleep(pause)
            return _judge_raw(sock, max(0.1, start + due - time.monotonic()), "POST",
                              # a 503 when the case's other clients hold the connections
                              f"{how} sent slowly", () if how == "headers" else (408, 503))
    return Hostile("POST", path, desc=f"{path}: {how} a byte each {pause} s", action=act)


def kind_connections(rng: random.Random, model: str) -> Hostile:
    """More connections than the server takes (--max-connections), at once: idle ones, ones
    with half their headers, and whole requests, each of which must be answered (a 503 past the
    cap, a 429 when the engine's queue is full); all closed together afterwards."""
    plan = [rng.choice(["idle", "half", "health", "completion"])
            for _ in range(BOUNDS.max_connections + rng.randint(1, 8))]

    def act(url: str) -> tuple[str, str] | None:
        socks: list[tuple[str, socket.socket]] = []
        try:
            for what in plan:
                sock = socket.create_connection(_address(url), timeout=ANSWER_SECONDS)
                socks.append((what, sock))
                if what == "half":
                    _send(sock, b"GET /health HTTP/1.1\r\nHo")
                elif what == "health":
                    _send(sock, _request_bytes("GET", "/health"))
                elif what == "completion":
                    _send(sock, _request_bytes("POST", "/v1/completions",
                                               to_body({**good_completion(model), "max_tokens": 2})))
            for what, sock in socks:
                if what in ("health", "completion"):
                    bad = _judge_raw(sock, ANSWER_SECONDS, "GET" if what == "health" else "POST",
                                     f"{what} among {len(plan)} connections", (200, 429, 503))
                    if bad:
                        return bad
            return None
        finally:
            for _, sock in socks:
                sock.close()
    return Hostile("GET", "/health", desc=f"{len(plan)} connections at once", action=act)


def kind_huge_text(rng: random.Random, model: str) -> Hostile:
    """A text near the body cap to tokenize (/tokenize, a text prompt, a chat message) while
    /health is polled: each poll must answer within STALL_SECONDS."""
    path = rng.choice(["/tokenize", "/tokenize", "/v1/completions", "/v1/chat/completions"])
    size = rng.randint(BOUNDS.body_cap // 2, BOUNDS.body_cap - 2048)
    text = "".join(rng.choice(["the cat ", "sat ", "é", "✓ ", "\n", "zebra "]) for _ in range(64))
    text = text * (size // len(text.encode()) + 1)
    while len(data := json.dumps(
            {"model": model, "prompt": text} if path == "/tokenize" else
            {"model": model, "prompt": text, "max_tokens": 1} if path == "/v1/completions" else
            {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": text}]},
            ensure_ascii=False).encode()) > size:        # within the cap, escapes and all
        text = text[:len(text) * size // len(data) - 8]

    def act(url: str) -> tuple[str, str] | None:
        done, slowest = threading.Event(), [0.0]

        def poll() -> None:
            with httpx.Client() as health:
                while not done.is_set():
                    t = time.perf_counter()
                    with contextlib.suppress(httpx.HTTPError):
                        health.get(url + "/health", timeout=ANSWER_SECONDS)
                    slowest[0] = max(slowest[0], time.perf_counter() - t)
                    time.sleep(0.05)
        poller = threading.Thread(target=poll)
        poller.start()
        try:
            with socket.create_connection(_address(url), timeout=ANSWER_SECONDS) as sock:
                _send(sock, _request_bytes("POST", path, data))
                bad = _judge_raw(sock, ANSWER_SECONDS * 3, "POST", f"{path} of {len(data)} bytes")
        finally:
            done.set()
            poller.join()
        if bad is None and slowest[0] > STALL_SECONDS:
            bad = ("stall", f"/health took {slowest[0]:.2f} s while {path} tokenized {len(data)} bytes")
        return bad
    return Hostile("POST", path, desc=f"{path} with {len(data)} bytes of text", action=act)


KINDS: dict[str, tuple[Callable[[random.Random, str], Hostile], int]] = {
    "serve_body": (kind_body, 3), "serve_sampling": (kind_sampling, 4), "serve_chat": (kind_chat, 3),
    "serve_text": (kind_text, 2), "serve_route": (kind_route, 1), "serve_stream": (kind_stream, 2),
    "serve_nesting": (kind_nesting, 2), "serve_disconnect": (kind_disconnect, 2),
    "serve_slow": (kind_slow, 1), "serve_connections": (kind_connections, 1),
    "serve_huge_text": (kind_huge_text, 1),
    "serve_concurrent": (None, 2),   # several hostile requests of the other kinds at once
}


def hostile_requests(rng: random.Random, kind: str, model: str) -> list[Hostile]:
    """The case's hostile requests, sent at once: REQUESTS_PER_CASE of `kind`, or 2 to 4 of the
    other kinds."""
    if kind != "serve_concurrent":
        return [KINDS[kind][0](rng, model) for _ in range(REQUESTS_PER_CASE)]
    others = [k for k in KINDS if k != "serve_concurrent"]
    return [KINDS[rng.choice(others)][0](rng, model) for _ in range(rng.randint(2, 4))]


# ---- running a case -------------------------------------------------------------------------

def _is_openai_error(data: Any, status: int) -> bool:
    error = data.get("error") if isinstance(data, dict) else None
    return (isinstance(error, dict) and isinstance(error.get("message"), str) and error["message"]
            and isinstance(error.get("type"), str) and "param" in error and error.get("code") == status)


def _json(content: bytes) -> Any:
    try:
        return json.loads(content)
    except ValueError:
        return None


def judge(status: int, content_type: str, content: bytes, method: str) -> tuple[str, str] | None:
    """None when an answer is acceptable, else (class, signature)."""
    if status >= 500 and not (status == 503 and _is_openai_error(_json(content), status)):
        return "traceback", f"{status} {content[:80]!r}"
    if method == "HEAD":
        return None
    if status >= 400:
        try:
            data = json.loads(content)
        except ValueError:
            return "bad_output", f"{status} without a JSON body: {content[:60]!r}"
        return None if _is_openai_error(data, status) else ("bad_output", f"{status} body {content[:80]!r}")
    if content_type.startswith("text/event-stream"):
        for line in content.decode(errors="replace").splitlines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            try:
                event = json.loads(line[len("data: "):])
            except ValueError:
                return "bad_output", f"stream event not JSON: {line[:60]!r}"
            if isinstance(event, dict) and "error" in event:
                return "bad_output", f"error event in a stream: {str(event['error'])[:80]}"
        return None
    if content_type.startswith("application/json"):
        try:
            json.loads(content)
        except ValueError:
            return "bad_output", f"{status} JSON not parseable: {content[:60]!r}"
        return None
    if content_type.startswith("text/html"):          # /docs when asked for
        return None
    return "bad_output", f"{status} with content type {content_type!r}"


def send(http: httpx.Client, url: str, h: Hostile) -> httpx.Response:
    headers = dict(h.headers)
    if h.body or h.method == "POST":
        headers["content-type"] = h.content_type
    return http.request(h.method, url + h.path, content=h.body or None, headers=headers,
                        timeout=ANSWER_SECONDS)


# which one a case reports
PRIORITY = ("serve_harmed", "crash", "hang", "traceback", "row_kept", "stall", "bad_output")


def run_case(rng: random.Random, kind: str, url: str, model: str, expected: list[int],
             http: httpx.Client, exclusive: bool = True) -> dict:
    """Send the case's hostile requests through `http` (or run its hostile clients), each in its
    own thread, while good requests go one after another beside them; the outcome (see the
    module docstring). `exclusive`: the harness has the server to itself, so a row still busy
    after the case is a gone client's."""
    hostile = hostile_requests(rng, kind, model)
    failures: list[tuple[str, str, str]] = []
    lock = threading.Lock()
    done = threading.Event()

    def fail(cls: str, sig: str, h: Hostile | None) -> None:
        with lock:
            failures.append((cls, sig, h.desc if h else "the good request beside"))

    def attack(h: Hostile) -> None:
        if h.action is not None:
            try:
                bad = h.action(url)
            except OSError as e:
                bad = ("crash", f"{h.desc}: {type(e).__name__}: {e}")
            return fail(*bad, h) if bad else None
        try:
            r = send(http, url, h)
        except httpx.TimeoutException:
            return fail("hang", f"no answer in {ANSWER_SECONDS:.0f} s to {h.method} {h.path}", h)
        except httpx.HTTPError as e:
            return fail("crash", f"{h.method} {h.path}: {type(e).__name__}", h)
        bad = judge(r.status_code, r.headers.get("content-type", ""), r.content, h.method)
        if not bad and h.must_refuse and r.status_code < 400:
            bad = ("bad_output", f"{r.status_code} for a request OpenAI refuses: {h.must_refuse}")
        if bad:
            fail(bad[0], f"{h.method} {h.path}: {bad[1]}", h)

    def good() -> None:
        n = 0
        while n == 0 or not done.is_set():
            n += 1
            try:
                r = http.post(url + "/v1/completions", json=good_completion(model), timeout=ANSWER_SECONDS)
            except httpx.HTTPError as e:
                return fail("serve_harmed", f"good request: {type(e).__name__}", None)
            if r.status_code in (429, 503) and _is_openai_error(_json(r.content), r.status_code):
                continue           # the queue, or the connections or bodies at their bound
            ids = r.json().get("choices", [{}])[0].get("token_ids") if r.status_code == 200 else None
            if ids != expected:
                return fail("serve_harmed", f"good request: {r.status_code} {r.text[:120]}", None)
    beside = threading.Thread(target=good)
    beside.start()
    threads = [threading.Thread(target=attack, args=(h,)) for h in hostile]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    done.set()
    beside.join()
    after_case(url, http, exclusive, fail)
    if not failures:
        return {"cls": "ok"}
    failures.sort(key=lambda f: PRIORITY.index(f[0]))
    cls, sig, desc = failures[0]
    return {"cls": cls, "sig": sig, "detail": "; ".join(f"{s} <- {d}" for _, s, d in failures)[:1000]}


def after_case(url: str, http: httpx.Client, exclusive: bool, fail: Callable) -> None:
    """/health answers 200 (a 503 while the connections of the case are being counted out), and
    on a server the harness has to itself no row is busy ROW_SECONDS on."""
    deadline = time.monotonic() + ROW_SECONDS
    try:
        while (r := http.get(url + "/health", timeout=ANSWER_SECONDS)).status_code == 503 \
                and time.monotonic() < deadline:
            time.sleep(0.05)
        if r.status_code != 200:
            return fail("crash", f"/health answers {r.status_code}", None)
        while exclusive and (busy := http.get(url + "/stats", timeout=ANSWER_SECONDS).json()
                             .get("busy_rows", 0)):
            if time.monotonic() > deadline:
                return fail("row_kept", f"{busy} rows busy {ROW_SECONDS:.0f} s after the case's "
                                        "requests ended", None)
            time.sleep(0.05)
    except httpx.HTTPError as e:
        fail("crash", f"/health or /stats: {type(e).__name__}", None)


@contextlib.contextmanager
def stand_in_server() -> Iterator[str]:
    """mkc serve's API and engine over the tests' stand-in module (serve_fakes), with the
    letter tokenizer and the bounds of STAND_IN, in a thread of this process: its URL."""
    here = str(ROOT / "tests" / "serve")
    if here not in sys.path:
        sys.path.insert(0, here)
    from serve_fakes import LetterTokenizer, fake_server

    from mkc.serve.api import Limits
    limits = Limits(max_body_bytes=STAND_IN.body_cap, header_seconds=STAND_IN.header_seconds,
                    body_seconds=STAND_IN.body_seconds, max_connections=STAND_IN.max_connections)
    with fake_server(batch=2, queue=8, tokenizer=LetterTokenizer(), limits=limits) as url:
        yield url


class Server:
    """The server cases run against, and what its good request answers alone; `exclusive`: the
    harness has it to itself (not a server the campaign's workers share)."""

    def __init__(self, url: str, exclusive: bool = True):
        self.url, self.exclusive = url, exclusive
        # one client (a pool of connections) for every case: making one costs an SSL context
        self.http = httpx.Client(limits=httpx.Limits(max_connections=16))
        self.model = self.http.get(url + "/v1/models", timeout=ANSWER_SECONDS).json()["data"][0]["id"]
        r = self.http.post(url + "/v1/completions", json=good_completion(self.model),
                           timeout=ANSWER_SECONDS)
        r.raise_for_status()
        self.expected = r.json()["choices"][0]["token_ids"]

    def run(self, seed: int, index: int, kind: str) -> dict:
        return run_case(random.Random(f"mkc-fuzz-serve:{seed}:{index}"), kind, self.url, self.model,
                        self.expected, self.http, self.exclusive)


_SERVER: Server | None = None
_STACK = contextlib.ExitStack()


def server() -> Server:
    """This process's server for the campaign: MKC_FUZZ_SERVE_URL's, else a stand-in started
    once (and kept for the process's life)."""
    global _SERVER
    if _SERVER is None:
        url = os.environ.get("MKC_FUZZ_SERVE_URL")
        _SERVER = Server((url or _STACK.enter_context(stand_in_server())).rstrip("/"), not url)
    return _SERVER


def kind_of(rng: random.Random) -> str:
    kinds = list(KINDS)
    return rng.choices(kinds, weights=[KINDS[k][1] for k in kinds])[0]


def main() -> int:
    global BOUNDS, ANSWER_SECONDS
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cases", type=int, default=200)
    ap.add_argument("--url", help="a running mkc serve (default: the stand-in, in this process)")
    served = Bounds()
    for name, option in (("body_cap", "--max-body-bytes"), ("header_seconds", "--header-timeout"),
                         ("body_seconds", "--body-timeout"), ("max_connections", "--max-connections")):
        ap.add_argument(option, dest=name, type=type(getattr(served, name)),
                        help=f"with --url: the server's {option} (default {getattr(served, name)})")
    ap.add_argument("--answer-seconds", type=float, default=ANSWER_SECONDS,
                    help=f"how long a request may take (default {ANSWER_SECONDS:g}; more for a server "
                         "whose prompts take a step a token)")
    args = ap.parse_args()
    ANSWER_SECONDS = args.answer_seconds
    if args.url:
        BOUNDS = replace(served, **{k: v for k, v in vars(args).items()
                                    if hasattr(served, k) and v is not None})
    with contextlib.ExitStack() as stack:
        s = Server((args.url or stack.enter_context(stand_in_server())).rstrip("/"))
        bad = 0
        for i in range(args.cases):
            kind = kind_of(random.Random(f"mkc-fuzz-serve-kind:{args.seed}:{i}"))
            out = s.run(args.seed, i, kind)
            if out["cls"] != "ok":
                bad += 1
                print(f"case {i} ({kind}): {out['cls']}: {out['sig']}\n  {out['detail'][:400]}", flush=True)
        print(f"{args.cases} cases, {bad} failures")
    return 1 if bad else 0


# ---- the campaign's `serve` target -----------------------------------------------------------

def kinds() -> dict:
    """`KINDS`, as the campaign's kinds: the case's hostile requests are drawn in the worker."""
    def kind(name):
        def make(rng, b, case):
            case.desc = f"hostile HTTP requests of kind {name} (tests/fuzz/serve.py)"
            case.model = ""              # the server's model is the worker's, not the case's
            return b.spec
        return make
    return {name: (kind(name), weight) for name, (_, weight) in KINDS.items()}


def run(case, d: Path, res: dict) -> dict:
    """The case's hostile requests against this worker's server (`server()`: started
    at its first case), beside good requests; `Server.run`'s outcome."""
    res["stage"] = "serve"
    return server().run(case.seed, case.index, case.kind)
