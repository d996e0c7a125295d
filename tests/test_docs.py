"""Doc tests that keep the README a short front door and docs/ in step with the code: the
README's length and tone, the language reference against the grammar's statement registry, and
every relative link of the README and docs/ against the files in the repository."""
import re
import sys
from pathlib import Path

import pytest
from tests_support import ROOT

from mkc.diagnostics import MkcError
from mkc.lang import syntax

README = ROOT / "README.md"
LANGUAGE = ROOT / "docs" / "language.md"
MAX_README_LINES = 251
# Changelog prose: history belongs in git, not in the README.
CHANGELOG_PHRASES = (r"\bissue \d+", r"\bwas \d", r"\bbefore this\b")


def doc_files() -> list[Path]:
    return [README, *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_short():
    lines = README.read_text().count("\n")
    assert lines < MAX_README_LINES, f"README.md has {lines} lines; move reference material to docs/"


def test_readme_and_docs_have_no_changelog_prose():
    found = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
             for path in doc_files()
             for n, line in enumerate(path.read_text().splitlines(), 1)
             for phrase in CHANGELOG_PHRASES if re.search(phrase, line, re.I)]
    assert not found, "changelog prose (history belongs in git):\n" + "\n".join(found)


def rule_definitions(grammar: str) -> dict[str, str]:
    """Each rule of a lark grammar text with its alternatives, whitespace-normalised, by name."""
    rules: dict[str, list[str]] = {}
    current = None
    for line in grammar.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("//"):
            current = None
            continue
        m = re.match(r"^([?!]?[a-z_][a-z0-9_]*)\s*:", stripped)
        if m and not line[0].isspace():
            current = m.group(1)
            rules[current] = [stripped]
        elif current and stripped.startswith("|"):
            rules[current].append(stripped)
        else:
            current = None
    return {name: " ".join(" ".join(parts).split()) for name, parts in rules.items()}


def reference_sections() -> dict[str, dict[str, str]]:
    """The language reference's `###` sections: each heading's rules quoted in ```lark blocks."""
    sections = {}
    for block in re.split(r"^### ", LANGUAGE.read_text(), flags=re.M)[1:]:
        heading, _, body = block.partition("\n")
        quoted = "\n".join(re.findall(r"```lark\n(.*?)```", body, re.S))
        sections[heading.strip()] = rule_definitions(quoted)
    return sections


def test_language_reference_has_one_section_per_statement():
    statements = {s.rule: s for s in syntax.statements()}
    sections = reference_sections()
    first_rules = {heading: next(iter(rules), None) for heading, rules in sections.items()}
    assert all(first_rules.values()), \
        f"sections without a ```lark block: {[h for h, r in first_rules.items() if not r]}"
    documented = sorted(first_rules.values())
    assert documented == sorted(set(documented)), "a statement has two sections"
    missing = sorted(set(statements) - set(documented))
    assert not missing, f"statements without a section in {LANGUAGE.name}: {missing}"
    stale = sorted(set(documented) - set(statements))
    assert not stale, f"sections in {LANGUAGE.name} for rules that are not statements: {stale}"
    for heading, rule in first_rules.items():
        assert heading.strip("`").split()[0] == statements[rule].keyword, (heading, rule)


def test_language_reference_quotes_the_grammar_as_it_is():
    grammar = rule_definitions(syntax.grammar())
    for heading, rules in reference_sections().items():
        for name, text in rules.items():
            assert name in grammar, f"{heading}: rule {name!r} is not in the grammar"
            assert text == grammar[name], f"{heading}: {name} differs from the grammar:\n{grammar[name]}"


def test_every_relative_link_points_at_a_file():
    broken = []
    for path in doc_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", path.read_text()):
            if re.match(r"^[a-z]+:", target) or target.startswith("#"):
                continue
            file = target.split("#", 1)[0]
            if not (path.parent / file).exists():
                broken.append(f"{path.relative_to(ROOT)}: {target}")
    assert not broken, "links to missing files:\n" + "\n".join(broken)


