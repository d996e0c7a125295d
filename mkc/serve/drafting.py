"""Drafters for speculative decoding: (context, n) -> up to n tokens that may follow it."""
from __future__ import annotations


def prompt_lookup(context: list[int], drafts: int, ngram: int = 2) -> list[int]:
    """Up to `drafts` tokens that followed the most recent earlier occurrence of the context's
    last n-gram (shorter n-grams if none), or none."""
    for n in range(min(ngram, len(context) - 1), 0, -1):
        tail = context[-n:]
        for i in range(len(context) - n - 1, -1, -1):
            if context[i:i + n] == tail:
                return context[i + n:i + n + drafts]
    return []


DRAFTERS = {"prompt-lookup": prompt_lookup}
