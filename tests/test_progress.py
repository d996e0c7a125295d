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


def _cli_stderr(monkeypatch, stream, *argv: str) -> str:
    from mkc.cli import main
    monkeypatch.setattr(sys, "stderr", stream)
    assert main(list(argv)) == 0
    return stream.getvalue()


def test_tune_and_retarget_show_a_bar_on_a_terminal_only(monkeypatch, tmp_path, capsys):
    """`mkc tune` counts its evaluations and `mkc retarget` shows its stage on a bar, as `mkc
    check --confirm` does: drawn on a terminal, never with --json or when stderr is not one."""
    from tests_support import SPEC
    tune = ["tune", str(SPEC), "--model", "qwen3_8_mini", "-o", str(tmp_path / "t.sched"),
            "--budget", "1"]
    drawn = _cli_stderr(monkeypatch, _Terminal(), *tune)
    assert "tune: evaluating" in drawn and "1/1" in drawn
    assert "tune: evaluating" not in _cli_stderr(monkeypatch, _Terminal(), *tune, "--json")
    retarget = ["retarget", str(SPEC), "--model", "qwen3_8_mini", "--target",
                "v6e topology 2x4", "-o", str(tmp_path / "r.sched"), "--models", "1"]
    drawn = _cli_stderr(monkeypatch, _Terminal(), *retarget)
    assert "retarget: candidate 1 of 4 on v6e topology 2x4" in drawn
    assert "\r" in drawn                               # a bar redrawn in place, not lines alone
    assert _cli_stderr(monkeypatch, _Terminal(), *retarget, "--json") == ""
    capsys.readouterr()
