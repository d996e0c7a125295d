"""The `retarget` target: `mkc retarget` with hostile --target, --models and -o values, and spec
mutants to a slice that works."""
from __future__ import annotations

from pathlib import Path

from fuzz.cases import Base, Case, shown
from fuzz.mutations import (GENERATIONS, HUGE_DIGITS, LINE_BREAKS, MUTATIONS, ODD_UNICODE,
                            SPEC_TEXT_KINDS, TOPOLOGIES)


# slices each shipped family retargets to (mkc's tests check them): a case that gets past the
# arguments models its candidates
GOOD_SLICES = ["tpu7x topology 2x2x2", "v6e topology 4x4", "v5p topology 2x2x4", "v6e topology 2x4",
               "tpu7x topology 2x2x1"]
# numbers past int()'s default limit of 4300 digits
HUGE_TOPOLOGIES = ["9" * 5000 + "x1x1", "1x1x" + "9" * 5000, HUGE_DIGITS + "x2", "2x" + "0" * 4400 + "2"]
RETARGET_TOPOLOGIES = TOPOLOGIES + ["-1x2x2", "2x-2x2", "0", "00x02x02", "2x2x2x2x2", "1x" * 300 + "1",
                                    "２x2x2", "2x2x2 ", "2X2X2", "2x2x", "x2x2", "2xx2", ""]
MALFORMED_TARGETS = ["", " ", "tpu7x", "topology 2x2x2", "tpu7x topology", "tpu7x 2x2x2",
                     "tpu7x topology 2x2x2 extra", "TPU7X topology 2x2x2", "tpu7x Topology 2x2x2",
                     "tpu7x topology 2x2x2;", "--json", "-", "tpu7x topology topology 2x2x2",
                     "target tpu7x topology 2x2x2", "tpu7x topology 2x2x2 # a comment",
                     '"tpu7x topology 2x2x2"', "v6e topology 4x4,8", "tpu7x topology 2x2x2\n\n1"]
MODELS_VALUES = ["0", "-1", "1", "2", "3", "100", "2147483648", "9" * 5000, "-" + "9" * 30, "1e3",
                 "", "３", " 2", "0x10"]
# (no absolute device paths: a regression in the guard must not replace one on the machine)
OUTPUT_NAMES = ["spec.sched", ".", "out/", "missing/dir/out.sched", "fifo_link", "class.sched",
                "__init__.sched", "a" * 300 + ".sched", "x y.sched", "-.sched",
                "out.sched/", "spec.sched/../spec.sched", "missing/../spec.sched", "fifo"]


def _retarget_argv(case: Case, slice_text: str, models: str = "3", out: str = "out.sched") -> None:
    # `--opt=value`: a value that starts with '-' is a value, as a shell user would quote it
    case.argv = [f"--target={slice_text}", f"--models={models}", f"--out={out}"]


def rt_generation(rng, b: Base, case: Case):
    gen = rng.choice(GENERATIONS)
    grid = rng.choice(GOOD_SLICES).split()[-1]
    _retarget_argv(case, f"{gen} topology {grid}")
    case.desc = f"--target '{gen} topology {grid}'"
    return b.spec


def rt_topology(rng, b: Base, case: Case):
    gen = rng.choice(["tpu7x", "v6e", "v5p", "v5e"])
    grid = rng.choice(RETARGET_TOPOLOGIES)
    _retarget_argv(case, f"{gen} topology {grid}")
    case.desc = f"--target '{gen} topology {shown(grid, 40)}'"
    return b.spec


def rt_huge(rng, b: Base, case: Case):
    """Numbers past int()'s default limit of 4300 digits: in the topology or in --models."""
    if rng.random() < 0.7:
        gen, grid = rng.choice(["tpu7x", "v6e", "v5p"]), rng.choice(HUGE_TOPOLOGIES)
        _retarget_argv(case, f"{gen} topology {grid}")
        case.desc = f"--target '{gen} topology {shown(grid, 40)}'"
        return b.spec
    models = rng.choice(["9" * 5000, "-" + HUGE_DIGITS])
    _retarget_argv(case, rng.choice(GOOD_SLICES), models)
    case.desc = f"--models {shown(models, 30)}"
    return b.spec


