"""The HTTP API's requests: their bodies (OpenAI's schema, strictly typed), and every check a
request passes before it reaches the engine, in one place (`Reader`): Unicode, the model, the
fields this server does not act on, the prompt (text, token ids, or a chat through the
template), its room in the context, sampling and stop strings. Each refusal is an `ApiError`
whose message says what to change.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr
from starlette.concurrency import run_in_threadpool

from mkc.serve.model import Served, TokenizerError
from mkc.serve.sampling import SamplingParams
from mkc.serve.stops import stop_tokens

LARGE_INPUT = 1 << 16              # characters or tokens of tokenizer work that takes turns
DEFAULT_COMPLETION_TOKENS = 16      # OpenAI's default max_tokens for /v1/completions
MAX_COMPLETION_LOGPROBS = 5         # OpenAI's bounds: the legacy `logprobs`, chat's `top_logprobs`
MAX_TOP_LOGPROBS = 20
INT32_MAX = 2**31 - 1               # top_k is packed as int32 for the on-device sampler
INT64 = (-2**63, 2**63 - 1)         # OpenAI's seed


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


def error_body(status: int, message: str, param: str | None, kind: str) -> dict:
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
    not Unicode text: a lone surrogate ("\\ud800"), which JSON can spell but UTF-8 cannot. Walked
    with a stack, not recursion, so that no depth of nesting exhausts Python's."""
    stack = [(value, path)]
    while stack:
        value, path = stack.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as e:
                raise ApiError(400, f"{path} holds a lone surrogate ({value[e.start]!r} at character "
                                    f"{e.start}): text must be valid Unicode",
                               path.split("[")[0].split(".")[0]) from None
        elif isinstance(value, list):
            # in reverse, so that the first bad string in the body is the one named
            stack.extend((value[i], f"{path}[{i}]") for i in range(len(value) - 1, -1, -1)
                         if isinstance(value[i], (str, list, dict)))
        elif isinstance(value, dict):
            for k, v in reversed(value.items()):
                stack.append((v, f"{path}.{k}" if path else k))
                stack.append((k, path))


# JSON nesting a request may have: no body this server reads nests more than 4 deep (a chat
# message's text part); far past it Python's parser, or a walk over the value, runs out of recursion
MAX_DEPTH = 100
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def check_nesting(body: bytes) -> None:
    """Refuse (ApiError 400) a body whose arrays and objects nest past MAX_DEPTH, read from its
    bytes before it is parsed (brackets inside strings do not count)."""
    if body.count(b"[") + body.count(b"{") <= MAX_DEPTH:
        return                                  # too few brackets to nest that deep
    brackets = np.frombuffer(_JSON_STRING.sub(b"", body).translate(None, _NOT_BRACKETS), np.uint8)
    depth = np.cumsum(np.where((brackets == ord("[")) | (brackets == ord("{")), 1, -1))
    if depth.size and int(depth.max()) > MAX_DEPTH:
        raise ApiError(400, f"the body nests arrays and objects {int(depth.max())} deep, past the "
                            f"{MAX_DEPTH} this server reads: no field it takes nests so deep")


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


_T = TypeVar("_T")


@dataclass(frozen=True)
class Generation:
    """A completion or chat request, checked: its prompt's tokens, sampling and stop strings;
    `chat`: answered in chat's schema; `logprobs`: None, or how many most likely tokens beside
    each token's; `echo`: the prompt's text, which the completion's text follows (its tokens'
    logprobs too, with logprobs); `stream`, with `include_usage`: sent as server-sent events."""

    prompt: list[int]
    sampling: SamplingParams
    stops: list[str]
    chat: bool
    logprobs: int | None
    echo: str | None = None
    stream: bool = False
    include_usage: bool = False