def test_every_relative_link_anchor_names_a_heading():
    """`page.md#anchor` links name a heading of that page (GitHub's slug rule)."""
    def slugs(page: Path) -> set[str]:
        headings = re.findall(r"^#+ (.*)$", page.read_text(), re.M)
        return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}
    broken = []
    for path in doc_files():
        for file, anchor in re.findall(r"\]\(([^)\s#:]*)#([^)\s]+)\)", path.read_text()):
            page = path.parent / file if file else path
            if page.exists() and anchor not in slugs(page):
                broken.append(f"{path.relative_to(ROOT)}: {file}#{anchor}")
    assert not broken, "links to missing headings:\n" + "\n".join(broken)


def test_the_readme_s_performance_figures_are_what_validate_perf_recorded():
    from mkc.perf import constants
    val = constants.validation("tpu7x")
    text = README.read_text()
    section = " ".join(text[text.index("## Performance: modelled, not measured"):].split("\n## ")[0].split())
    worst = max(abs(m["error_percent"]) for m in val["micro"])
    errors = ", ".join(f"{p['step']} {p['error_percent']:+.1f} %" for p in val["points"])
    held = [p["error_percent"] for p in val["hold_out"]["points"]]
    for figure in (errors, f"within {worst:.1f} %", "nothing fitted",
                   f"12 published steps model from {min(held):+.1f} % to {max(held):+.1f} % off"):
        assert figure in section, figure


def walkthrough() -> str:
    text = README.read_text()
    section = text[text.index("## Your first spec"):]
    return section[:section.index("\n## ", 1)]


def walkthrough_spec_path(section: str) -> str:
    """Where the walkthrough saves its spec (in the ignored scratch folder), relative to the
    repository's root."""
    path = re.search(r"Save it as `([^`]+\.sched)`", section).group(1)
    assert path.startswith("scratch/"), path
    return path


def excerpt_lines_missing(excerpt: str, output: str) -> list[str]:
    """The lines of an excerpt that no line of `output` is: "..." stands for any text, and a
    line of "..." alone for lines left out."""
    printed = output.splitlines()
    missing = []
    for line in excerpt.splitlines():
        if line.strip() in ("", "..."):
            continue
        pattern = re.compile(".*?".join(re.escape(piece) for piece in line.split("...")))
        if not any(pattern.fullmatch(p) for p in printed):
            missing.append(line)
    return missing


@pytest.mark.parametrize("step", ["Check it", "Model it",
                                  pytest.param("Tune it", marks=pytest.mark.slow)])
def test_the_walkthrough_excerpts_are_what_their_commands_print(step, tmp_path, monkeypatch,
                                                                capsys):
    """Each excerpt of the README's walkthrough (`mkc check`, `mkc perf`, `mkc tune`) is what
    the command it names prints for the walkthrough's spec, line by line."""
    import shlex

    from mkc.cli import main
    section = walkthrough()
    spec = re.search(r"```sched\n(.*?)```", section, re.S).group(1)
    m = re.search(rf"\*\*{step}\.\*\* `\.venv/bin/mkc ([^`]+)`.*?```\n(.*?)```", section, re.S)
    path = tmp_path / walkthrough_spec_path(section)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(spec)
    assert walkthrough_spec_path(section) in shlex.split(m.group(1))
    monkeypatch.chdir(tmp_path)
    capsys.readouterr()
    assert main(shlex.split(m.group(1))) == 0
    assert not excerpt_lines_missing(m.group(2), capsys.readouterr().out)


def test_the_first_spec_walkthrough_checks(tmp_path):
    """The README's first spec passes `mkc check`, and its diagnostic example is what a wait
    after the read gives, at the line and column shown."""
    from mkc import compiler
    text = README.read_text()
    section = text[text.index("## Your first spec"):]
    spec = re.search(r"```sched\n(.*?)```", section, re.S).group(1)
    path = tmp_path / "my_qwen.sched"
    path.write_text(spec)
    compiler.check_spec(path)
    shown = re.search(rf"^{re.escape(walkthrough_spec_path(section))}:(\d+):(\d+): error\[([\w-]+)\]",
                      section, re.M)
    path.write_text(spec.replace("wait before conv\n", "wait after conv\n"))
    with pytest.raises(MkcError) as err:
        compiler.check_spec(path)
    d = err.value.diagnostics[0]
    assert (d.span.line, d.span.column, d.code) == (int(shown[1]), int(shown[2]), shown[3])


