"""The targets a case runs (`TARGETS`), each with its kinds, its run function and its share of
`--target all`; a case as a pure function of (seed, index, target, kind), and its reproducer."""
from __future__ import annotations

import difflib
import importlib
import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from fuzz import check, fmt, retarget
from fuzz.cases import BASE_WEIGHTS, CONFIG_DIR, MINI_BASES, Case, bases, models_steps, shown, split_lines
from fuzz.mutations import MUTATIONS, SPEC_TEXT_KINDS


class TargetUnavailable(Exception):
    """A target's module cannot be imported here (the serve target needs httpx, say)."""


def external(module: str, *names: str) -> list:
    """fuzz.<module>'s attributes `names`; TargetUnavailable says why it cannot be had."""
    try:
        mod = importlib.import_module(f"fuzz.{module}")
    except ImportError as e:
        raise TargetUnavailable(f"tests/fuzz/{module}.py cannot be imported ({e})") from None
    return [getattr(mod, n) for n in names]


@dataclass(frozen=True)
class Target:
    """What a case runs, in the worker: its mutation kinds, how it runs a case (a partial
    outcome, or MkcError/any exception for the shared classification) and its share of
    `--target all`."""
    name: str
    kinds: Callable[[], dict]        # () -> {kind: (generator, weight)}; may raise TargetUnavailable
    run: Callable[[Case, Path, dict], dict]   # (case, its directory, outcome so far) -> outcome fields
    weight: int
    timeout_factor: float = 1.0      # the case's CPU seconds: this times --timeout
    base_weights: dict = field(default_factory=lambda: BASE_WEIGHTS)
    command: str = "mkc check spec.sched"      # for the reproducer


def _imported(module: str) -> dict:
    """A target whose module (`fuzz.<module>`: its `kinds()` and `run`) is imported when a case
    needs it, so a machine without what it imports runs the others."""
    return {"kinds": lambda: external(module, "kinds")[0](),
            "run": lambda case, d, res: external(module, "run")[0](case, d, res)}


TARGETS: dict[str, Target] = {
    "check": Target("check", lambda: MUTATIONS, check.run, 10),
    # formatting is linear in the text (0.25 ms a line here), and a line repeated 5,000 times
    # is formatted twice: about 5 CPU seconds with the worker's start, no hang
    "fmt": Target("fmt", lambda: {k: MUTATIONS[k] for k in SPEC_TEXT_KINDS}, fmt.run, 4,
                  timeout_factor=2.5, command="mkc fmt - < spec.sched (then fmt its output again)"),
    # a retarget that gets past its arguments checks and models a few candidate layouts: seconds
    "retarget": Target("retarget", lambda: retarget.KINDS, retarget.run, 2, timeout_factor=6.0,
                       base_weights={**MINI_BASES, "qwen_full": 5},
                       command="mkc retarget spec.sched"),
    # writing and checking a K3 MINI checkpoint (114 MB; the requantization report reads every
    # expert) takes about 6 CPU seconds
    "checkpoint": Target("checkpoint", **_imported("checkpoint"), weight=2, timeout_factor=4.0,
                         base_weights=MINI_BASES, command="mkc check spec.sched"),
    # the session opens schedules/qwen3_8_27b.sched with its own model line
    "lsp": Target("lsp", **_imported("lsp"), weight=2, timeout_factor=2.0,
                  base_weights={"qwen_full": 1}, command="mkc lsp < session"),
    # a case takes milliseconds of the stand-in; the worker's first starts it (JAX's import
    # and the step's compile: a few CPU seconds)
    "serve": Target("serve", **_imported("serve"), weight=2, timeout_factor=3.0,
                    base_weights={"qwen_full": 1}, command="mkc serve <- hostile requests"),
}


def target_of(seed: int, index: int, target: str = "check") -> str:
    """The target case `index` runs: `target`, or under "all" one drawn apart from the mutation's
    stream among the available targets."""
    if target != "all":
        return target
    names = available_targets()
    return random.Random(f"mkc-fuzz-target:{seed}:{index}").choices(
        names, weights=[TARGETS[n].weight for n in names])[0]


def available_targets() -> list[str]:
    """The targets whose modules are present (check, fmt and retarget always are)."""
    return [name for name in TARGETS if unavailable(name) is None]


def unavailable(name: str) -> str | None:
    """Why target `name` cannot run here, or None."""
    try:
        TARGETS[name].kinds()
    except TargetUnavailable as e:
        return str(e)
    return None


def make_case(seed: int, index: int, compile_fraction: float = 0.2, kind: str | None = None,
              target: str = "check") -> Case:
    """Case `index` of the campaign with this seed (and --kind, --target): a pure function of
    its arguments."""
    target = target_of(seed, index, target)
    t = TARGETS[target]
    generators = t.kinds()
    rng = random.Random(f"mkc-fuzz:{seed}:{index}")
    kinds = list(generators)
    kind = kind or rng.choices(kinds, weights=[generators[k][1] for k in kinds])[0]
    base = rng.choices(list(t.base_weights), weights=list(t.base_weights.values()))[0]
    b = bases()[base]
    case = Case(seed, index, kind, base, b"", b.model, "", target=target)
    text = generators[kind][0](rng, b, case)
    case.spec = text if isinstance(text, bytes) else text.encode("utf-8")
    if target == "check":
        case.compile = case.compile or rng.random() < compile_fraction
        case.perf = models_steps(seed, index)
    else:
        case.compile = False
    return case


def reproducer(case: Case, limit: int = 200) -> str:
    """The case as a diff against its base (spec and config), its files and the command."""
    b = bases()[case.base]
    new = case.spec.decode("utf-8", errors="backslashreplace")
    out = []
    if new != b.spec:
        diff = [ln.rstrip("\n") for ln in
                difflib.unified_diff(split_lines(b.spec), split_lines(new), "base.sched", "spec.sched", n=0)]
        i = 0
        while i < len(diff):                         # runs of one repeated line shown once
            j = i
            while j + 1 < len(diff) and diff[j + 1] == diff[i]:
                j += 1
            ln = diff[i] if diff[i].isprintable() else repr(diff[i])      # odd characters shown
            ln = ln if len(ln) <= limit else f"{ln[:limit]}...({len(ln)} chars)"
            out.append(ln + (f"   [this line {j - i + 1} times]" if j > i else ""))
            i = j + 1
    for op, rel, payload in case.files:
        if op == "file" and (rel.endswith("config.json") or rel == "cfg.json"):
            shipped = (CONFIG_DIR / f"{b.config}.json").read_text()
            text = payload.decode("utf-8", errors="backslashreplace")
            if text == shipped:
                out.append(f"# {rel}: a copy of {b.config}.json")
                continue
            diff = list(difflib.unified_diff(split_lines(json.dumps(json.loads(shipped), indent=2)),
                                             split_lines(text), b.config + ".json", rel, n=0))
            body = diff if len(diff) < 12 else [f"+ {shown(text, limit)}"]
            out += [ln.rstrip("\n")[:limit] for ln in body]
    model = f" --model {case.model!r}" if case.model and case.target != "fmt" else ""
    command = TARGETS[case.target].command.replace(" check ", " compile ") if case.compile else \
        TARGETS[case.target].command
    options = "".join(f" {shown(a, limit // 2)}" for a in case.argv)
    out.append(f"# base {case.base}; {case.desc}")
    out.append(f"# {command}{model}{options}   (files: benchmarks/fuzz_campaign.py --seed "
               f"{case.seed} --only {case.index} --target {case.target} --emit DIR)")
    return "\n".join(out)
