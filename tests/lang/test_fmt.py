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