class Reader:
    """Reads requests for `served` on an engine of `context` tokens over `vocab` token ids;
    `max_prompt`: the tokens a prompt may hold. Tokenizer work runs off the event loop
    (`off_loop`)."""

    def __init__(self, served: Served, context: int, vocab: int, max_prompt: int):
        self.served, self.tokenizer = served, served.tokenizer
        self.context, self.vocab, self.max_prompt = context, vocab, max_prompt
        # large inputs' tokenizer work: one at a time, on a thread of low CPU priority
        self._large = ThreadPoolExecutor(1, "mkc-serve-tokenizer", initializer=_low_priority)

    async def off_loop(self, fn: Callable[..., _T], *args: Any, size: int = 0) -> _T:
        """`fn(*args)` in the thread pool when it runs the tokenizer (CPU work that would hold up
        every other request and /health); at once without one (nothing to do). Work on `size`
        characters or tokens from LARGE_INPUT on takes turns on one thread of low CPU priority,
        so that however many such requests come, the event loop and the engine's thread are
        not kept from the CPU."""
        if self.tokenizer is None:
            return fn(*args)
        if size < LARGE_INPUT:
            return await run_in_threadpool(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._large, lambda: fn(*args))

    # ---- the endpoints' requests ---------------------------------------------------------
    async def completion(self, body: CompletionRequest) -> Generation:
        self.checked(body)
        check_served_fields(body.model_extra or {})
        if body.max_tokens == 0 and not body.echo:
            raise ApiError(400, "max_tokens = 0 generates nothing: it is for echo: true (the "
                                "prompt, with its tokens' logprobs when logprobs is given)",
                           "max_tokens")
        if body.echo and body.stream:
            raise ApiError(400, "echo is served without stream: drop one of them", "echo")
        prompt = await self.prompt_ids(body.prompt)
        echo = None
        if body.echo:             # the prompt's text as sent, or its tokens' (vLLM's)
            text = body.prompt[0] if isinstance(body.prompt, list) and len(body.prompt) == 1 \
                else body.prompt
            echo = text if isinstance(text, str) else (
                await self.off_loop(self.tokenizer.decode, prompt, size=len(prompt))
                if self.tokenizer is not None else "")
        return self.generation(body, prompt, body.max_tokens, body.logprobs, chat=False, echo=echo)

    async def chat(self, body: ChatRequest) -> Generation:
        self.checked(body)
        check_served_fields(body.model_extra or {})
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        ids = await self.chat_ids(body.messages)
        prompt = await self.off_loop(self.check_ids, ids, "messages", size=len(ids))
        limit = "max_tokens" if body.max_completion_tokens is None else "max_completion_tokens"
        return self.generation(body, prompt, getattr(body, limit),
                               (body.top_logprobs or 0) if body.logprobs else None, chat=True,
                               limit=limit)

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        """The tokens of /tokenize's text or chat."""
        self.checked(body)
        tok = self.need_tokenizer("/tokenize")
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give either prompt (text) or messages (chat)")
        if body.messages is not None:
            ids, param = await self.chat_ids(body.messages), "messages"
        else:
            ids, param = await self.off_loop(tok.encode, body.prompt, size=len(body.prompt)), "prompt"
        if len(ids) > self.max_prompt:         # what a prompt may hold is all /tokenize counts
            raise ApiError(400, f"the text has {len(ids)} tokens, more than the {self.max_prompt} "
                                "a prompt may hold here (mkc serve --max-prompt-tokens; the "
                                f"model's context is {self.context})", param)
        return ids

    def detokenize(self, body: DetokenizeRequest) -> Any:
        """/detokenize's tokenizer, once its tokens are checked."""
        self.checked(body)
        tok = self.need_tokenizer("/detokenize")
        self.check_vocabulary(body.tokens, "tokens")
        return tok

    # ---- the checks ------------------------------------------------------------------------
    def checked(self, body: _Body) -> None:
        """What every endpoint refuses first: text that is not Unicode, another model."""
        check_unicode(body.model_dump(exclude_unset=True) | (body.model_extra or {}), "")
        self.check_model(body.model)

    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.served.name:
            raise ApiError(404, f"the model '{name}' does not exist; this server serves "
                                f"'{self.served.name}' (GET /v1/models)", "model", "not_found_error")

    def need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ApiError(400, f"{what} needs a tokenizer, and '{self.served.name}' has none "
                                "(serve a checkpoint directory with tokenizer.json and the "
                                "`tokenizers` or `transformers` package, or a model without one "
                                "with `mkc serve --tokenizer bytes`, a stand-in whose text means "
                                "nothing); pass the prompt as token ids instead")
        return self.tokenizer

    async def chat_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """The conversation's prompt through the chat template; a template's refusal is a 400."""
        tokenizer = self.tokenizer
        if tokenizer is None or tokenizer.chat is None:
            raise ApiError(400, f"'{self.served.name}' has no chat template: chat needs a checkpoint "
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
        return await self.off_loop(render, size=_chat_size(messages))

    def check_ids(self, ids: list[int], param: str) -> list[int]:
        """`ids` if they make a prompt this server takes (not empty, within --max-prompt-tokens
        and the vocabulary), else the ApiError that says why."""
        if not ids:
            raise ApiError(400, "the prompt is empty: give at least one token", param)
        if len(ids) > self.max_prompt:
            cap = ("the model's context" if self.max_prompt == self.context
                   else "this server's cap (mkc serve --max-prompt-tokens)")
            raise ApiError(400, f"the prompt has {len(ids)} tokens, more than {cap} of "
                                f"{self.max_prompt} (the model's context is {self.context})", param)
        self.check_vocabulary(ids, param)
        return ids

    def check_vocabulary(self, ids: list[int], param: str, what: str = "token ids") -> None:
        """Refuse (ApiError 400) ids outside the vocabulary."""
        bad = [t for t in ids if not 0 <= t < self.vocab]
        if bad:
            raise ApiError(400, f"{what} {bad[:5]} are outside the vocabulary (0 to "
                                f"{self.vocab - 1})", param)

    async def prompt_ids(self, prompt: Any) -> list[int]:
        """A completion's prompt (text, token ids, or a list of one of them) as token ids."""
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (list, str)):
            prompt = prompt[0]
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) or _is_ids(p) for p in prompt):
            raise ApiError(400, f"{len(prompt)} prompts in one request; send one prompt per "
                                "request (they are batched on the server)", "prompt")
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "the prompt is empty: give at least one token", "prompt")
            tok = self.need_tokenizer("a text prompt")
            return await self.off_loop(lambda: self.check_ids(tok.encode(prompt), "prompt"),
                                       size=len(prompt))
        if not _is_ids(prompt):
            raise ApiError(400, "prompt must be a string or a list of token ids (integers)", "prompt")
        return await self.off_loop(self.check_ids, prompt, "prompt", size=len(prompt))

    def generation(self, body: _Sampling, prompt: list[int], max_tokens: int | None,
                   logprobs: int | None, chat: bool, echo: str | None = None,
                   limit: str = "max_tokens") -> Generation:
        """The request's generation, or the ApiError of what does not fit; `limit`: the field
        `max_tokens` came from (chat's `max_completion_tokens`, or `max_tokens`)."""
        if body.n != 1:
            raise ApiError(400, f"n = {body.n}: one choice per request is served (send n "
                                "requests)", "n")
        room = self.context - len(prompt)
        if room < 1:
            raise ApiError(400, f"the prompt has {len(prompt)} tokens; the model's context is "
                                f"{self.context}, and at least one must be left to generate",
                           "prompt")
        if max_tokens is None:
            max_tokens = room
        if max_tokens > room:
            raise ApiError(400, f"{limit} = {max_tokens} with a prompt of {len(prompt)} "
                                f"tokens passes the context of {self.context}: at most {room}",
                           limit)
        self.check_vocabulary(body.stop_token_ids or [], "stop_token_ids", "stop_token_ids")
        stops = stop_strings(body)
        if stops:
            self.need_tokenizer("a stop string")
        if body.stream_options is not None and not body.stream:
            raise ApiError(400, "stream_options applies to a streamed response: add \"stream\": "
                                "true or drop it", "stream_options")
        return Generation(prompt, self.sampling(body, max_tokens, logprobs, echo is not None),
                          stops, chat, logprobs, echo, body.stream,
                          bool(body.stream_options and body.stream_options.include_usage))

    def sampling(self, body: _Sampling, max_tokens: int, logprobs: int | None,
                 echo: bool) -> SamplingParams:
        seed = body.seed if body.seed is not None else secrets.randbits(31)
        stops = stop_tokens(body.stop_token_ids, self.served.eos_token_ids, body.ignore_eos)
        return SamplingParams(max_tokens=max_tokens,
                              temperature=1.0 if body.temperature is None else body.temperature,
                              top_k=body.top_k or 0, top_p=1.0 if body.top_p is None else body.top_p,
                              seed=seed % (1 << 31), stop_token_ids=stops,
                              logprobs=logprobs, prompt_logprobs=echo and logprobs is not None)


def _low_priority() -> None:
    """A low CPU priority (nice 10) for this thread: Linux gives each thread its own nice value,
    so it alone yields the CPU to the others; elsewhere nothing changes. Not the lowest (19):
    while it holds the GIL (making the ids' list) the other threads wait for it to run."""
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)


def _chat_size(messages: list[dict[str, Any]]) -> int:
    """The characters of a conversation's text (its messages checked by check_messages)."""
    return sum(len(c) if isinstance(c := m.get("content"), str)
               else sum(len(p["text"]) for p in c or ()) for m in messages)


def _is_ids(value: Any) -> bool:
    return isinstance(value, list) and all(type(t) is int for t in value)
