"""Progress bars (tqdm) on stderr for work that takes more than a few seconds, drawn only when
stderr is a terminal: piped or captured output (tests, --json, logs) stays as it was, but for
the plain progress lines a long search prints on stdout where no bar is drawn (`tick`)."""
from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO


def bar(total: float | None = None, desc: str = "", unit: str = "it", show: bool = True, **kw):
    """A tqdm bar on stderr, or one that draws nothing unless `show` and stderr is a terminal
    (every method still works, so callers need not check)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not (show and sys.stderr.isatty()), **kw)


def tick(b: Any, label: str, every: int, out: TextIO | None = None) -> Callable[[], None]:
    """A step of bar `b` (its total set); where it is not drawn (no terminal) and `out` is
    given, a line on `out` every `every` steps instead (a log or a pipe still sees a long run
    move): steps done of the total, the time so far, and at that pace the most left."""
    t0 = time.perf_counter()
    done = 0

    def step() -> None:
        nonlocal done
        b.update(1)
        done += 1
        if out is None or not b.disable or done % every or done == b.total:
            return
        spent = time.perf_counter() - t0
        left = spent / done * (b.total - done)
        print(f"  {label}: {done} of at most {b.total}, {spent:.0f} s so far, at most about "
              f"{left:.0f} s left", file=out, flush=True)
    return step
