"""`mkc fmt`: canonical, idempotent, meaning-preserving, comment-keeping; the shipped specs
are in canonical layout (CI fails otherwise)."""
import random
import re
import subprocess
import sys

import pytest

from mkc.diagnostics import MkcError
from mkc.lang import parser
from mkc.lang.ast import meaning
from mkc.lang.fmt import format_text
from tests_support import ROOT

SHIPPED = sorted((ROOT / "schedules").glob("*.sched"))
ALL_SPECS = sorted(p for p in ROOT.rglob("*.sched") if ".venv" not in p.parts)


def _parses(path) -> bool:
    try:
        parser.parse(path.read_text(), str(path))
        return True
    except MkcError:
        return False


PARSING = [p for p in ALL_SPECS if _parses(p)]


def comments(text: str) -> list[str]:
    return [c.rstrip() for c in re.findall(r"#[^\n]*", text)]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_specs_are_in_canonical_layout(path):
    text = path.read_text()
    assert format_text(text, str(path)) == text, f"run: .venv/bin/mkc fmt {path.relative_to(ROOT)}"


def test_every_spec_in_the_repository_formats_idempotently_to_the_same_meaning():
    assert len(PARSING) > 50        # the shipped, benchmark and broken-spec corpora
    for path in PARSING:
        text = path.read_text()
        once = format_text(text, str(path))
        assert format_text(once) == once, path
        assert meaning(parser.parse(once)) == meaning(parser.parse(text)), path
        assert comments(once) == comments(text), path     # every comment, in order


def test_a_messy_spec_gets_the_canonical_layout():
    messy = """# header


schedule   messy{
  model "qwen3_8_27b"   # the model
target tpu7x   topology 2x2x1
  mesh tp=8
  batch 1 to 8

  shard heads over tp / 2
  ring weights : 12 slots of bf16 tiles up to 1024 x 1280
  stream weights ahead 12 {

    gdn: in_proj,out_proj , gate_up
    then lm_head

  }
  pool p { view a: gdn( in_proj ,out_proj ) }
  phase gdn {
    load state.conv->conv_buf at start;   # inside
       wait before conv
    # before the close
  }
  phase gqa { kv tiles 3 slots of 128 tokens ahead 3 }
}
# the end
"""
    assert format_text(messy) == """# header

schedule messy {
  model   "qwen3_8_27b"  # the model
  target  tpu7x topology 2x2x1
  mesh    tp = 8
  batch   1 to 8

  shard heads over tp / 2
  ring weights: 12 slots of bf16 tiles up to 1024 x 1280
  stream weights ahead 12 {
    gdn: in_proj, out_proj, gate_up
    then lm_head
  }
  pool p {
    view a: gdn(in_proj, out_proj)
  }
  phase gdn {
    # inside
    load  state.conv -> conv_buf at start; wait before conv
    # before the close
  }
  phase gqa {
    kv tiles 3 slots of 128 tokens ahead 3
  }
}
# the end
"""


@pytest.mark.parametrize("seed", range(6))
def test_respaced_shipped_specs_format_back_to_themselves(seed):
    """Random spaces between words, indents and doubled blank lines (not inside comments or
    strings): fmt restores the shipped text exactly."""
    rng = random.Random(seed)
    path = SHIPPED[seed % len(SHIPPED)]
    text = path.read_text()
    lines = []
    for line in text.splitlines():
        code, hash_, comment = line.partition("#")
        if '"' not in code:
            code = re.sub(r" +", lambda m: " " * rng.randint(1, 4), code.strip())
            code = re.sub(r"\s*([,:;])\s*", lambda m: " " * rng.randint(0, 2) + m.group(1) + " ", code)
        lines.append(" " * rng.randint(0, 6) + code + (" " * rng.randint(1, 3) + hash_ + comment
                                                        if hash_ else ""))
        if not line.strip():
            lines.append("")
    assert format_text("\n".join(lines) + "\n") == text


def test_a_spec_that_does_not_parse_is_a_diagnostic_not_a_rewrite():
    with pytest.raises(MkcError) as e:
        format_text("schedule s {\n  alreduce x direct wire bf16\n}\n", "bad.sched")
    assert e.value.diagnostics[0].code == "E-SYNTAX"


