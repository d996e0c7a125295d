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

Each endpoint reads its request through `mkc.serve.parsing.Reader` (every check in one place);
completions and chat are answered by `mkc.serve.responses.Responder`.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mkc.serve.engine import Engine
from mkc.serve.model import Served
from mkc.serve.parsing import (MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS, ApiError, ChatRequest,
                               CompletionRequest, DetokenizeRequest, Reader, TokenizeRequest,
                               check_nesting, error_body)
from mkc.serve.responses import Responder

__all__ = ["MAX_COMPLETION_LOGPROBS", "MAX_TOP_LOGPROBS", "ApiError", "BodyCap", "Limits",
           "create_app", "interrupted_by_sigterm", "listening_socket", "serve", "uvicorn_config"]


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


class BodyCap:
    """ASGI middleware: a request body past `limit` bytes is refused with a 413 (OpenAI's
    error body) before the app reads it, by its Content-Length or as it arrives; one nested
    past parsing.MAX_DEPTH with a 400 before it is parsed."""

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
        try:
            check_nesting(b"".join(chunks))
        except ApiError as e:
            return await _refuse(send, e.status, e.message, e.kind)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, replay, send)

    async def _refuse(self, send: Callable) -> None:
        await _refuse(send, 413, f"the request body passes the server's cap of {self.limit} bytes "
                                 "(mkc serve --max-body-bytes)", "invalid_request_error")


async def _refuse(send: Callable, status: int, message: str, kind: str) -> None:
    """Answer with OpenAI's error body, before the app has read the request, and close the
    connection (what is left of the request is not read)."""
    body = json.dumps(error_body(status, message, None, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body})


def create_app(served: Served, engine: Engine, limits: Limits = Limits()) -> FastAPI:
    """The API over `engine` serving `served`, under `limits`."""
    docs = {} if limits.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="mkc serve", description=f"{served.name} on a generated megakernel", **docs)
    app.add_middleware(BodyCap, limit=limits.max_body_bytes)
    max_prompt = min(limits.max_prompt_tokens or engine.context, engine.context)
    reader = Reader(served, engine.context, engine.vocab, max_prompt)
    _add_error_handlers(app)
    _add_info_endpoints(app, served, engine, reader)
    _add_generation_endpoints(app, reader, Responder(engine, served.name, reader))
    _add_token_endpoints(app, engine, reader)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    """Every refusal as OpenAI's error body: ours, FastAPI's own, and a body's validation."""
    @app.exception_handler(ApiError)
    async def api_error(_: HttpRequest, e: ApiError) -> JSONResponse:
        return JSONResponse(error_body(e.status, e.message, e.param, e.kind), status_code=e.status)

    @app.exception_handler(HTTPException)
    async def http_error(_: HttpRequest, e: HTTPException) -> JSONResponse:
        # FastAPI's own refusals (a body it cannot parse: not UTF-8; an unknown path or method)
        message = str(e.detail)
        if e.status_code == 400 and "parsing the body" in message:
            message = "the body could not be parsed: it must be UTF-8 JSON"
        return JSONResponse(error_body(e.status_code, message, None, "invalid_request_error"),
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
        return JSONResponse(error_body(400, "; ".join(problems), param or None, "invalid_request_error"),
                            status_code=400)


def _add_info_endpoints(app: FastAPI, served: Served, engine: Engine, reader: Reader) -> None:
    """/health, /stats, /v1/models and /tokenizer_info."""
    created = int(time.time())

    @app.api_route("/health", methods=["GET", "HEAD"])      # HEAD: load balancers' probes
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
        return reader.need_tokenizer("/tokenizer_info").info()


def _add_generation_endpoints(app: FastAPI, reader: Reader, responder: Responder) -> None:
    """/v1/completions and /v1/chat/completions."""
    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, http: HttpRequest):
        return await responder.respond(http, await reader.completion(body))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatRequest, http: HttpRequest):
        return await responder.respond(http, await reader.chat(body))


def _add_token_endpoints(app: FastAPI, engine: Engine, reader: Reader) -> None:
    """/tokenize and /detokenize."""
    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict:
        ids = await reader.tokenize(body)
        return {"tokens": ids, "count": len(ids), "max_model_len": engine.context}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict:
        tok = reader.detokenize(body)
        return {"prompt": await reader.off_loop(tok.decode, body.tokens)}


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
