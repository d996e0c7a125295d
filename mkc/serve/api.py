"""The OpenAI-compatible HTTP API over an `Engine` (FastAPI; SSE streaming through Starlette's
StreamingResponse): /health, /v1/models, /v1/completions, /v1/chat/completions, /tokenize and
/detokenize.

Request and response bodies follow OpenAI's schema (and vLLM's extensions `top_k`,
`stop_token_ids`, `ignore_eos`); every choice also carries its `token_ids`, since a model
served without a tokenizer has no text to give. Errors are OpenAI's `{"error": {...}}` with a
message that says what to change: 400 for a bad request (a field of the wrong type, strictly
as OpenAI's API: no "1" or true where a number is asked; a number past the type it becomes; text
that is not Unicode), 404 for an unknown model, 413 for a body past the cap, 429 when the queue is
full.

Tokenizing, detokenizing and chat-template rendering run in a thread pool, so a long prompt never
holds up the event loop (or /health) while it is encoded.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import secrets
import signal
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, TypeVar

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from mkc.serve.engine import Engine, Event, QueueFull, Request, Stopped, Unfit
from mkc.serve.model import Served, TokenizerError
from mkc.serve.sampling import SamplingParams
from mkc.serve.stops import StopText

DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default max_tokens for /v1/completions
MAX_COMPLETION_LOGPROBS = 5         # OpenAI's bounds: the legacy `logprobs`, chat's `top_logprobs`
MAX_TOP_LOGPROBS = 20
DISCONNECT_POLL_SECONDS = 1.0       # how often a non-streaming request checks its client
INT32_MAX = 2**31 - 1               # top_k is packed as int32 for the on-device sampler
INT64 = (-2**63, 2**63 - 1)         # OpenAI's seed


@dataclass(frozen=True)
class Limits:
    """What one request may ask of the server (`mkc serve` options): `max_body_bytes` a body
    (413 past it); `max_prompt_tokens` a prompt's tokens, and what /tokenize returns (400 past
    it; None: the model's context); `header_seconds` a client's time to send a request's
    headers (the connection is closed after it); `api_docs` serves /docs, /redoc and
    /openapi.json."""

    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    header_seconds: float = 10.0
    api_docs: bool = False


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def _error_body(status: int, message: str, param: str | None, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


class _Body(BaseModel):
    # NaN and infinities are not numbers a request may carry (JSON has none; Python's parser
    # accepts them); strict: a number is a JSON number, a boolean a JSON boolean, as OpenAI's
    # API takes them
    model_config = ConfigDict(allow_inf_nan=False, extra="ignore", strict=True)


# Request fields this server does not act on, each with the values that ask for nothing: any
# other value is refused, since ignoring it would hand the client something else than it asked.
_NOT_SERVED = {
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}),
    "logit_bias": (None, {}), "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "repetition_penalty": (None, 1), "best_of": (None, 1), "suffix": (None, ""),
    "min_tokens": (None, 0)}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


def check_served_fields(extra: dict[str, Any]) -> None:
    """Refuse (ApiError 400) a request field of `_NOT_SERVED` set to anything but a no-op."""
    for name, no_op in _NOT_SERVED.items():
        if name in extra and extra[name] not in no_op:
            raise ApiError(400, f"{name} is not served: mkc serve generates plain text (greedy or "
                                "sampled with temperature, top_p, top_k); drop it", name)


def stop_strings(body: "_Sampling") -> list[str]:
    """The request's stop strings (`stop`: one or a list); an empty one, which would match
    before the first token, is refused (ApiError 400)."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if "" in stops:
        raise ApiError(400, "an empty stop string would end every completion before its first "
                            "token: drop it", "stop")
    return stops


