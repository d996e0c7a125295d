"""The command line of the fuzz campaign: its code is the tests' fuzz package
(tests/fuzz/__main__.py, whose docstring says what it runs)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from fuzz.__main__ import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
