"""The OpenAI-compatible HTTP API over an `Engine` (FastAPI; SSE streaming through Starlette's
StreamingResponse): /health, /v1/models, /v1/completions, /v1/chat/completions, /tokenize and
/detokenize.

Request and response bodies follow OpenAI's schema (and vLLM's extensions `top_k`,
`stop_token_ids`, `ignore_eos`); every choice also carries its `token_ids`, since a model
served without a tokenizer has no text to give. Errors are OpenAI's `{"error": {...}}` with a
message that says what to change: 400 for a bad request (a field of the wrong type, strictly
as OpenAI's API: no "1" or true where a number is asked; a number past the type it becomes; text
that is not Unicode), 404 for an unknown model, 429 when the queue is full; 408, 413 and 503 for
a body too slow or too large, or a server holding as many connections or bodies as it takes
(mkc.serve.limits).

Tokenizing, detokenizing and chat-template rendering run in a thread pool (large inputs one at a
time: `Reader.off_loop`), so a long prompt never holds up the event loop (or /health) while it is
encoded.

Each endpoint reads its request through `mkc.serve.parsing.Reader` (every check in one place);
completions and chat are answered by `mkc.serve.responses.Responder`.
"""
from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from mkc.serve.engine import Engine
from mkc.serve.model import Served
from mkc.serve.limits import BodyGuard, Limits, protocol
from mkc.serve.parsing import (MAX_COMPLETION_LOGPROBS, MAX_TOP_LOGPROBS, ApiError, ChatRequest,
                               CompletionRequest, DetokenizeRequest, Reader, TokenizeRequest,
                               error_body)
from mkc.serve.responses import Responder

__all__ = ["MAX_COMPLETION_LOGPROBS", "MAX_TOP_LOGPROBS", "ApiError", "BodyGuard", "Limits",
           "create_app", "interrupted_by_sigterm", "listening_socket", "serve", "uvicorn_config"]


def create_app(served: Served, engine: Engine, limits: Limits = Limits()) -> FastAPI:
    """The API over `engine` serving `served`, under `limits`."""
    docs = {} if limits.api_docs else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = FastAPI(title="mkc serve", description=f"{served.name} on a generated megakernel", **docs)
    app.add_middleware(BodyGuard, limits=limits)
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

    @app.get("/health")
    async def health() -> dict:
        if engine.failure is not None:
            raise ApiError(503, f"the server stopped serving: {engine.failure}", None, "server_error")
        return {}
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)   # probes' HEAD

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
        return {"prompt": await reader.off_loop(tok.decode, body.tokens, size=len(body.tokens))}


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


def uvicorn_config(served: Served, engine: Engine, host: str, port: int, limits: Limits = Limits(),
                   log_level: str = "info") -> Any:
    """The uvicorn.Config that serves the API on host:port under `limits`."""
    import uvicorn
    return uvicorn.Config(create_app(served, engine, limits), host=host, port=port,
                          log_level=log_level, http=protocol(limits))


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