def check_messages(messages: list[Any]) -> None:
    """Refuse (ApiError 400) a message that is not an object with a chat role, a name that is
    not a string, or content other than a string, null or text parts, each an object of type
    "text" whose text is a string (an image or audio part would be dropped unseen)."""
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}] needs a role, one of {', '.join(CHAT_ROLES)}",
                           "messages")
        if "name" in m and not isinstance(m["name"], str):
            raise ApiError(400, f"messages[{i}].name must be a string", "messages")
        content = m.get("content")
        if isinstance(content, list):
            for j, part in enumerate(content):
                where = f"messages[{i}].content[{j}]"
                if not isinstance(part, dict):
                    raise ApiError(400, f"{where} must be an object: a text part, "
                                        '{"type": "text", "text": "..."}', "messages")
                kind = part.get("type")
                if not isinstance(kind, str):
                    raise ApiError(400, f"{where}.type must be a string (\"text\")", "messages")
                if kind != "text":
                    raise ApiError(400, f"{where} is a part of type {kind[:40]!r}: the model takes "
                                        "text parts only", "messages")
                if not isinstance(part.get("text"), str):
                    raise ApiError(400, f"{where}.text must be a string", "messages")
        elif content is not None and not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string or a list of text parts",
                           "messages")


def check_unicode(value: Any, path: str) -> None:
    """Refuse (ApiError 400, naming the field) a string anywhere in `value` (keys too) that is
    not Unicode text: a lone surrogate ("\\ud800"), which JSON can spell but UTF-8 cannot."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ApiError(400, f"{path} holds a lone surrogate ({value[e.start]!r} at character "
                                f"{e.start}): text must be valid Unicode", path.split("[")[0].split(".")[0]
                           ) from None
    elif isinstance(value, list):
        for i, v in enumerate(value):
            check_unicode(v, f"{path}[{i}]")
    elif isinstance(value, dict):
        for k, v in value.items():
            check_unicode(k, path)
            check_unicode(v, f"{path}.{k}" if path else k)


Text = StrictStr
TokenIds = list[StrictInt]


class StreamOptions(_Body):
    include_usage: StrictBool = False


class _Sampling(_Body):
    model_config = ConfigDict(allow_inf_nan=False, extra="allow", strict=True)   # see check_served_fields
    model: Text
    temperature: StrictFloat | None = Field(None, ge=0, le=2)
    top_p: StrictFloat | None = Field(None, gt=0, le=1)
    top_k: StrictInt | None = Field(None, ge=-1, le=INT32_MAX)   # -1 or 0: every token (vLLM's)
    seed: StrictInt | None = Field(None, ge=INT64[0], le=INT64[1])
    stop: Text | list[Text] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1)


class CompletionRequest(_Sampling):
    # a string, token ids, or a list of either; read by `prompt_ids`, whose refusals say which
    # (a union's validation errors would list every alternative's)
    prompt: Any = Field(...)
    max_tokens: StrictInt | None = Field(DEFAULT_COMPLETION_TOKENS, ge=0)    # 0: with echo only
    echo: StrictBool = False
    logprobs: StrictInt | None = Field(None, ge=0, le=MAX_COMPLETION_LOGPROBS)


class ChatRequest(_Sampling):
    messages: list[dict[str, Any]]
    max_tokens: StrictInt | None = Field(None, ge=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)


class TokenizeRequest(_Body):
    model: Text | None = None
    prompt: Text | None = None
    messages: list[dict[str, Any]] | None = None


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: TokenIds


class _Logprobs:
    """The logprobs of a request's tokens as they arrive (each with its offset in the text),
    in the completions API's legacy form or chat's. A token is named by its text, or
    `token_id:N` without a tokenizer (vLLM's form). With `echo`, the prompt's tokens come
    first (`add_prompt`), the first with no logprob (null), each at the offset the names
    before it take, as vLLM places them."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.entries: list[tuple[int, int, float | None, tuple[tuple[int, float], ...] | None]] = []

    def add(self, event: Event, offset: int) -> None:
        if event.logprob is not None:
            self.entries.append((event.token, offset, event.logprob, event.top or ()))

    def add_prompt(self, token: int, event: Event | None) -> None:
        """A prompt token: the first (no event: nothing precedes it), or a later one's event."""
        offset = 0
        if self.entries:
            last = self.entries[-1]
            offset = last[1] + len(self.name(last[0]))
        self.entries.append((token, offset, None if event is None else event.logprob,
                             None if event is None else event.top or ()))

    def name(self, token: int) -> str:
        return self.tokenizer.decode([token]) if self.tokenizer is not None else f"token_id:{token}"

    def completion(self, start: int = 0) -> dict:
        """The legacy object for the entries from `start`: each top_logprobs dict holds the
        most likely tokens and, as OpenAI's does, the chosen one."""
        out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token, offset, logprob, top in self.entries[start:]:
            tops = None
            if logprob is not None:
                tops = {self.name(t): _finite(lp) for t, lp in top}
                tops.setdefault(self.name(token), _finite(logprob))
            out["tokens"].append(self.name(token))
            out["token_logprobs"].append(None if logprob is None else _finite(logprob))
            out["top_logprobs"].append(tops)
            out["text_offset"].append(offset)
        return out

    def chat(self, start: int = 0) -> dict:
        def entry(token: int, logprob: float) -> dict:
            name = self.name(token)
            return {"token": name, "logprob": _finite(logprob), "bytes": list(name.encode())}
        return {"content": [{**entry(token, logprob), "top_logprobs": [entry(t, lp) for t, lp in top]}
                            for token, _, logprob, top in self.entries[start:]]}


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else -9999.0     # JSON has no -inf (vLLM's stand-in)


class BodyCap:
    """ASGI middleware: a request body past `limit` bytes is refused with a 413 (OpenAI's
    error body) before the app reads it, by its Content-Length or as it arrives."""

    def __init__(self, app: Any, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.limit:
            return await self._refuse(send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":        # the client went away
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send)
            if not message.get("more_body"):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable) -> None:
        body = json.dumps(_error_body(413, f"the request body passes the server's cap of "
                                           f"{self.limit} bytes (mkc serve --max-body-bytes)",
                                      None, "invalid_request_error")).encode()
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})


