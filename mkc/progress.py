"""Progress bars (tqdm) on stderr for work that takes more than a few seconds, drawn only when
stderr is a terminal: piped or captured output (tests, --json, logs) stays as it was."""
from __future__ import annotations

import sys


def bar(total: float | None = None, desc: str = "", unit: str = "it", show: bool = True, **kw):
    """A tqdm bar on stderr, or one that draws nothing unless `show` and stderr is a terminal
    (every method still works, so callers need not check)."""
    from tqdm import tqdm
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, leave=False,
                dynamic_ncols=True, disable=not (show and sys.stderr.isatty()), **kw)
