"""When a request's generation ends: its stop tokens, its token budget and the context (decided
on each token the scheduler accepts), and its stop strings (decided on the text as the HTTP
layer detokenizes it, off the engine's thread, since detokenizing is the tokenizer's CPU work).
"""
from __future__ import annotations

from typing import Any

from mkc.serve.sampling import SamplingParams


def stop_tokens(requested: list[int] | None, eos: frozenset[int], ignore_eos: bool) -> frozenset[int]:
    """The tokens that end a request: those it asks for (`stop_token_ids`) and, unless it
    ignores them (`ignore_eos`), the model's EOS tokens."""
    return frozenset(requested or ()) | (frozenset() if ignore_eos else eos)


def token_finish(sampling: SamplingParams, generated: list[int], prompt_tokens: int,
                 context: int) -> str | None:
    """The finish reason after a request's latest token (the last of `generated`), or None
    while it goes on: "stop" for a stop token (an EOS unless `ignore_eos`, or a
    `stop_token_ids` one), "length" at `max_tokens` or at the end of the context."""
    if generated[-1] in sampling.stop_token_ids:
        return "stop"
    if len(generated) >= sampling.max_tokens or prompt_tokens + len(generated) > context:
        return "length"
    return None


class StopText:
    """A request's generated text as its tokens arrive, with its stop strings: what may be
    sent so far (holding back a tail that could still begin a stop string) and whether a stop
    string has appeared (`stopped`; the text is cut before it). Without a tokenizer there is no
    text and no stop string (the API refuses stop strings then)."""

    def __init__(self, tokenizer: Any, stop: list[str]):
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text, self.sent, self.stopped = "", 0, False
        self._hold = max((len(s) for s in stop), default=1) - 1

    @property
    def finish(self) -> str | None:
        """"stop" once a stop string appeared (the response ends there), else None."""
        return "stop" if self.stopped else None

    def add(self, token: int) -> str:
        """Take a token; the text that may now be sent."""
        self.ids.append(token)
        if self.tokenizer is None:
            return ""
        self.text = self.tokenizer.decode(self.ids)
        for s in self.stop:
            if (at := self.text.find(s)) >= 0:
                self.text, self.stopped = self.text[:at], True
                return self.flush()
        ready = len(self.text) - self._hold
        if self.text.endswith("\ufffd"):     # an incomplete UTF-8 sequence: wait for the rest
            ready = min(ready, len(self.text) - 1)
        return self._take(ready)

    def flush(self) -> str:
        return self._take(len(self.text))

    def _take(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:end], end
        return out