_T = TypeVar("_T")


def create_app(served: Served, engine: Engine, limits: Limits = Limits()) -> FastAPI:
    docs = {} if limits.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="mkc serve", description=f"{served.name} on a generated megakernel", **docs)
    app.add_middleware(BodyCap, limit=limits.max_body_bytes)
    tokenizer = served.tokenizer
    created = int(time.time())
    max_prompt = min(limits.max_prompt_tokens or engine.context, engine.context)

    async def off_loop(fn: Callable[..., _T], *args: Any) -> _T:
        """`fn(*args)` in the thread pool when it runs the tokenizer (CPU work that would hold up
        every other request and /health); at once without one (nothing to do)."""
        if tokenizer is None:
            return fn(*args)
        return await run_in_threadpool(fn, *args)

    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
        return JSONResponse(_error_body(e.status, e.message, e.param, e.kind), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, e: HTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse: not UTF-8; an unknown path or method)
        message = str(e.detail)
        if e.status_code == 400 and "parsing the body" in message:
            message = "the body could not be parsed: it must be UTF-8 JSON"
        return JSONResponse(_error_body(e.status_code, message, None, "invalid_request_error"),
                            status_code=e.status_code)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: HttpRequest, e: RequestValidationError) -> JSONResponse:
        problems: list[str] = []
        for err in e.errors():
            where = _field_path(err.get("loc", ()))
            if err.get("type") == "json_invalid":
                problem = f"the body is not valid JSON ({err.get('ctx', {}).get('error', err['msg'])})"
            else:
                problem = f"{where}: {err['msg']}" if where else err["msg"]
            if problem not in problems:
                problems.append(problem)
        first = e.errors()[0] if e.errors() else {}
        param = None if first.get("type") == "json_invalid" else _field_path(first.get("loc", ()))
        return JSONResponse(_error_body(400, "; ".join(problems), param or None, "invalid_request_error"),
                            status_code=400)

    def check_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{served.name}' (GET /v1/models)", "model", "not_found_error")

    def need_tokenizer(what: str):
        if tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer, and '{served.name}' has none (serve a "
                                "checkpoint directory with tokenizer.json and the `tokenizers` or "
                                "`transformers` package, or a model without one with `mkc serve "
                                "--tokenizer bytes`, a stand-in whose text means nothing); pass "
                                "the prompt as token ids instead")
        return tokenizer

    async def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
        """The conversation's prompt through the chat template; a template's refusal is a 400."""
        if tokenizer is None or tokenizer.chat is None:
            raise ApiError(400, f"'{served.name}' has no chat template: chat needs a checkpoint "
                                "directory with a tokenizer and a chat template (tokenizer_config.json's "
                                "chat_template, or chat_template.jinja), or a model without a tokenizer "
                                "served with `mkc serve --tokenizer bytes`; use /v1/completions",
                           "messages")
        if not messages:
            raise ApiError(400, "messages is empty: give at least one message", "messages")
        check_messages(messages)

        def render() -> list[int]:
            try:
                return tokenizer.chat(messages)
            except TokenizerError as e:
                raise ApiError(400, str(e), "messages") from None
        return await off_loop(render)

    def check_ids(ids: list[int], param: str) -> list[int]:
        """`ids` if they make a prompt this server takes (not empty, within --max-prompt-tokens
        and the vocabulary), else the ApiError that says why."""
        if not ids:
            raise ApiError(400, "the prompt is empty: give at least one token", param)
        if len(ids) > max_prompt:
            cap = ("the model's context" if max_prompt == engine.context
                   else "this server's cap (mkc serve --max-prompt-tokens)")
            raise ApiError(400, f"the prompt has {len(ids)} tokens, more than {cap} of {max_prompt} "
                                f"(the model's context is {engine.context})", param)
        bad = [t for t in ids if not 0 <= t < engine.vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary (0 to "
                                f"{engine.vocab - 1})", param)
        return ids

    def is_ids(value: Any) -> bool:
        return isinstance(value, list) and all(type(t) is int for t in value)

    async def prompt_ids(prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or is_ids(p) for p in prompt):
            raise ApiError(400, f"{len(prompt)} prompts in one request; send one prompt per "
                                "request (they are batched on the server)", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "the prompt is empty: give at least one token", "prompt")
            tok = need_tokenizer("a text prompt")
            return await off_loop(lambda: check_ids(tok.encode(prompt), "prompt"))
        if not is_ids(prompt):
            raise ApiError(400, "prompt must be a string or a list of token ids (integers)", "prompt")
        return await off_loop(check_ids, prompt, "prompt")

    def sampling_of(body: _Sampling, prompt: list[int], max_tokens: int | None,
                    logprobs: int | None, echo: bool = False) -> tuple[SamplingParams, list[str]]:
        """The request's sampling and its stop strings, or the ApiError of what does not fit."""
        if body.n != 1:
            raise ApiError(400, f"n = {body.n}: one choice per request is served (send n "
                                "requests)", "n")
        room = engine.context - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the model's context is "
                                f"{engine.context}, and at least one must be left to generate",
                           "prompt")
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise ApiError(400, f"max_tokens = {max_tokens} with a prompt of {len(prompt)} "
                                f"tokens passes the context of {engine.context}: at most {room}",
                           "max_tokens")
        stops = stop_strings(body)
        if stops:
            need_tokenizer("a stop string")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options applies to a streamed response: add \"stream\": "
                                "true or drop it", "stream_options")
        stop_ids = set(body.stop_token_ids or [])
        if not body.ignore_eos:
            stop_ids |= served.eos_token_ids
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        return SamplingParams(max_tokens=max_tokens,
                              temperature=1.0 if body.temperature is None else body.temperature,
                              top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                              seed=seed % (1 << 31), stop_token_ids=frozenset(stop_ids),
                              logprobs=logprobs, prompt_logprobs=echo and logprobs is not None), stops

    def submit(prompt: list[int], sampling: SamplingParams) -> Request:
        req = Request(prompt=prompt, sampling=sampling, loop=asyncio.get_running_loop())
        try:
            engine.submit(req)
        except Unfit as e:
            raise ApiError(400, str(e), e.field)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", None, "rate_limit_error")
        except Stopped as e:
            raise ApiError(503, f"the server stopped serving: {e}", None, "server_error")
        return req

    async def events(req: Request, http: HttpRequest) -> AsyncIterator[Event]:
        """The request's events until its end; the request is cancelled if the consumer stops
        early (a streaming client went away) or a waiting client disconnects."""
        try:
            while True:
                try:
                    event = await asyncio.wait_for(req.events.get(), DISCONNECT_POLL_SECONDS)
                except asyncio.TimeoutError:
                    if await http.is_disconnected():
                        return
                    continue
                yield event
                if event.finish_reason is not None:
                    return
        finally:
            if not req.finished:
                engine.cancel(req)

    def usage(req: Request, completion: int) -> dict:
        out = {"prompt_tokens": len(req.prompt), "completion_tokens": completion,
               "total_tokens": len(req.prompt) + completion}
        if engine.drafter is not None:
            spec = req.speculation
            out["speculative"] = {"drafted": spec.drafted, "accepted": spec.accepted,
                                  "launches": spec.launches}
        return out

    def error_of(event: Event) -> ApiError:
        return ApiError(500, event.error or "generation failed", None, "server_error")

    async def generate(http: HttpRequest, body: _Sampling, prompt: list[int], max_tokens: int | None,
                       logprobs: int | None, chat: bool, echo: str | None = None):
        """The response to a completion or chat request; `echo`: the prompt's text, which the
        completion's text follows (and its tokens' logprobs the completion's, with logprobs)."""
        sampling, stops = sampling_of(body, prompt, max_tokens, logprobs, echo is not None)
        req = submit(prompt, sampling)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        obj = "chat.completion" if chat else "text_completion"
        head = {"id": rid, "created": int(time.time()), "model": served.name}

        def logprobs_of(lp: _Logprobs, start: int) -> dict | None:
            if logprobs is None or start >= len(lp.entries):
                return None
            return lp.chat(start) if chat else lp.completion(start)

        def next_text(text: StopText, lp: _Logprobs, event: Event) -> tuple[str, dict | None]:
            """A streamed token's text to send and its logprobs entry."""
            lp.add(event, len(text.text))
            return text.add(event.token), logprobs_of(lp, len(lp.entries) - 1)

        def choice(text: str, ids: list[int], finish: str | None, lp: dict | None,
                   first: bool = False) -> dict:
            if not chat:
                return {"index": 0, "text": text, "token_ids": ids, "logprobs": lp,
                        "finish_reason": finish}
            delta = ({"role": "assistant", "content": text} if first else {"content": text})
            return {"index": 0, "delta": delta, "token_ids": ids, "logprobs": lp,
                    "finish_reason": finish}

        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)

            async def sse() -> AsyncIterator[str]:
                text, lp = StopText(tokenizer, stops), _Logprobs(tokenizer)
                first, finish = True, None
                async for event in events(req, http):
                    if event.error is not None:
                        err = error_of(event)
                        yield f"data: {json.dumps(_error_body(500, err.message, None, err.kind))}\n\n"
                        break
                    if event.token is not None:
                        delta, lps = await off_loop(next_text, text, lp, event)
                        chunk = {**head, "object": obj + (".chunk" if chat else ""),
                                 "choices": [choice(delta, [event.token], None, lps, first)]}
                        first = False
                        yield f"data: {json.dumps(chunk)}\n\n"
                        if text.stopped:
                            finish = "stop"
                            break
                    else:
                        finish = event.finish_reason
                if finish is not None:
                    chunk = {**head, "object": obj + (".chunk" if chat else ""),
                             "choices": [choice(text.flush(), [], finish, None, first)]}
                    yield f"data: {json.dumps(chunk)}\n\n"
                    if include_usage:
                        tail = {**head, "object": obj, "choices": [], "usage": usage(req, len(text.ids))}
                        yield f"data: {json.dumps(tail)}\n\n"
                yield "data: [DONE]\n\n"
            return StreamingResponse(sse(), media_type="text/event-stream")

        text, lp = StopText(tokenizer, stops), _Logprobs(tokenizer)
        start = len(echo or "")          # where the completion's text begins
        if sampling.prompt_logprobs:
            lp.add_prompt(prompt[0], None)
        finish = None
        async for event in events(req, http):
            if event.error is not None:
                raise error_of(event)
            if event.prompt:
                lp.add_prompt(event.token, event)
            elif event.token is not None:
                lp.add(event, start + len(text.text))
                await off_loop(text.add, event.token)
                if text.stopped:
                    finish = "stop"
                    break
            else:
                finish = event.finish_reason
        content = (echo or "") + text.text          # the whole text (cut before a stop string)
        lps = await off_loop(logprobs_of, lp, 0)
        if chat:
            out = {"index": 0, "message": {"role": "assistant", "content": content},
                   "token_ids": text.ids, "logprobs": lps, "finish_reason": finish}
        else:
            out = {"index": 0, "text": content, "token_ids": text.ids, "logprobs": lps,
                   "finish_reason": finish}
        return {**head, "object": obj, "choices": [out], "usage": usage(req, len(text.ids))}

    @app.get("/health")
    async def health() -> dict:
        if engine.failure is not None:
            raise ApiError(503, f"the server stopped serving: {engine.failure}", None, "server_error")
        return {}

    @app.get("/stats")
    async def stats() -> dict:
        s = engine.stats
        return {"backend": engine.backend,
                "interpret": served.interpret is not None and engine.backend == "kernel",
                "batch": engine.batch,
                "processes": getattr(engine.lockstep, "processes", 1),
                "busy_rows": engine.busy_rows(), "steps": s.steps,
                "step_seconds": s.step_seconds, "busy_row_steps": s.busy_row_steps,
                "requests_done": s.requests_done, "prefill": engine.prefill,
                "prefill_launches": s.prefill_launches, "prefill_seconds": s.prefill_seconds,
                "speculative": engine.drafter is not None, "verify_launches": s.verify_launches,
                "verify_seconds": s.verify_seconds, "drafted": s.drafted, "accepted": s.accepted}

    @app.get("/v1/models")
    async def models() -> dict:
        # `root`: what the model was loaded from (vLLM's; `vllm bench serve` reads it)
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": created,
                                            "owned_by": "mkc", "root": served.name, "parent": None,
                                            "max_model_len": engine.context}]}

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> dict:
        return need_tokenizer("/tokenizer_info").info()

    def checked(body: _Body) -> None:
        """What every endpoint refuses first: text that is not Unicode, another model."""
        check_unicode(body.model_dump(exclude_unset=True) | (body.model_extra or {}), "")
        check_model(body.model)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        checked(body)
        check_served_fields(body.model_extra or {})
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens = 0 generates nothing: it is for echo: true (the "
                                "prompt, with its tokens' logprobs when logprobs is given)",
                           "max_tokens")
        if body.echo and body.stream:
            raise ApiError(400, "echo is served without stream: drop one of them", "echo")
        prompt = await prompt_ids(body.prompt)
        echo = None
        if body.echo:             # the prompt's text as sent, or its tokens' (vLLM's)
            text = body.prompt[0] if isinstance(body.prompt, list) and len(body.prompt) == 1 \
                else body.prompt
            echo = text if isinstance(text, str) else (
                await off_loop(tokenizer.decode, prompt) if tokenizer is not None else "")
        return await generate(http, body, prompt, body.max_tokens, body.logprobs, chat=False,
                              echo=echo)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        checked(body)
        check_served_fields(body.model_extra or {})
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        prompt = await off_loop(check_ids, await chat_ids(body.messages), "messages")
        return await generate(http, body, prompt, body.max_completion_tokens or body.max_tokens,
                              (body.top_logprobs or 0) if body.logprobs else None, chat=True)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        checked(body)
        tok = need_tokenizer("/tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt (text) or messages (chat)")
        if body.messages is not None:
            ids, param = await chat_ids(body.messages), "messages"
        else:
            ids, param = await off_loop(tok.encode, body.prompt), "prompt"
        if len(ids) > max_prompt:         # what a prompt may hold is all /tokenize counts
            raise ApiError(400, f"the text has {len(ids)} tokens, more than the {max_prompt} a "
                                "prompt may hold here (mkc serve --max-prompt-tokens; the "
                                f"model's context is {engine.context})", param)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        checked(body)
        tok = need_tokenizer("/detokenize")
        bad = [t for t in body.tokens if not 0 <= t < engine.vocab]
        if bad:
            raise ApiError(400, f"token ids {bad[:5]} are outside the vocabulary (0 to "
                                f"{engine.vocab - 1})", "tokens")
        return {"prompt": await off_loop(tok.decode, body.tokens)}

    return app


