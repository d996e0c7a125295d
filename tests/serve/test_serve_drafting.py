"""The drafters (mkc.serve.drafting): a draft model's drafts are its greedy continuation, from
a kept cache that follows each request's context or from scratch alike; the acceptance rule."""
from __future__ import annotations

from mkc.serve.drafting import DraftModel, accepted_rows

MODEL = "qwen3_8_mini"


def test_acceptance_keeps_the_drafts_up_to_the_first_the_model_would_not_choose():
    # the anchor 5, drafts 6 7 8 (a padding row after them), the model's choice after each row
    tokens = [5, 6, 7, 8, 8]
    assert accepted_rows(tokens, 3, [6, 7, 8, 9, 9]) == 4       # all kept
    assert accepted_rows(tokens, 3, [6, 1, 8, 9, 9]) == 2       # 7 rejected: 8 with it
    assert accepted_rows(tokens, 3, [0, 7, 8, 9, 9]) == 1       # the anchor alone
    assert accepted_rows(tokens, 2, [6, 7, 8, 9, 9]) == 3       # the padding is no draft


def test_a_draft_model_drafts_its_greedy_continuation_and_feeds_each_token_once():
    kept = DraftModel.load(MODEL, seed=0, context=64, keep=4)
    calls = []
    step = kept._step
    kept._step = lambda *a: calls.append(int(a[4][0])) or step(*a)   # positions fed
    context = [5, 17, 99]
    drafted = kept(context, 3)
    assert len(drafted) == 3 and calls == [0, 1, 2, 3, 4]     # 2 tokens fed, then 3 drafts
    # the request accepted the first draft and the model's own next token: the kept cache is
    # found and only the two new tokens are fed before drafting again
    context += [drafted[0], 1000]
    calls.clear()
    again = kept(context, 2)
    assert calls == [2, 3, 4, 5]
    fresh = DraftModel.load(MODEL, seed=0, context=64, keep=4)
    assert fresh(context, 2) == again                     # from scratch: the same drafts
    # greedy: each draft is the next token after the ones before it
    assert fresh(context + again[:1], 1) == again[1:2]


def test_kept_caches_are_bounded_and_the_context_limit_stops_drafts():
    draft = DraftModel.load(MODEL, seed=0, context=8, keep=2)
    for first in (1, 2, 3):
        draft([first, 7], 1)
    assert len(draft._kept) == 2 and (1,) not in draft._kept     # least recently used dropped
    assert len(draft([4, 5, 6, 7, 8, 9], 5)) == 3                 # positions 5..7 of 8
    assert draft(list(range(9)), 2) == []