def rt_malformed(rng, b: Base, case: Case):
    text = rng.choice(MALFORMED_TARGETS)
    _retarget_argv(case, text)
    case.desc = f"--target {shown(text, 50)}"
    return b.spec


def rt_spacing(rng, b: Base, case: Case):
    """An odd character or run of white space in a slice that works (some are still that
    slice: white space between its words)."""
    good = rng.choice(GOOD_SLICES)
    pos = rng.randrange(len(good) + 1)
    odd = rng.choice([c for c in ODD_UNICODE + LINE_BREAKS if c != "\x00"] + ["\t", "   ", "\n"])
    text = good[:pos] + odd + good[pos:]
    _retarget_argv(case, text)
    case.desc = f"--target {shown(text, 50)}"
    return b.spec


def rt_models(rng, b: Base, case: Case):
    models = rng.choice(MODELS_VALUES)
    slice_text = rng.choice(GOOD_SLICES)
    _retarget_argv(case, slice_text, models)
    case.desc = f"--target '{slice_text}' --models {shown(models, 30)}"
    return b.spec


def rt_output(rng, b: Base, case: Case):
    out = rng.choice(OUTPUT_NAMES)
    slice_text = rng.choice(GOOD_SLICES)
    case.files += [("fifo", "fifo", None), ("symlink", "fifo_link", "fifo")]
    _retarget_argv(case, slice_text, "1", out)
    case.desc = f"--target '{slice_text}' -o {shown(out, 40)}"
    return b.spec


def rt_mutant(rng, b: Base, case: Case):
    """A mutant of the spec (one of the spec-text kinds) retargeted to a slice that works."""
    kind = rng.choice(SPEC_TEXT_KINDS)
    text = MUTATIONS[kind][0](rng, b, case)
    slice_text = rng.choice(GOOD_SLICES)
    _retarget_argv(case, slice_text, "1")
    case.desc = f"{kind}: {case.desc}; --target '{slice_text}'"
    return text


KINDS = {
    "rt_generation": (rt_generation, 3),
    "rt_topology": (rt_topology, 4),
    "rt_huge": (rt_huge, 2),
    "rt_malformed": (rt_malformed, 3),
    "rt_spacing": (rt_spacing, 3),
    "rt_models": (rt_models, 2),
    "rt_output": (rt_output, 2),
    "rt_mutant": (rt_mutant, 3),
}
# the kinds that change only the spec's text (what `mkc fmt` reads)


def run(case: Case, d: Path, res: dict) -> dict:
    """`mkc retarget spec.sched --target ... --models ... -o ...` as the command line runs it:
    its argument errors are argparse's usage messages; the input must be left as it was and
    what it writes must pass `mkc check`."""
    from mkc import cli, compiler
    from mkc.diagnostics import MkcError
    spec = case.materialize(d)
    argv = ["retarget", str(spec), "--json", *case.argv] + (
        [f"--model={case.model}"] if case.model else [])
    res["stage"] = "arguments"
    try:
        args = cli._parser().parse_args(argv)
    except SystemExit as e:             # argparse's usage error: a message and exit status 2
        if e.code == 2:
            return {"cls": "diagnostic", "codes": ["usage"]}
        raise
    res["stage"] = "retarget"
    try:
        cli._retarget(args, True)
    except OSError as e:                # `mkc` reports it as an E-IO diagnostic
        return {"cls": "diagnostic", "codes": ["E-IO"], "detail": str(e)[:200]}
    if spec.read_bytes() != case.spec:
        return {"cls": "bad_output", "sig": "retarget changed its input spec"}
    res["stage"] = "check the written spec"
    try:
        compiler.check_spec(args.out, case.model)
    except MkcError as e:
        return {"cls": "bad_output", "sig": f"the written spec fails mkc check ({e.codes[0]})",
                "detail": str(e)[:400]}
    return {"cls": "ok"}