def _specs_cells(spec: str) -> tuple[str, str, str, str]:
    """(VMEM B1 / B8, VMEM headroom, HBM used, HBM headroom) of docs/specs.md's row for
    schedules/`spec`.sched, as `mkc check`'s budget gives them (the VMEM cells as they begin:
    a row may add the verify width's peak)."""
    from mkc import compiler, report
    c = compiler.check_spec(ROOT / "schedules" / f"{spec}.sched")
    budget = report.budget(c.ir, c.events)
    peaks = {v["batch"]: v["peak_bytes"] / 2**20 for v in budget["vmem"]}
    limit = budget["vmem_budget_bytes"] / 2**20
    hbm = budget["hbm_per_chip"]
    used, capacity = sum(hbm["bytes"].values()) / 1e9, hbm["capacity_bytes"] / 1e9
    return (f"{peaks[1]:.2f} / {peaks[8]:.2f} of {limit:.2f}", f"{limit - max(peaks.values()):.2f} MiB",
            f"{used:.2f} of {capacity:.1f}", f"{capacity - used:.1f} GB")


def _new_specs_row(spec: str) -> str:
    from mkc import compiler
    s = compiler.check_spec(ROOT / "schedules" / f"{spec}.sched").ir
    return (f"| `{spec}` | <model's name> | {s.chip} | {s.topology.partition('=')[2]} | {s.ranks} | "
            + " | ".join(_specs_cells(spec)) + " |")


def test_the_shipped_specs_table_is_what_mkc_check_reports():
    """Every VMEM and HBM figure of docs/specs.md's table, against `mkc check`'s budget for
    that spec (a table that goes stale fails here); a row for every spec in schedules/."""
    text = (ROOT / "docs" / "specs.md").read_text()
    table = text[text.index("| spec | model | generation |"):]
    table = table[:table.index("\n\n")]
    rows = re.findall(r"^\| `(\w+)` \|(.*)\|$", table, re.M)
    listed, shipped = [spec for spec, _ in rows], sorted(p.stem for p in (ROOT / "schedules").glob("*.sched"))
    missing = [spec for spec in shipped if spec not in listed]
    assert not missing, ("docs/specs.md's table of shipped specs has no row for schedules/"
                         + ", ".join(f"{spec}.sched" for spec in missing) + "; add (the figures are "
                         "`mkc check`'s; docs/extending.md, 'A new model family'):\n"
                         + "\n".join(_new_specs_row(spec) for spec in missing))
    assert sorted(listed) == shipped, f"docs/specs.md's table: a row for no spec, or twice: {listed}"
    for spec, cells in rows:
        vmem_cell, vmem_headroom_cell, hbm_used_cell, hbm_headroom_cell = _specs_cells(spec)
        vmem, vmem_headroom, hbm_used, hbm_headroom = [x.strip() for x in cells.split("|")][-4:]
        assert vmem.startswith(vmem_cell), (spec, vmem, vmem_cell)
        assert vmem_headroom.startswith(vmem_headroom_cell), (spec, vmem_headroom, vmem_headroom_cell)
        assert hbm_used == hbm_used_cell, (spec, hbm_used)
        assert hbm_headroom == hbm_headroom_cell, (spec, hbm_headroom)