def _field_path(loc: tuple) -> str:
    """A validation error's field, as a client names it: `messages.0.content` (without
    "body", and without the alternatives of a union pydantic tries: `str`, `list[int]`)."""
    return ".".join(str(p) for p in loc[1:] if isinstance(p, int) or "[" not in p
                    and p not in ("str", "int", "float", "bool", "list", "dict", "none"))


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host``:``port`` (port 0: a free one), bound before the model loads
    so that an address in use or unknown is said at once, not after minutes of compiling.
    Raises OSError."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                         flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError:
        sock.close()
        raise
    return sock


def _header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose client has not sent a whole request's
    headers `seconds` after it connected or after the last response (uvicorn's own keep-alive
    timeout stops at the first byte, so a client trickling a header a byte at a time would hold
    its connection forever)."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeout(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _await_headers(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_headers()

        def handle_events(self) -> None:
            scope = self.scope
            super().handle_events()
            if self.scope is not scope and self._header_timer is not None:   # a request began
                self._header_timer.cancel()
                self._header_timer = None

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._await_headers()

        def connection_lost(self, exc: Exception | None) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None
            super().connection_lost(exc)
    return HeaderTimeout


def uvicorn_config(served: Served, engine: Engine, host: str, port: int, limits: Limits = Limits(),
                   log_level: str = "info") -> Any:
    """The uvicorn.Config that serves the API on host:port under `limits`."""
    import uvicorn
    return uvicorn.Config(create_app(served, engine, limits), host=host, port=port,
                          log_level=log_level, http=_header_timeout_protocol(limits.header_seconds))


def serve(served: Served, engine: Engine, sock: socket.socket, log_level: str = "info",
          limits: Limits = Limits()) -> None:
    """Run the API with uvicorn on the bound ``sock`` until interrupted (SIGINT, SIGTERM) or the
    engine stops serving (`engine.failure`), the engine's thread beside it."""
    import uvicorn
    host, port = sock.getsockname()[:2]
    server = uvicorn.Server(uvicorn_config(served, engine, host, port, limits, log_level))
    engine.on_failure = lambda message: setattr(server, "should_exit", True)
    engine.start()
    try:
        with interrupted_by_sigterm():
            server.run(sockets=[sock])
    except KeyboardInterrupt:       # uvicorn re-raises the SIGINT or SIGTERM it shut down on
        pass
    finally:
        engine.stop()               # with other processes: they stop too


@contextlib.contextmanager
def interrupted_by_sigterm():
    """SIGTERM raises KeyboardInterrupt, as SIGINT does, so that a stop by a process manager
    runs the same clean-up (the engine's thread, then any other processes) as Ctrl-C."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt
    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