def test_mkc_fmt_rewrites_in_place_and_check_says_which(tmp_path):
    spec = tmp_path / "a.sched"
    canonical = SHIPPED[0].read_text()
    spec.write_text(canonical.replace("  shard", "      shard"))
    mkc = [sys.executable, "-m", "mkc", "fmt"]
    r = subprocess.run(mkc + ["--check", str(spec)], capture_output=True, text=True)
    assert r.returncode == 1 and f"would reformat {spec}" in r.stderr
    assert spec.read_text() != canonical                       # --check changes nothing
    r = subprocess.run(mkc + [str(spec)], capture_output=True, text=True)
    assert r.returncode == 0 and f"reformatted {spec}" in r.stdout
    assert spec.read_text() == canonical
    r = subprocess.run(mkc + ["--check", str(spec)], capture_output=True, text=True)
    assert r.returncode == 0 and not r.stderr
    r = subprocess.run(mkc + ["-"], input=canonical.replace("tp = 8", "tp=8"), capture_output=True,
                       text=True)
    assert r.returncode == 0 and r.stdout == canonical
    bad = tmp_path / "bad.sched"
    bad.write_text("schedule s {\n  alreduce x direct wire bf16\n}\n")
    r = subprocess.run(mkc + [str(bad)], capture_output=True, text=True)
    assert r.returncode == 1 and "error[E-SYNTAX]" in r.stderr and "Traceback" not in r.stderr
    assert bad.read_text().startswith("schedule s {\n  alreduce")


# What Python's str.splitlines() breaks lines at besides '\n'; to the lexer, '\r' and '\f' are
# whitespace and every one of them is comment text inside a comment.
ODD_BREAKS = ["\r", "\x0b", "\x0c", "\x1c", "\x1d", "\x1e", "\x85", "\u2028", "\u2029"]


def _assert_formats_stably(text: str) -> str:
    once = format_text(text)
    assert format_text(once) == once
    assert meaning(parser.parse(once)) == meaning(parser.parse(text))
    assert comments(once) == comments(text)
    return once


def test_the_reported_bare_cr_text_keeps_its_blank_lines_and_is_stable():
    text = ('schedule s {\n  # a\r# b\n  model   "qwen3_8_27b"\r  context 4096\n  batch   1 to 8\n\n'
            '  mesh    tp = 8\n\n  verify  8\n}\n')
    assert _assert_formats_stably(text) == (
        'schedule s {\n  # a\r# b\n  model   "qwen3_8_27b"\n  context 4096\n  batch   1 to 8\n\n'
        '  mesh    tp = 8\n\n  verify  8\n}\n')


@pytest.mark.parametrize("char", ODD_BREAKS, ids=lambda c: f"U+{ord(c):04X}")
def test_an_odd_line_break_in_comments_formats_idempotently(char):
    """Lines are the lexer's: only '\\n' ends one. A character str.splitlines() also breaks at,
    inside comments (and, for the lexer's whitespace, between words), moves no blank line."""
    for seed in range(3):
        rng = random.Random(seed)
        path = SHIPPED[(seed + ord(char)) % len(SHIPPED)]
        lines = []
        for line in path.read_text().split("\n"):
            code, hash_, comment = line.partition("#")
            if hash_:
                at = rng.randint(0, len(comment))
                comment = comment[:at] + char + comment[at:]
            if char in "\r\x0c" and '"' not in code and code.strip():
                code = code.replace(" ", char, 1)        # whitespace to the lexer
            lines.append(code + hash_ + comment)
            if not line.strip() and rng.random() < 0.5:
                lines.append("")
        _assert_formats_stably("\n".join(lines))


def test_a_symlinked_spec_is_formatted_at_its_target_and_stays_a_link(tmp_path):
    target = tmp_path / "real.sched"
    canonical = SHIPPED[0].read_text()
    target.write_text(canonical.replace("  shard", "      shard"))
    link = tmp_path / "link.sched"
    link.symlink_to(target.name)
    r = subprocess.run([sys.executable, "-m", "mkc", "fmt", str(link)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert link.is_symlink() and link.readlink().name == target.name
    assert target.read_text() == canonical


def test_formatting_keeps_a_read_only_spec_read_only(tmp_path):
    spec = tmp_path / "a.sched"
    spec.write_text(SHIPPED[0].read_text().replace("  shard", "      shard"))
    spec.chmod(0o444)
    r = subprocess.run([sys.executable, "-m", "mkc", "fmt", str(spec)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert spec.read_text() == SHIPPED[0].read_text()
    assert spec.stat().st_mode & 0o777 == 0o444
    assert [p.name for p in tmp_path.iterdir()] == ["a.sched"]      # no temp file left
