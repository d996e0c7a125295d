"""Argument types of mkc's command lines: numbers that mean something, or a usage error
naming the option (argparse's), never a traceback or a silently clamped value."""
from __future__ import annotations

import argparse
import math
import re
from typing import Callable

from mkc.lang.ast import MAX_DIGITS


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: a count of at least `minimum`, written in digits as a spec writes a
    number (bounded, so a huge one is a usage error, not Python's 4300-digit ValueError)."""
    def parse(text: str) -> int:
        if not re.fullmatch(r"-?[0-9]+", text) or len(text) > MAX_DIGITS or int(text) < minimum:
            raise argparse.ArgumentTypeError(
                f"expected an integer of at least {minimum} (at most {MAX_DIGITS} digits), got "
                f"'{text[:20]}'")
        return int(text)
    parse.__name__ = "count"
    return parse


def int_in_range(minimum: int, maximum: int) -> Callable[[str], int]:
    """An argparse type: an integer from `minimum` to `maximum` (a port, say)."""
    at_least = int_at_least(minimum)

    def parse(text: str) -> int:
        value = at_least(text)
        if value > maximum:
            raise argparse.ArgumentTypeError(f"expected an integer from {minimum} to {maximum}, "
                                             f"got '{text[:20]}'")
        return value
    parse.__name__ = "integer"
    return parse


def nonempty_text(text: str) -> str:
    """An argparse type: a name of at least one character that is not only spaces."""
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a name, got nothing")
    return text


def float_at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type: a finite number of at least `minimum`."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value >= minimum):
            raise argparse.ArgumentTypeError(f"expected a finite number of at least {minimum:g}, got "
                                             f"'{text[:20]}'")
        return value
    parse.__name__ = "number"
    return parse