def test_the_validation_tables_are_what_validate_perf_recorded():
    """docs/perf.md's tables of the model's error at every published figure and of the assumed
    constants' sensitivities, against `validation` in tpu7x.json (`benchmarks/validate_perf.py
    --markdown` prints them), and the clock JAX's chip table implies."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import validate_perf

    from mkc.perf import constants
    text = (ROOT / "docs" / "perf.md").read_text()
    assert f"which is {constants.rates('tpu7x').clock_hz / 1e9:.3f} GHz on tpu7x" in text
    assert "\n".join(validate_perf.markdown()) in text
    assert "\n".join(validate_perf.hold_out_markdown()) in text


def test_measured_figures_in_docs_are_the_recorded_measures():
    """The compile time of K3's bundle measure, GPT-OSS 20b's spill at 8 rows and the factor
    on an unmeasured geometry's compiler scratch, as docs/ quotes them, against the data and
    code that hold them."""
    import json

    from mkc.checks.capacity import UNMEASURED_SCRATCH_FACTOR
    perf = (ROOT / "docs" / "perf.md").read_text()
    from mkc.compiler import check_spec
    from mkc.perf import bundles
    b1 = bundles.cached(check_spec(ROOT / "schedules" / "kimi_k3.sched").ir, "decode", 1,
                        places=(bundles.DATA,))
    assert f"batch 1 took {b1['compile_seconds']:.0f} s to compile" in perf
    extending = (ROOT / "docs" / "extending.md").read_text()
    scratch = json.loads((ROOT / "mkc" / "families" / "gpt_oss" / "compiler_scratch.json")
                         .read_text())["measures"]
    spill = next(m["spill_bytes"] for m in scratch if m["model"] == "gpt_oss_20b"
                 and m["kernel"] == "decode" and m["rows"] == 8 and m["kv_tokens"] == 128)
    assert f"GPT-OSS 20b spills {spill / 2**20:.1f} MiB at 8 rows" in extending
    for page in ("extending.md", "verification.md"):
        assert f"{UNMEASURED_SCRATCH_FACTOR:g}x" in (ROOT / "docs" / page).read_text(), page


def _family_rows() -> list[tuple[str, str, str, str]]:
    """(spec, VMEM cell, HBM cell, modelled-step cell) of the README's family table."""
    text = README.read_text()
    table = text[text.index("| family | spec |"):]
    table = table[:table.index("\n\n")]
    return [(spec, vmem.strip(), hbm.strip(), steps.strip()) for spec, vmem, hbm, steps in
            re.findall(r"^\| [^|]+ \| `(\w+)` \| [^|]+ \|([^|]+)\|([^|]+)\|([^|]+)\| "
                       r"(?:exact|rounded): [^|]+\|$", table, re.M)]


def test_the_family_table_is_docs_specs_figures():
    """The README's family table: a row per registered family, its VMEM and HBM cells those of
    docs/specs.md's row (which test_the_shipped_specs_table_is_what_mkc_check_reports checks)."""
    from mkc.compiler import check_spec
    from mkc.model import registry
    specs = (ROOT / "docs" / "specs.md").read_text()
    rows = _family_rows()
    families = {check_spec(ROOT / "schedules" / f"{spec}.sched").ir.family for spec, *_ in rows}
    missing = sorted({f.name for f in registry.all_families()} - families)
    assert not missing, (f"the README's family table has no row for {', '.join(missing)}: add one (its "
                         "spec's docs/specs.md figures at B8, `mkc perf --batch 1` and `--batch 8`'s "
                         "modelled steps; docs/extending.md, 'A new model family')")
    assert families == {f.name for f in registry.all_families()}, f"unregistered families: {families}"
    for spec, vmem, hbm, _ in rows:
        cells = [c.strip() for c in re.search(rf"^\| `{spec}` \|(.*)\|$", specs, re.M).group(1).split("|")]
        b8 = re.search(r"/ ([\d.]+ of [\d.]+)", cells[-4]).group(1)
        assert vmem == b8 and cells[-2].startswith(f"{hbm} of"), spec


@pytest.mark.extended
@pytest.mark.parametrize("row", _family_rows(), ids=lambda r: r[0])
def test_the_family_table_s_modelled_steps_are_mkc_perf_s(row, capsys):
    from mkc.cli import main
    spec, _, _, steps = row
    for batch, cell in zip((1, 8), re.findall(r"[\d.]+", steps)):
        assert main(["perf", str(ROOT / "schedules" / f"{spec}.sched"), "--batch", str(batch)]) == 0
        step = float(re.search(r"modelled step: ([\d.]+) ms", capsys.readouterr().out).group(1))
        # the step is printed to 3 decimals and the cell holds 2: a printed 9.215 is either cell
        assert abs(step - float(cell)) <= 0.005 + 1e-9, (spec, batch, step)


def test_the_llama_walkthrough_counts_the_family_s_lines():
    """docs/extending.md's worked example gives each Llama module's length and their total."""
    text = (ROOT / "docs" / "extending.md").read_text()
    section = text[text.index("### From the layer library"):text.index("### A new layer kind")]
    lengths = {p.name: p.read_text().count("\n") for p in (ROOT / "mkc" / "families" / "llama").glob("*.py")}
    assert f"Llama, {sum(lengths.values())} lines)" in section
    for name, n in lengths.items():
        assert re.search(rf"`{re.escape(name)}` \({n}[ ,)]", section), (name, n)
