"""When a request ends (mkc.serve.stops): its stop tokens and budget, and its stop strings."""
from __future__ import annotations

from serve_fakes import LetterTokenizer

from mkc.serve.sampling import SamplingParams
from mkc.serve.stops import StopText, stop_tokens, token_finish


def test_stop_tokens_are_the_asked_ones_and_eos_unless_ignored():
    assert stop_tokens([3], frozenset({9}), ignore_eos=False) == {3, 9}
    assert stop_tokens([3], frozenset({9}), ignore_eos=True) == {3}
    assert stop_tokens(None, frozenset({9}), ignore_eos=False) == {9}


def test_token_finish():
    params = SamplingParams(max_tokens=3, stop_token_ids=frozenset({7}))
    assert token_finish(params, [1, 7], prompt_tokens=2, context=16) == "stop"
    assert token_finish(params, [1, 2], prompt_tokens=2, context=16) is None
    assert token_finish(params, [1, 2, 3], prompt_tokens=2, context=16) == "length"
    assert token_finish(params, [1, 2], prompt_tokens=15, context=16) == "length"


def test_a_stop_string_cuts_the_text_and_a_possible_start_of_one_is_held_back():
    text = StopText(LetterTokenizer(), ["cde"])       # token t is the letter chr(97 + t)
    sent = [text.add(t) for t in (0, 1, 2, 3)]          # a b c d: "cd" may begin "cde"
    assert sent == ["", "", "a", "b"] and text.finish is None
    assert text.add(4) == "" and text.finish == "stop" and text.text == "ab"
    other = StopText(LetterTokenizer(), ["cde"])
    for t in (0, 1, 2, 3):
        other.add(t)
    assert other.flush() == "cd"                        # the end: what was held back is sent
