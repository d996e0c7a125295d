"""The HTTP API's answers to a generation (`parsing.Generation`): its request submitted to the
engine, its events read until its end (the request cancelled when the client goes away), and
the response in the completions or chat schema, whole or streamed as server-sent events, with
its logprobs and usage. A stop string ends the response (`stops.StopText`), and the request is
cancelled then.
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import Request as HttpRequest
from fastapi.responses import StreamingResponse

from mkc.serve.engine import Engine, Event, QueueFull, Request, Stopped, Unfit
from mkc.serve.parsing import ApiError, Generation, Reader, error_body
from mkc.serve.stops import StopText

class Logprobs:
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


class Responder:
    """Answers generations on `engine` for the model `name`, the tokenizer's work through
    `reader.off_loop`."""

    def __init__(self, engine: Engine, name: str, reader: Reader):
        self.engine, self.name, self.reader = engine, name, reader
        self.tokenizer = reader.tokenizer

    async def respond(self, http: HttpRequest, g: Generation) -> Any:
        """The response to a completion or chat request."""
        req = self.submit(g)
        rid = ("chatcmpl-" if g.chat else "cmpl-") + uuid.uuid4().hex
        head = {"id": rid, "created": int(time.time()), "model": self.name}
        if g.stream:
            return StreamingResponse(self._sse(http, g, req, head), media_type="text/event-stream")
        return await self._whole(http, g, req, head)

    def submit(self, g: Generation) -> Request:
        req = Request(prompt=g.prompt, sampling=g.sampling, loop=asyncio.get_running_loop())
        try:
            self.engine.submit(req)
        except Unfit as e:
            raise ApiError(400, str(e), e.field)
        except QueueFull as e:
            raise ApiError(429, f"the server is busy: {e}; retry later", None, "rate_limit_error")
        except Stopped as e:
            raise ApiError(503, f"the server stopped serving: {e}", None, "server_error")
        return req

    async def events(self, req: Request, http: HttpRequest) -> AsyncIterator[Event]:
        """The request's events until its end; the request is cancelled (its row freed before
        the next step) as soon as its client disconnects, streaming or not, or the consumer
        stops early (a stop string)."""
        gone = asyncio.ensure_future(_disconnect(http))
        event: asyncio.Future | None = None
        try:
            while True:
                event = asyncio.ensure_future(req.events.get())
                await asyncio.wait((event, gone), return_when=asyncio.FIRST_COMPLETED)
                if not event.done():
                    return
                yield event.result()
                if event.result().finish_reason is not None:
                    return
        finally:
            gone.cancel()
            if event is not None:       # also when the consumer was cancelled while it waited
                event.cancel()
            if not req.finished:
                self.engine.cancel(req)

    def usage(self, req: Request, completion: int) -> dict:
        out = {"prompt_tokens": len(req.prompt), "completion_tokens": completion,
               "total_tokens": len(req.prompt) + completion}
        if self.engine.drafter is not None:
            spec = req.speculation
            out["speculative"] = {"drafted": spec.drafted, "accepted": spec.accepted,
                                  "launches": spec.launches}
        return out

    async def _sse(self, http: HttpRequest, g: Generation, req: Request,
                   head: dict) -> AsyncIterator[str]:
        text, lp = StopText(self.tokenizer, g.stops), Logprobs(self.tokenizer)
        obj = "chat.completion" if g.chat else "text_completion"
        chunk_of = obj + (".chunk" if g.chat else "")
        first, finish = True, None
        async for event in self.events(req, http):
            if event.error is not None:
                err = _error_of(event)
                yield f"data: {json.dumps(error_body(500, err.message, None, err.kind))}\n\n"
                break
            if event.token is not None:
                delta, lps = await self.reader.off_loop(_next_text, g, text, lp, event)
                chunk = {**head, "object": chunk_of,
                         "choices": [_delta(g.chat, delta, [event.token], None, lps, first)]}
                first = False
                yield f"data: {json.dumps(chunk)}\n\n"
                if (finish := text.finish) is not None:
                    break
            else:
                finish = event.finish_reason
        if finish is not None:
            chunk = {**head, "object": chunk_of,
                     "choices": [_delta(g.chat, text.flush(), [], finish, None, first)]}
            yield f"data: {json.dumps(chunk)}\n\n"
            if g.include_usage:
                tail = {**head, "object": obj, "choices": [], "usage": self.usage(req, len(text.ids))}
                yield f"data: {json.dumps(tail)}\n\n"
        yield "data: [DONE]\n\n"

    async def _whole(self, http: HttpRequest, g: Generation, req: Request, head: dict) -> dict:
        text, lp = StopText(self.tokenizer, g.stops), Logprobs(self.tokenizer)
        start = len(g.echo or "")          # where the completion's text begins
        if g.sampling.prompt_logprobs:
            lp.add_prompt(g.prompt[0], None)
        finish = None
        async for event in self.events(req, http):
            if event.error is not None:
                raise _error_of(event)
            if event.prompt:
                lp.add_prompt(event.token, event)
            elif event.token is not None:
                lp.add(event, start + len(text.text))
                await self.reader.off_loop(text.add, event.token)
                if (finish := text.finish) is not None:
                    break
            else:
                finish = event.finish_reason
        content = (g.echo or "") + text.text          # the whole text (cut before a stop string)
        lps = await self.reader.off_loop(_logprobs_of, g, lp, 0)
        out: dict[str, Any] = {"index": 0}
        if g.chat:
            out["message"] = {"role": "assistant", "content": content}
        else:
            out["text"] = content
        out |= {"token_ids": text.ids, "logprobs": lps, "finish_reason": finish}
        obj = "chat.completion" if g.chat else "text_completion"
        return {**head, "object": obj, "choices": [out], "usage": self.usage(req, len(text.ids))}


async def _disconnect(http: HttpRequest) -> None:
    """Returns when the client disconnects. The body is read by then, so the server's next
    message is the disconnect (uvicorn sends it the moment the connection is lost; polling
    `is_disconnected` between events would see it only when no event came for a while)."""
    with contextlib.suppress(Exception):         # a receive that fails: gone too
        while (await http.receive())["type"] != "http.disconnect":
            pass


def _error_of(event: Event) -> ApiError:
    return ApiError(500, event.error or "generation failed", None, "server_error")


def _logprobs_of(g: Generation, lp: Logprobs, start: int) -> dict | None:
    if g.logprobs is None or start >= len(lp.entries):
        return None
    return lp.chat(start) if g.chat else lp.completion(start)


def _next_text(g: Generation, text: StopText, lp: Logprobs, event: Event) -> tuple[str, dict | None]:
    """A streamed token's text to send and its logprobs entry."""
    lp.add(event, len(text.text))
    return text.add(event.token), _logprobs_of(g, lp, len(lp.entries) - 1)


def _delta(chat: bool, text: str, ids: list[int], finish: str | None, lp: dict | None,
           first: bool = False) -> dict:
    """A streamed chunk's choice."""
    if not chat:
        return {"index": 0, "text": text, "token_ids": ids, "logprobs": lp, "finish_reason": finish}
    delta = ({"role": "assistant", "content": text} if first else {"content": text})
    return {"index": 0, "delta": delta, "token_ids": ids, "logprobs": lp, "finish_reason": finish}
