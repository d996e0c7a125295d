"""A fuzz case: the shipped specs it starts from (`bases`), its outcome classes, and what it
writes (`Case.materialize`)."""
from __future__ import annotations

import functools
import os
import random
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "mkc" / "model" / "configs"
FAILURE_CLASSES = ("traceback", "hang", "memory", "crash", "bad_output", "bad_diagnostic",
                   "fmt_unstable", "fmt_changed_meaning", "lsp_unanswered", "serve_harmed")
CLASSES = ("ok", "diagnostic") + FAILURE_CLASSES

# ---- the base specs ------------------------------------------------------------------------


@dataclass(frozen=True)
class Base:
    name: str
    spec: str            # spec text
    model: str | None    # the --model override (None: the spec's own model line)
    config: str          # shipped config (stem) the check resolves against


@functools.cache
def bases() -> dict[str, Base]:
    """Every shipped spec, checked with a MINI config where one divides its mesh (small traces,
    every construct) and with its own full config where that checks in about a second."""
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import k3_mini_text     # the K3 specs on 2 hosts, as the tests run them
    spec = {p.stem: p.read_text() for p in sorted((ROOT / "schedules").glob("*.sched"))}
    return {"qwen_mini": Base("qwen_mini", spec["qwen3_8_27b"], "qwen3_8_mini", "qwen3_8_mini"),
            "qwen_full": Base("qwen_full", spec["qwen3_8_27b"], None, "qwen3_8_27b"),
            "k3_mini": Base("k3_mini", k3_mini_text(spec["kimi_k3"]), "kimi_k3_mini",
                            "kimi_k3_mini"),
            # replicated sharding: heads over 8 of 16 ranks
            "k3_64_mini": Base("k3_64_mini", k3_mini_text(spec["kimi_k3_64"]), "kimi_k3_mini",
                               "kimi_k3_mini"),
            "qwen16_mini": Base("qwen16_mini", spec["qwen3_8_27b_16"], "qwen3_8_mini",
                                "qwen3_8_mini"),
            # another generation: v6e, a 2-D torus of one-core chips
            "qwen_v6e_mini": Base("qwen_v6e_mini", spec["qwen3_8_27b_v6e"], "qwen3_8_mini",
                                  "qwen3_8_mini"),
            "moe_mini": Base("moe_mini", spec["qwen3_5_35b_a3b"], "qwen3_5_moe_mini",
                             "qwen3_5_moe_mini"),
            "moe_397b_full": Base("moe_397b_full", spec["qwen3_5_397b_a17b"], None,
                                  "qwen3_5_397b_a17b"),
            # drawn by no target's weights: the base of the checkpoint cases on an FP8 MINI
            "deepseek_mini": Base("deepseek_mini", spec["deepseek_v3"], "deepseek_v3_mini_fp8",
                                  "deepseek_v3_mini_fp8")}


PERF_FRACTION = 0.3          # accepted, uncompiled cases whose steps are also modelled
# The step-time model traces the emitted kernel at each batch it models (JAX's tracing, about
# 2 CPU seconds each for a K3 MINI kernel), so a case that models its steps gets this many
# times the timeout.
PERF_TIMEOUT_FACTOR = 3.0


def models_steps(seed: int, index: int) -> bool:
    """Whether case `index` also runs the step-time model when accepted (drawn apart from the
    mutation's stream, so adding it kept every earlier case as it was)."""
    return random.Random(f"mkc-fuzz-perf:{seed}:{index}").random() < PERF_FRACTION


BASE_WEIGHTS = {"qwen_mini": 25, "qwen_full": 8, "k3_mini": 20, "k3_64_mini": 10,
                "qwen16_mini": 10, "qwen_v6e_mini": 8, "moe_mini": 14, "moe_397b_full": 5}

MINI_BASES = {k: v for k, v in BASE_WEIGHTS.items() if k.endswith("_mini")}

# ---- a case --------------------------------------------------------------------------------


@dataclass
class Case:
    seed: int
    index: int
    kind: str
    base: str
    spec: bytes                      # the spec file's bytes
    model: str | None                # --model override, relative to the case directory
    desc: str                        # the mutation, in words
    files: list = field(default_factory=list)   # (op, relpath, payload): see materialize()
    compile: bool = False            # also compile, write and import when the check passes
    perf: bool = False               # else also model its steps (mkc perf) when it passes
    target: str = "check"            # what runs the case (TARGETS)
    argv: list = field(default_factory=list)    # the target's command-line options

    def materialize(self, d: Path) -> Path:
        """Write the spec and the case's files under directory d; the spec path."""
        for op, rel, payload in self.files:
            p = d / rel
            p.parent.mkdir(parents=True, exist_ok=True)
            if op == "file":
                p.write_bytes(payload)
            elif op == "dir":
                p.mkdir(exist_ok=True)
            elif op == "fifo":
                os.mkfifo(p)
            elif op == "symlink":
                os.symlink(payload, p)
            elif op == "checkpoint":             # payload: the name of a fuzz.checkpoint generator
                from fuzz.checkpoint import GENERATORS as generators, spec_text
                described = generators[payload](
                    random.Random(f"mkc-fuzz-checkpoint:{self.seed}:{self.index}"), p)
                # the generator picks the MINI config: the spec and base are the ones it names
                self.desc += f": {described}"
                self.spec = spec_text(described).encode()
                self.base = next(n for n, b in bases().items()
                                 if b.config == described.split(":", 1)[0])
        spec = d / "spec.sched"
        spec.write_bytes(self.spec)
        return spec


def split_lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def shown(s: str, limit: int = 60) -> str:
    r = repr(s)
    return r if len(r) <= limit else f"{r[:limit]}...({len(s)} chars)"


def normalized(msg: str) -> str:
    """A message with its numbers as N, cut: the same failure's signature whatever its sizes."""
    return re.sub(r"\d+", "N", msg)[:80]
