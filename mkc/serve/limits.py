"""What `mkc serve` bounds below its API, for each connection and across them (`Limits`, the
`mkc serve` request caps): a request's headers in time (`--header-timeout`: the connection is
closed), its body in time (`--body-timeout`: 408), in size (`--max-body-bytes`: 413) and in
nesting (400, mkc.serve.parsing.check_nesting), the bytes of the bodies being received at once
(`--max-buffered-bytes`: 503) and the connections open (`--max-connections`: 503). Each refusal
is OpenAI's error body, sent before the app reads the request, and closes the connection.

uvicorn bounds none of these as needed: its keep-alive timeout stops at a request's first byte,
it has no body timeout and no bound across bodies, and its `limit_concurrency` answers in plain
text. So the header timeout and the connection cap are in its h11 protocol (`protocol`), the
body's bounds in ASGI middleware (`BodyGuard`).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from typing import Any, Callable

from mkc.serve.parsing import ApiError, check_nesting, error_body

__all__ = ["BodyGuard", "Limits", "protocol", "refuse"]


@dataclass(frozen=True)
class Limits:
    """What one request, and all connections together, may ask of the server (`mkc serve`
    options): `max_body_bytes` a body (413 past it); `max_prompt_tokens` a prompt's tokens, and
    what /tokenize returns (400 past it; None: the model's context); `header_seconds` a
    client's time to send a request's headers (the connection is closed after it);
    `body_seconds` its time to send the body after them (408); `max_connections` the
    connections open at once (past it a request gets a 503); `max_buffered_bytes` the bytes of
    the bodies being received at once (the request passing it gets a 503; None: 16 bodies at
    `max_body_bytes`); `api_docs` serves /docs, /redoc and /openapi.json."""

    max_body_bytes: int = 4 << 20
    max_prompt_tokens: int | None = None
    header_seconds: float = 10.0
    api_docs: bool = False
    body_seconds: float = 60.0
    max_connections: int = 512
    max_buffered_bytes: int | None = None

    @property
    def buffered_bytes(self) -> int:
        return self.max_buffered_bytes or 16 * self.max_body_bytes


DRAIN_SECONDS = 2.0         # how long a refused body's rest is read before its connection closes


async def refuse(send: Callable, status: int, message: str, kind: str,
                 receive: Callable | None = None, drain: int = 0) -> None:
    """Answer with OpenAI's error body, before the app has read the request, and close the
    connection. With `receive`, the rest of the body the client is still sending (up to `drain`
    bytes, for DRAIN_SECONDS) is read and dropped first: a connection closed with bytes unread
    is reset, and a client still sending would lose the answer."""
    body = json.dumps(error_body(status, message, None, kind)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": body, "more_body": receive is not None})
    if receive is None:
        return
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(DRAIN_SECONDS):
            while drain > 0:
                message = await receive()
                if message["type"] != "http.request" or not message.get("more_body"):
                    break
                drain -= len(message.get("body", b""))
    await send({"type": "http.response.body", "body": b""})


class BodyGuard:
    """ASGI middleware: a request's body read whole before the app reads it, and refused (OpenAI's
    error body) when it passes `limits.max_body_bytes` (413, by its Content-Length or as it
    arrives), has not all arrived `limits.body_seconds` after the headers (408), would take the
    bytes of the bodies being received past `limits.buffered_bytes` (503: a Content-Length is
    held from the start), or nests past parsing.MAX_DEPTH (400)."""

    def __init__(self, app: Any, limits: Limits):
        self.app, self.limits = app, limits
        self.held = 0               # bytes of the bodies being received, every connection's

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ended = [False]                     # whether the body's last part has come
        try:
            body = await self._body(scope, receive, ended)
        except ApiError as e:
            rest = receive if e.status in (413, 503) and not ended[0] else None
            return await refuse(send, e.status, e.message, e.kind, rest, 2 * self.limits.max_body_bytes)
        if body is None:                    # the client went away
            return
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        await self.app(scope, replay, send)

    async def _body(self, scope: dict, receive: Callable, ended: list[bool]) -> bytes | None:
        """The request's whole body (None: the client went away first), its bytes counted in
        `held` while it arrives; ApiError for a refusal (`ended[0]`: after the body's end)."""
        limits = self.limits
        length = dict(scope.get("headers") or ()).get(b"content-length", b"")
        declared = 0 if not length.isdigit() else int(length) if len(length) < 20 else 1 << 64
        if declared > limits.max_body_bytes:
            raise self._too_large()
        if self.held + declared > limits.buffered_bytes:
            raise self._busy()
        chunks, size, counted = [], 0, declared
        self.held += counted
        try:
            async with asyncio.timeout(limits.body_seconds):
                while True:
                    message = await receive()
                    if message["type"] != "http.request":
                        return None
                    chunks.append(message.get("body", b""))
                    size += len(chunks[-1])
                    ended[0] = not message.get("more_body")
                    if size > limits.max_body_bytes:
                        raise self._too_large()
                    if size > counted:          # past its Content-Length, or without one
                        self.held += size - counted
                        counted = size
                        if self.held > limits.buffered_bytes:
                            raise self._busy()
                    if ended[0]:
                        break
        except TimeoutError:
            raise ApiError(408, f"the request body did not arrive within {limits.body_seconds:g} s "
                                "of its headers (mkc serve --body-timeout)") from None
        finally:
            self.held -= counted
        body = b"".join(chunks)
        check_nesting(body)
        return body

    def _too_large(self) -> ApiError:
        return ApiError(413, f"the request body passes the server's cap of "
                             f"{self.limits.max_body_bytes} bytes (mkc serve --max-body-bytes)")

    def _busy(self) -> ApiError:
        return ApiError(503, f"the server is receiving as many request bodies as it holds at once "
                             f"({self.limits.buffered_bytes} bytes, mkc serve --max-buffered-bytes); "
                             "retry later", None, "server_error")


def protocol(limits: Limits) -> type:
    """uvicorn's h11 protocol, closing a connection whose client has not sent a whole request's
    headers `limits.header_seconds` after it connected or after the last response (uvicorn's own
    keep-alive timeout stops at the first byte, so a client trickling a header a byte at a time
    would hold its connection forever), and answering every request on a connection past
    `limits.max_connections` open with a 503 that closes it."""
    from uvicorn.protocols.http.h11_impl import H11Protocol
    seconds, most = limits.header_seconds, limits.max_connections

    async def over_capacity(scope: dict, receive: Callable, send: Callable) -> None:
        await refuse(send, 503, f"the server has as many connections open as it takes ({most}, "
                                "mkc serve --max-connections); retry later", "server_error")

    class Guarded(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _await_headers(self) -> None:
            if self._header_timer is None:
                self._header_timer = self.loop.call_later(seconds, self._headers_late)

        def _headers_late(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)      # counted in self.connections, the server's
            if len(self.connections) > most:
                self.app = over_capacity
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
    return Guarded
