"""Speculative decoding's drafters, (context, n) -> up to n tokens that may follow it, and its
acceptance rule."""
from __future__ import annotations

from collections import OrderedDict
from pathlib import Path
from typing import Any, Sequence


def accepted_rows(tokens: Sequence[int], drafts: int, predicted: Sequence[int]) -> int:
    """The rows a verify launch of one sequence keeps: its anchor (`tokens[0]`) and each of its
    `drafts` drafts (`tokens[1:]`) while the draft equals the model's own greedy choice after
    the row before it (`predicted[i]`: the choice after row i). The tokens emitted are
    `predicted[:accepted]`: the kept drafts, then the model's token after them, so the text is
    plain greedy decoding's."""
    accepted = 1
    while accepted <= drafts and tokens[accepted] == predicted[accepted - 1]:
        accepted += 1
    return accepted


def prompt_lookup(context: list[int], drafts: int, ngram: int = 2) -> list[int]:
    """Up to `drafts` tokens that followed the most recent earlier occurrence of the context's
    last n-gram (shorter n-grams if none), or none."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i:i + n] == tail:
                return context[i + n:i + n + drafts]
    return []


class DraftModel:
    """Drafts by running a draft model greedily: its family's pure-JAX reference in plain f32
    under `jit` (XLA, on JAX's default device), one sequence at a time. A context's cache is
    kept after each call (up to `keep`, least recently used dropped), holding every token but
    the last (the anchor, not yet accepted); the next call for the same request finds it as
    the longest kept prefix of its context and feeds only the tokens added since, so a row's
    drafts cost a step per new token plus one per draft. Drafts come from a copy: a rejected
    draft never enters a kept cache."""

    def __init__(self, config: dict, params: Any, context: int, keep: int = 16):
        import jax

        from mkc.checkpoint import family_of
        self.reference = family_of(config).module("reference")
        self.cfg = self.reference.load_config(config)
        self.params, self.context, self.keep = params, context, keep
        self._step = jax.jit(self.reference.decode_step, static_argnums=(1, 5))
        self._kept: OrderedDict[tuple[int, ...], Any] = OrderedDict()

    @staticmethod
    def load(model: str, seed: int, context: int, keep: int) -> "DraftModel":
        """A checkpoint directory's weights, or a shipped config name's (or config.json's)
        random weights drawn with `seed` (the generated modules' `random_weights(seed)`)."""
        import json

        from mkc.checkpoint import family_of, load_checkpoint
        from mkc.model.config import resolve_config_path
        if Path(model).is_dir():
            config, params = load_checkpoint(Path(model))
        else:
            config = json.loads(resolve_config_path(model).read_text())
            reference = family_of(config).module("reference")
            params = reference.init_params(reference.load_config(config), seed=seed)
        return DraftModel(config, params, context, keep)

    @property
    def vocab_size(self) -> int:
        return self.cfg.vocab_size

    def _advance(self, cache, token: int, position: int):
        import jax.numpy as jnp
        import numpy as np
        logits, cache = self._step(self.params, self.cfg, cache, jnp.array([token], jnp.int32),
                                   jnp.array([position], jnp.int32), None)
        return int(np.argmax(np.asarray(logits)[0])), cache

    def __call__(self, context: list[int], drafts: int) -> list[int]:
        fed = tuple(context[:-1])
        if len(context) - 1 + drafts > self.context:
            drafts = max(0, self.context - len(context) + 1)
        if not context or drafts == 0:
            return []
        known = max((k for k in self._kept if len(k) <= len(fed) and fed[:len(k)] == k),
                    key=len, default=None)
        cache = (self._kept.pop(known) if known is not None
                 else self.reference.init_cache(self.cfg, 1, self.context))
        for position in range(len(known or ()), len(fed)):
            _, cache = self._advance(cache, fed[position], position)
        self._kept[fed] = cache
        while len(self._kept) > self.keep:
            self._kept.popitem(last=False)
        out, token = [], context[-1]
        for position in range(len(fed), len(fed) + drafts):
            token, cache = self._advance(cache, token, position)
            out.append(token)
        return out

