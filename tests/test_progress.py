"""Progress bars draw on stderr only when it is a terminal and the caller asks: captured output
(tests, --json, logs) stays as it was."""
import io
import sys

from mkc.progress import bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _draw(monkeypatch, stream, show=True) -> str:
    monkeypatch.setattr(sys, "stderr", stream)
    with bar(total=3, desc="confirm: compiling", unit="step", show=show) as b:
        b.update(2)
        b.set_description_str("confirm: done")
    return stream.getvalue()


def test_a_bar_draws_on_a_terminal_only(monkeypatch):
    assert "confirm: compiling" in _draw(monkeypatch, _Terminal())
    assert _draw(monkeypatch, io.StringIO()) == ""
    assert _draw(monkeypatch, _Terminal(), show=False) == ""
