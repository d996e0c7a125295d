"""Fuzz campaign for mkc: seeded mutants of the shipped specs (and hostile arguments,
checkpoints and editor sessions), each run by a target in a worker process with a timeout and
a memory cap, every outcome classified.

    .venv/bin/python benchmarks/fuzz_campaign.py [--cases 10000] [--seed 0] [--workers 2]
        [--timeout 10] [--mem-gib 4] [--compile-fraction 0.2] [--json OUT]
        [--target check|fmt|retarget|checkpoint|lsp|serve|all] [--kind K]
    .venv/bin/python benchmarks/fuzz_campaign.py --seed S --only I [--target T] [--emit DIR]

Mutants start from every shipped spec (`bases()`): checked with a MINI config where one divides
the spec's mesh (the K3 specs moved to 2 hosts, `2x2x2`, `tp = 16`, as the tests run them), and
the 27B Qwen and 397B MoE specs with their own full configs. Mutation kinds: token deletes,
replacements and duplications; numbers replaced by extreme values; non-UTF-8 bytes and odd
unicode; topologies, tile bounds and contexts at the edges (and generations, 2-D and 3-D);
duplicated, swapped, deleted and repeated lines and blocks; truncation; an item of a list
written twice (`gqa: qkv_gate, o_proj, gate_up, down, down`); runs of line breaks other than
"\n" (`\r`, `\u2028`, `\u2029`, `\f`, `\x0b`, `\x85`) inside comments, at line ends or in
place of a line feed; odd model paths (devices, directories, a FIFO, a symlink loop);
config.json files with extreme or mistyped values for each key and malformed documents;
schedule and model names that make bad module names.

Targets (`--target`; `all` draws one per case, apart from the mutation's stream, among those
available; `TARGETS` is the registry, each with its kinds, its run function and its share of
the timeout):

    check       `mkc.compiler.check_spec`; for a sample of accepted cases (and every config,
                model-path and name case) also `compile_spec`, writing the module into a package
                directory and importing it; for a sample of the others the step-time model
                (`mkc perf`'s `perf.run`)
    fmt         `mkc fmt -` on the spec-text mutants: what the parser accepts must format to
                text that parses to the same AST (`mkc.lang.ast.meaning`) with the same
                comments, and formatting that text again must change nothing
    retarget    `mkc retarget` as the command line runs it, with hostile --target strings
                (generations, topologies at the edges and with numbers of 5000 digits,
                malformed text, odd white space), --models values and -o paths, and spec
                mutants to a slice that works; what it writes must pass `mkc check`
    checkpoint  `mkc check SPEC --model ckpt` (and the requantization report) on a MINI
                checkpoint directory made hostile by a generator of
                benchmarks/fuzz_checkpoint.py's GENERATORS (`(rng, dir) -> description`; one
                kind each), SPEC the spec of the MINI config it picked (`spec_text`)
    lsp         `mkc lsp` fed a hostile session (benchmarks/fuzz_lsp.py: `hostile_session(rng)`
                frames, sent one at a time by `run_session`, each owed answer awaited 10 s)
    serve       `mkc serve`'s HTTP API and engine fed hostile requests (benchmarks/fuzz_serve.py:
                bodies, numbers at type edges, wrong types, chat messages and parts, non-Unicode
                text, routes, streams, several at once), each beside good requests; the server
                is the API over the tests' stand-in module in the worker, or a running `mkc
                serve` at MKC_FUZZ_SERVE_URL

A target whose module is missing is reported as unavailable (`--target all` skips it).
Outcome classes:

    ok             accepted (and, when compiled, the module imports)
    diagnostic     MkcError whose diagnostics all have file, line, column and hint, and render
                   (retarget: also argparse's usage error and `mkc`'s E-IO for an OSError)
    bad_diagnostic MkcError with a diagnostic lacking a location or hint, or failing to render
    traceback      any other exception (signature: type and innermost mkc frame); lsp: a
                   traceback on the server's stderr or in an answer
    bad_output     accepted, but the written module fails on import, overwrites a file it did
                   not create, or has a name that is not a safe module name; a retargeted spec
                   that fails `mkc check`, or a retarget that changed its input
    fmt_unstable   formatting the formatted text changes it again
    fmt_changed_meaning  the formatted text does not parse, or parses to another AST, or its
                   comments differ (trailing white space aside)
    hang           more CPU seconds than the case's timeout (--timeout times its target's
                   factor, the CPU of an lsp case's server included), or a minute of wall time
                   blocked without computing (signature: the outermost mkc frames of a stack
                   dump taken at the deadline); the worker is restarted;
                   lsp: a server that does not exit after shutdown and exit
    memory         MemoryError under the address-space cap
    crash          the worker process died; lsp: the server died or exited with a nonzero status
    lsp_unanswered a request of the session got no answer (result or JSON-RPC error)
    serve_harmed   a good request beside the hostile ones failed or answered otherwise than alone
                   (serve's other verdicts: a 5xx is a traceback, a refusal without OpenAI's
                   error body or an error event in a stream bad_output, no answer in 20 s a
                   hang, a dropped connection or a /health that stops answering a crash)

A case is a pure function of (seed, index) and the --target and --kind asked for, so `--only I`
reproduces it and `--emit DIR` writes its spec and files. Signatures of targets other than
check start with `[target]`. The exit status is 1 if any case is outside ok/diagnostic.
`tests/test_fuzz_specs.py` runs a smaller seeded campaign through the same generators.
"""
from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import random
import re
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
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
            elif op == "checkpoint":             # payload: the name of a fuzz_checkpoint generator
                generators, spec_text = _external("fuzz_checkpoint", "GENERATORS", "spec_text")
                described = generators[payload](
                    random.Random(f"mkc-fuzz-checkpoint:{self.seed}:{self.index}"), p)
                # the generator picks the MINI config: the spec and base are the ones it names
                self.desc += f": {described}"
                self.spec = spec_text(described).encode()
                self.base = next(n for n, b in (_BASES or bases()).items()
                                 if b.config == described.split(":", 1)[0])
        spec = d / "spec.sched"
        spec.write_bytes(self.spec)
        return spec


# ---- mutation generators -------------------------------------------------------------------

TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|\d+x\d+(?:x\d+)?|\d+|->|\"[^\"]*\"|[{}:;,=()/]")
REPLACEMENTS = ["0", "1", "3", "7", "999999999", "x", "gdn", "gqa", "start", "end", "next",
                "wait", "load", "store", "{", "}", ";", ",", "->", '"qwen3_8_mini"', "bf16",
                "f32", "tp", "state.conv", "before", "after", "two_level", "host", "chip",
                "kda", "mla", "moe", "dense", "pool", "view", "slots", "expert", "prefetch",
                "fetch", "experts", "allgather", "exchange", "sibling", "staging.experts",
                "staging.attention", "/", "(", ")", "route", "routed_experts", "over", "scoped",
                "kv", "tiles", "ring", "stream", "then", "lm_head", "parity", "vectors", "mesh",
                "shard", "phase", "schedule", "model", "target", "batch", "context", "vmem",
                "limit", "reserve", "MiB", "GiB", "KiB", "2x2x1", "direct", "wire", "with",
                "verify", "sequences", "to", "8", "16", "32", "heads", "mlp", "vocab",
                "expert_mlp", "latent_up", "tpu7x", "v6e", "v5e", "v5p", "v4", "2x4", "2x2x8",
                "moe", "shared_gate_up", "router", "gate_up", "down", "attention"]
HUGE_DIGITS = "1" + "0" * 4300                     # 4301 digits: past int()'s default limit
EXTREME_INTS = ["0", "1", "2", "127", "128", "129", "255", "2147483647", "2147483648",
                "4294967296", "9223372036854775807", "9223372036854775808",
                "18446744073709551616", "999999999999999999999999999999", HUGE_DIGITS,
                "9" * 5000, "00", "0008"]
TOPOLOGIES = ["99999999x2x1", "0x0x0", "0x2x2", "2x2x0", "1x1x1", "1x1x2", "2x1x1", "4x4x4",
              "2x2x8", "16x16x16", "2147483648x1x1", "9223372036854775808x1x1", "1x1x99999999",
              "2x2x1", "2x2x2", "2x2x4", "1" * 30 + "x1x1", "2x4", "4x4", "1x1", "2x2", "8x16",
              "0x4", "2x4x1x1", "2", "4x8", "16x16", "99999999x99999999"]
# generations JAX knows, ones it refuses (v2, v3, v4i) and ones that do not exist
GENERATIONS = ["tpu7x", "v6e", "v5e", "v5p", "v4", "v4i", "v3", "v2", "v7", "tpu8", "TPU7X",
               "v5litepod", "v6 lite"]
TILE_BOUNDS = ["2147483648 x 1280", "1024 x 2147483648", "0 x 0", "1 x 1", "128 x 128",
               "127 x 1280", "1024 x 127", "9223372036854775808 x 9223372036854775808",
               "99999999 x 99999999", "256 x 256", "4096 x 4096", "65536 x 65536", "129 x 129"]
CONTEXTS = ["0", "1", "2", "127", "128", "129", "4097", "65536", "1048576", "16777216",
            "2147483648", "1099511627776", "1000000000000000000000000000000"]
ODD_UNICODE = ["\u00a0", "\u200b", "\u202e", "\ufeff", "é", "１", "٣", "\u2028", "\u0085",
               "\x00", "\x0c", "\x0b", "\x1b", "\r", "\t", "𝟘", "ǅ", "ﬁ", "İ", "\U0001F600",
               "\u0301", "ß", "K"]
BAD_BYTES = [b"\xff", b"\xfe", b"\x80", b"\xc3\x28", b"\xe9", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
             b"\xc0\xaf", b"\xe2\x82"]
NAMES = ["__init__", "os", "sys", "class", "None", "True", "import", "jax", "numpy", "mkc",
         "__main__", "_", "a" * 300, "types", "functools", "np", "lax", "pl", "builtins",
         "generated", "test", "pytest", "json", "model", "schedule"]
MODEL_DIR_NAMES = ["my-model", "1model", "model.v2", "mödel", "a b", "__init__", "class", "os",
                   "None", "", "-", "x" * 250]


def _token_spans(text: str) -> list[tuple[int, int]]:
    comments = [m.span() for m in re.finditer(r"#[^\n]*", text)]
    return [m.span() for m in TOKEN.finditer(text)
            if not any(a <= m.start() < b for a, b in comments)]


def _int_spans(text: str) -> list[tuple[int, int]]:
    """Every integer a parser reads: INT tokens and the three numbers of a topology."""
    comments = [m.span() for m in re.finditer(r"#[^\n]*", text)]
    spans = [m.span() for m in re.finditer(r"(?<![A-Za-z0-9_])\d+(?=x\d|[^A-Za-z0-9_]|$)|(?<=\dx)\d+",
                                           text)]
    return [s for s in spans if not any(a <= s[0] < b for a, b in comments)]


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def _code_lines(text: str) -> list[int]:
    return [i for i, ln in enumerate(_lines(text)) if ln.strip() and not ln.strip().startswith("#")]


def _show(s: str, limit: int = 60) -> str:
    r = repr(s)
    return r if len(r) <= limit else f"{r[:limit]}...({len(s)} chars)"


def _sub(text: str, span: tuple[int, int], new: str) -> str:
    return text[:span[0]] + new + text[span[1]:]


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"{line}:{pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def mut_token_delete(rng, b: Base, case: Case):
    s = rng.choice(_token_spans(b.spec))
    case.desc = f"delete token {_show(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])}"
    return _sub(b.spec, s, "")


def mut_token_replace(rng, b: Base, case: Case):
    s = rng.choice(_token_spans(b.spec))
    new = rng.choice(REPLACEMENTS)
    case.desc = f"replace token {_show(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])} with {new!r}"
    return _sub(b.spec, s, new)


def mut_token_duplicate(rng, b: Base, case: Case):
    s = rng.choice(_token_spans(b.spec))
    case.desc = f"duplicate token {_show(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])}"
    return b.spec[:s[1]] + " " + b.spec[s[0]:s[1]] + b.spec[s[1]:]


def mut_number_extreme(rng, b: Base, case: Case):
    s = rng.choice(_int_spans(b.spec))
    new = rng.choice(EXTREME_INTS)
    case.desc = f"number {b.spec[s[0]:s[1]]} at {_where(b.spec, s[0])} -> {_show(new, 30)}"
    return _sub(b.spec, s, new)


def mut_topology(rng, b: Base, case: Case):
    m = re.search(r"target\s+(\S+)\s+topology\s+(\S+)", b.spec)
    topo = rng.choice(TOPOLOGIES)
    text = _sub(b.spec, m.span(2), topo)
    case.desc = f"topology {m.group(2)} -> {_show(topo, 40)}"
    if rng.random() < 0.3:                      # and another generation
        gen = rng.choice(GENERATIONS)
        text = _sub(text, m.span(1), gen)
        case.desc = f"target {m.group(1)} -> {gen}, " + case.desc
    if rng.random() < 0.5:                      # and a mesh over every core of it
        cores = rng.choice([1, 2]) * math.prod(int(v) for v in topo.split("x") if v.isdigit())
        text = re.sub(r"tp = \d+", f"tp = {cores}", text)
        case.desc += f", mesh tp = {_show(str(cores), 40)}"
    return text


def mut_tile_bound(rng, b: Base, case: Case):
    m = re.search(r"up to (\d+ x \d+)", b.spec)
    new = rng.choice(TILE_BOUNDS)
    case.desc = f"ring tile bound {m.group(1)} -> {new}"
    return _sub(b.spec, m.span(1), new)


def mut_context(rng, b: Base, case: Case):
    m = re.search(r"context (\d+)", b.spec)
    new = rng.choice(CONTEXTS)
    case.desc = f"context {m.group(1)} -> {new}"
    return _sub(b.spec, m.span(1), new)


def mut_unicode(rng, b: Base, case: Case):
    ch = rng.choice(ODD_UNICODE)
    spans = _token_spans(b.spec)
    mode = rng.randrange(4)
    if mode == 0:                                   # inside a token
        s = rng.choice(spans)
        pos = rng.randrange(s[0], s[1] + 1)
        case.desc = f"insert {ch!r} into token {_show(b.spec[s[0]:s[1]])} at {_where(b.spec, pos)}"
        return b.spec[:pos] + ch + b.spec[pos:]
    if mode == 1:                                   # between tokens
        s = rng.choice(spans)
        case.desc = f"insert {ch!r} before token {_show(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])}"
        return b.spec[:s[0]] + ch + " " + b.spec[s[0]:]
    if mode == 2:                                   # replace a token's character
        s = rng.choice(spans)
        pos = rng.randrange(s[0], s[1])
        case.desc = f"replace {b.spec[pos]!r} at {_where(b.spec, pos)} with {ch!r}"
        return b.spec[:pos] + ch + b.spec[pos + 1:]
    case.desc = f"prepend {ch!r} to the file"       # e.g. a BOM
    return ch + b.spec


def mut_bytes(rng, b: Base, case: Case):
    raw = b.spec.encode()
    bad = rng.choice(BAD_BYTES)
    mode = rng.randrange(4)
    if mode == 0:
        pos = rng.randrange(len(raw) + 1)
        case.desc = f"insert bytes {bad!r} at byte {pos}"
        return raw[:pos] + bad + raw[pos:]
    if mode == 1:
        pos = raw.index(b"#")
        case.desc = f"insert bytes {bad!r} in the first comment"
        return raw[:pos + 1] + bad + raw[pos + 1:]
    if mode == 2:
        pos = raw.index(b'"') + 1
        case.desc = f"insert bytes {bad!r} inside the model string"
        return raw[:pos] + bad + raw[pos:]
    enc = rng.choice(["utf-16", "utf-32", "latin-1"])
    case.desc = f"the whole file encoded as {enc}"
    return (b.spec.replace("#", "# é", 1)).encode(enc)


def mut_line_duplicate(rng, b: Base, case: Case):
    lines = _lines(b.spec)
    i = rng.choice(_code_lines(b.spec))
    case.desc = f"duplicate line {i + 1}: {lines[i].strip()!r}"
    return "".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])


def mut_line_swap(rng, b: Base, case: Case):
    lines = _lines(b.spec)
    code = _code_lines(b.spec)
    i = rng.choice(code)
    j = rng.choice([k for k in code if abs(k - i) <= 2 and k != i] if rng.random() < 0.6 else code)
    if i == j:
        j = code[(code.index(i) + 1) % len(code)]
    lines[i], lines[j] = lines[j], lines[i]
    case.desc = f"swap lines {min(i, j) + 1} and {max(i, j) + 1}"
    return "".join(lines)


def mut_line_delete(rng, b: Base, case: Case):
    lines = _lines(b.spec)
    i = rng.choice(_code_lines(b.spec))
    case.desc = f"delete line {i + 1}: {lines[i].strip()!r}"
    return "".join(lines[:i] + lines[i + 1:])


def mut_line_repeat(rng, b: Base, case: Case):
    lines = _lines(b.spec)
    i = rng.choice(_code_lines(b.spec))
    n = rng.choice([3, 10, 100, 1000, 5000])
    case.desc = f"repeat line {i + 1} {n} times: {lines[i].strip()!r}"
    return "".join(lines[:i + 1] + [lines[i]] * (n - 1) + lines[i + 1:])


def _blocks(text: str) -> list[tuple[int, int]]:
    """(first, last) line indexes of the `{ ... }` blocks inside the schedule."""
    lines = _lines(text)
    out = []
    for i, ln in enumerate(lines):
        if ln.startswith("  ") and not ln.startswith("   ") and ln.rstrip().endswith("{"):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].rstrip() == "  }")
            out.append((i, j))
    return out


def mut_block(rng, b: Base, case: Case):
    lines = _lines(b.spec)
    i, j = rng.choice(_blocks(b.spec))
    head = lines[i].strip()
    mode = rng.randrange(3)
    if mode == 0:
        case.desc = f"duplicate block {head!r} (lines {i + 1}-{j + 1})"
        return "".join(lines[:j + 1] + lines[i:j + 1] + lines[j + 1:])
    if mode == 1:
        case.desc = f"delete block {head!r} (lines {i + 1}-{j + 1})"
        return "".join(lines[:i] + lines[j + 1:])
    n = rng.choice([10, 200])
    case.desc = f"repeat block {head!r} {n} times"
    return "".join(lines[:j + 1] + lines[i:j + 1] * (n - 1) + lines[j + 1:])


def mut_truncate(rng, b: Base, case: Case):
    pos = rng.randrange(len(b.spec))
    case.desc = f"truncate at {_where(b.spec, pos)} (char {pos} of {len(b.spec)})"
    return b.spec[:pos]



_ITEM = r"[A-Za-z_][\w.]*(?:\s*->\s*[A-Za-z_][\w.]*)?"        # `o_proj`, `state.conv -> conv_buf`
# a comma-separated list (two or more items), or one item alone after `KEY:` (a stream line)
_LIST = re.compile(rf"{_ITEM}(?:[ \t]*,[ \t]*{_ITEM})+|(?<=:)[ \t]*{_ITEM}(?=[ \t]*(?:#|$))", re.M)


def _lists(text: str) -> list[tuple[int, int]]:
    """Spans of the item lists outside comments and strings."""
    skip = [m.span() for m in re.finditer(r'"[^"\n]*"|#[^\n]*', text)]
    return [m.span() for m in _LIST.finditer(text)
            if not any(a <= m.start() < b or a < m.end() <= b for a, b in skip)]


def mut_list_duplicate(rng, b: Base, case: Case):
    """An item of a list written twice: at the list's end (`..., down, down`) or beside itself."""
    lo, hi = rng.choice(_lists(b.spec))
    items = [m for m in re.finditer(_ITEM, b.spec[lo:hi])]
    item = rng.choice(items)
    word = item.group()
    if rng.random() < 0.5:
        case.desc = f"list at {_where(b.spec, lo)}: {word!r} again at the end"
        return b.spec[:hi] + ", " + word + b.spec[hi:]
    at = lo + item.end()
    case.desc = f"list at {_where(b.spec, lo)}: {word!r} again after itself"
    return b.spec[:at] + ", " + word + b.spec[at:]


# what str.splitlines() (and editors) break lines at, besides "\n"; lark counts only "\n"
LINE_BREAKS = ["\r", "\u2028", "\u2029", "\f", "\x0b", "\x85"]


def mut_line_break(rng, b: Base, case: Case):
    """A run of odd line-break characters inside a comment, at a line's end, in place of a
    line's "\n", or every line end written "\r" or "\r\n"."""
    run = "".join(rng.choice(LINE_BREAKS) for _ in range(rng.choice([1, 1, 2, 3])))
    lines = _lines(b.spec)
    comment = [i for i, ln in enumerate(lines) if "#" in ln]
    mode = rng.randrange(6)
    if mode == 5:
        end = rng.choice(["\r", "\r\n"])
        case.desc = f"every line ends in {end!r}"
        return b.spec.replace("\n", end)
    i = rng.choice(comment if mode in (0, 1, 3) else _code_lines(b.spec))
    ln = lines[i]
    body = ln.rstrip("\n")
    if mode == 0:                                       # inside a comment
        pos = rng.randrange(ln.index("#") + 1, len(body) + 1)
        lines[i] = ln[:pos] + run + ln[pos:]
        case.desc = f"{run!r} inside the comment on line {i + 1}"
    elif mode in (1, 2):                                # at the end of a (comment or code) line
        lines[i] = body + run + ln[len(body):]
        case.desc = f"{run!r} at the end of line {i + 1}"
    else:                                               # in place of the line's "\n"
        lines[i] = body + run
        case.desc = f"{run!r} in place of line {i + 1}'s line feed"
    return "".join(lines)


MODEL_PATHS = ["/dev/zero", "/dev/null", "/dev/urandom", "/", ".", "..", "", "emptydir",
               "dir_with_dir_config", "fifo", "loop", "dangling", "/etc/passwd", "/etc",
               "/proc/self/status", "qwen3_8_mini\x00", "x" * 5000, "a/" * 3000 + "config.json",
               "~/config.json", "*", "qwen3_8_mini.json", "configs/qwen3_8_mini", "-", "\u202e",
               "empty.json", "spec.sched", "../../../../../../etc/hostname"]


def mut_model_path(rng, b: Base, case: Case):
    path = rng.choice(MODEL_PATHS)
    case.files += [("dir", "emptydir", None), ("dir", "dir_with_dir_config/config.json", None),
                   ("fifo", "fifo", None), ("symlink", "loop", "loop"),
                   ("symlink", "dangling", "nowhere/config.json"), ("file", "empty.json", b"")]
    if rng.random() < 0.5:
        case.model = path
        case.desc = f"--model {_show(path, 50)}"
        return b.spec
    case.model = None
    case.desc = f"model line {_show(path, 50)}"
    return re.sub(r'model\s+"[^"]*"', lambda _: 'model "' + path.replace('"', "") + '"', b.spec,
                  count=1)


def _leaves(obj, path=()):
    """(path, value) of every leaf and every container below the root."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + (k,), v
            if isinstance(v, (dict, list)):
                yield from _leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield path + (i,), v
            if isinstance(v, (dict, list)):
                yield from _leaves(v, path + (i,))


NUMERIC_VALUES = ["NaN", "Infinity", "-Infinity", "-1", "0", "1", "2147483648",
                  "9223372036854775808", "1e30", "1000000000000000000000000000000", "1e308",
                  "1e-320", "0.5", "1.0000001", "-0.0", HUGE_DIGITS, "true", '"8"', "null", "[]"]
OTHER_VALUES = ["null", "[]", "{}", '"x"', "1", "[1, 2]", "NaN", "true", '""']


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


_DELETE = object()


def _config_text(raw: dict, path, literal: str | None) -> str:
    """The config with the value at path replaced by a JSON literal (or deleted if None)."""
    raw = json.loads(json.dumps(raw))
    if literal is None:
        _set(raw, path, _DELETE)
        return json.dumps(raw, indent=2)
    _set(raw, path, "@@VALUE@@")
    return json.dumps(raw, indent=2).replace('"@@VALUE@@"', literal)


def _use_config(rng, b: Base, case: Case, text: bytes, what: str) -> str:
    if rng.random() < 0.5:
        case.files.append(("file", "cfg/config.json", text))
        where = "cfg"
    else:
        case.files.append(("file", "cfg.json", text))
        where = "cfg.json"
    if rng.random() < 0.7:
        case.model = where
        case.desc = f"--model {where} with {what}"
        return b.spec
    case.model = None
    case.desc = f"model line {where!r} with {what}"
    return re.sub(r'model\s+"[^"]*"', f'model "{where}"', b.spec, count=1)


def mut_config_value(rng, b: Base, case: Case):
    raw = json.loads((CONFIG_DIR / f"{b.config}.json").read_text())
    path, value = rng.choice(list(_leaves(raw)))
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    literal = rng.choice(NUMERIC_VALUES if numeric else OTHER_VALUES)
    if rng.random() < 0.05:
        literal = None
    key = ".".join(map(str, path))
    what = f"{key} deleted" if literal is None else f"{key} = {_show(literal, 30)}"
    case.compile = True
    return _use_config(rng, b, case, _config_text(raw, path, literal).encode(), f"config {what}")


CONFIG_DOCUMENTS = [("an empty file", b""), ("[]", b"[]"), ("null", b"null"), ("1", b"1"),
                    ('"x"', b'"x"'), ("{", b"{"), ("nesting 100000 deep", b"[" * 100000),
                    ("nesting 100000 deep objects", b'{"a":' * 100000),
                    ("a UTF-8 BOM", "\ufeff{}".encode()), ("a latin-1 byte", b'{"x": "\xe9"}'),
                    ("a 1 MB string value", b'{"model_type": "' + b"a" * (1 << 20) + b'"}'),
                    ("a NUL byte", b'{"model_type"\x00: 1}')]


def mut_config_document(rng, b: Base, case: Case):
    raw = json.loads((CONFIG_DIR / f"{b.config}.json").read_text())
    mode = rng.randrange(4)
    if mode == 0:
        what, text = rng.choice(CONFIG_DOCUMENTS)
    elif mode == 1:                                  # a non-UTF-8 byte in an otherwise good config
        good = json.dumps(raw, indent=2).encode()
        pos = good.index(b'"dtype"') + 1
        what, text = "a \\xff byte in a key", good[:pos] + b"\xff" + good[pos:]
    elif mode == 2:                                  # keys repeated (the last one wins in json)
        good = json.dumps(raw, indent=2)
        what, text = "model_type repeated with another family", (
            good[:-2] + ',\n  "model_type": "llama"\n}').encode()
    else:                                            # the whole file as UTF-16
        what, text = "UTF-16 encoded", json.dumps(raw).encode("utf-16")
    case.compile = True
    return _use_config(rng, b, case, text, f"a config.json of {what}")


def mut_names(rng, b: Base, case: Case):
    text = b.spec
    m = re.search(r"schedule (\w+)", text)
    case.compile = True
    mode = rng.randrange(3)
    if mode == 0:                                    # a schedule name
        name = rng.choice(NAMES)
        case.desc = f"schedule name {_show(name, 40)}"
        return _sub(text, m.span(1), name)
    if mode == 1:                                    # the same name for schedule and model dir
        name = rng.choice(NAMES)[:250]               # a directory name the OS accepts
        case.files.append(("file", f"{name}/config.json",
                           (CONFIG_DIR / f"{b.config}.json").read_bytes()))
        case.model = name
        case.desc = f"schedule name and --model directory {_show(name, 40)}"
        return _sub(text, m.span(1), name)
    dirname = rng.choice(MODEL_DIR_NAMES)           # an odd model directory name
    rel = f"{dirname}/config.json" if dirname else "config.json"
    case.files.append(("file", rel, (CONFIG_DIR / f"{b.config}.json").read_bytes()))
    case.model = dirname or "."
    case.desc = f"--model directory {_show(case.model, 40)}"
    return text


# kind -> (generator, weight)
MUTATIONS = {
    "token_delete": (mut_token_delete, 10),
    "token_replace": (mut_token_replace, 14),
    "token_duplicate": (mut_token_duplicate, 8),
    "number_extreme": (mut_number_extreme, 10),
    "topology": (mut_topology, 4),
    "tile_bound": (mut_tile_bound, 3),
    "context": (mut_context, 3),
    "unicode": (mut_unicode, 5),
    "bytes": (mut_bytes, 3),
    "line_duplicate": (mut_line_duplicate, 5),
    "line_swap": (mut_line_swap, 5),
    "line_delete": (mut_line_delete, 4),
    "line_repeat": (mut_line_repeat, 2),
    "block": (mut_block, 3),
    "truncate": (mut_truncate, 2),
    "list_duplicate": (mut_list_duplicate, 5),
    "line_break": (mut_line_break, 5),
    "model_path": (mut_model_path, 4),
    "config_value": (mut_config_value, 10),
    "config_document": (mut_config_document, 2),
    "names": (mut_names, 4),
}
# ---- retarget's arguments -----------------------------------------------------------------

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
    case.desc = f"--target '{gen} topology {_show(grid, 40)}'"
    return b.spec


def rt_huge(rng, b: Base, case: Case):
    """Numbers past int()'s default limit of 4300 digits: in the topology or in --models."""
    if rng.random() < 0.7:
        gen, grid = rng.choice(["tpu7x", "v6e", "v5p"]), rng.choice(HUGE_TOPOLOGIES)
        _retarget_argv(case, f"{gen} topology {grid}")
        case.desc = f"--target '{gen} topology {_show(grid, 40)}'"
        return b.spec
    models = rng.choice(["9" * 5000, "-" + HUGE_DIGITS])
    _retarget_argv(case, rng.choice(GOOD_SLICES), models)
    case.desc = f"--models {_show(models, 30)}"
    return b.spec


def rt_malformed(rng, b: Base, case: Case):
    text = rng.choice(MALFORMED_TARGETS)
    _retarget_argv(case, text)
    case.desc = f"--target {_show(text, 50)}"
    return b.spec


def rt_spacing(rng, b: Base, case: Case):
    """An odd character or run of white space in a slice that works (some are still that
    slice: white space between its words)."""
    good = rng.choice(GOOD_SLICES)
    pos = rng.randrange(len(good) + 1)
    odd = rng.choice([c for c in ODD_UNICODE + LINE_BREAKS if c != "\x00"] + ["\t", "   ", "\n"])
    text = good[:pos] + odd + good[pos:]
    _retarget_argv(case, text)
    case.desc = f"--target {_show(text, 50)}"
    return b.spec


def rt_models(rng, b: Base, case: Case):
    models = rng.choice(MODELS_VALUES)
    slice_text = rng.choice(GOOD_SLICES)
    _retarget_argv(case, slice_text, models)
    case.desc = f"--target '{slice_text}' --models {_show(models, 30)}"
    return b.spec


def rt_output(rng, b: Base, case: Case):
    out = rng.choice(OUTPUT_NAMES)
    slice_text = rng.choice(GOOD_SLICES)
    case.files += [("fifo", "fifo", None), ("symlink", "fifo_link", "fifo")]
    _retarget_argv(case, slice_text, "1", out)
    case.desc = f"--target '{slice_text}' -o {_show(out, 40)}"
    return b.spec


def rt_mutant(rng, b: Base, case: Case):
    """A mutant of the spec (one of the spec-text kinds) retargeted to a slice that works."""
    kind = rng.choice(SPEC_TEXT_KINDS)
    text = MUTATIONS[kind][0](rng, b, case)
    slice_text = rng.choice(GOOD_SLICES)
    _retarget_argv(case, slice_text, "1")
    case.desc = f"{kind}: {case.desc}; --target '{slice_text}'"
    return text


RETARGET_KINDS = {
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
SPEC_TEXT_KINDS = [k for k in MUTATIONS if k not in ("model_path", "config_value", "config_document")]


# ---- the targets ---------------------------------------------------------------------------


class TargetUnavailable(Exception):
    """An external target's module is missing or lacks what the campaign calls."""


def _external(module: str, *names: str):
    """benchmarks/<module>.py's attributes `names`; TargetUnavailable says what is missing."""
    import importlib
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)
    try:
        mod = importlib.import_module(module)
    except ImportError as e:
        raise TargetUnavailable(f"benchmarks/{module}.py cannot be imported ({e})") from None
    missing = [n for n in names if not hasattr(mod, n)]
    if missing:
        raise TargetUnavailable(f"benchmarks/{module}.py lacks {', '.join(missing)}")
    return [getattr(mod, n) for n in names]


def _checkpoint_kinds() -> dict:
    """fuzz_checkpoint's generators, each `(rng, dir) -> description`, as kinds: the case checks
    `--model ckpt`, a directory the generator fills when the case is written, with the spec of
    the MINI config it picked (`spec_text(description)`, which also sets the case's base)."""
    (generators,) = _external("fuzz_checkpoint", "GENERATORS")

    def kind(name):
        def make(rng, b: Base, case: Case):
            case.files.append(("checkpoint", "ckpt", name))
            case.model = "ckpt"
            case.desc = f"checkpoint from fuzz_checkpoint.{name} (the MINI config it picks sets the spec)"
            return b.spec
        return make
    return {name: (kind(name), 1) for name in generators}


def _lsp_kinds() -> dict:
    """One kind: a hostile session (fuzz_lsp.hostile_session) drawn in the worker."""
    _external("fuzz_lsp", "hostile_session", "run_session")

    def make(rng, b: Base, case: Case):
        case.desc = "a hostile LSP session (benchmarks/fuzz_lsp.py)"
        return b.spec
    return {"lsp_session": (make, 1)}


def _serve_kinds() -> dict:
    """fuzz_serve's kinds: the case's hostile requests are drawn in the worker."""
    (kinds,) = _external("fuzz_serve", "KINDS")

    def kind(name):
        def make(rng, b: Base, case: Case):
            case.desc = f"hostile HTTP requests of kind {name} (benchmarks/fuzz_serve.py)"
            case.model = ""              # the server's model is the worker's, not the case's
            return b.spec
        return make
    return {name: (kind(name), weight) for name, (_, weight) in kinds.items()}


@dataclass(frozen=True)
class Target:
    """What a case runs, in the worker: its mutation kinds, how it runs a case (a partial
    outcome, or MkcError/any exception for the shared classification) and its share of
    `--target all`."""
    name: str
    kinds: object                    # () -> {kind: (generator, weight)}; may raise TargetUnavailable
    run: object                      # (case, case directory, outcome so far) -> outcome fields
    weight: int
    timeout_factor: float = 1.0      # the case's CPU seconds: this times --timeout
    base_weights: dict = field(default_factory=lambda: BASE_WEIGHTS)
    command: str = "mkc check spec.sched"      # for the reproducer


MINI_BASES = {k: v for k, v in BASE_WEIGHTS.items() if k.endswith("_mini")}
TARGETS: dict[str, Target] = {}      # filled below the worker's run functions


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
    return [name for name in TARGETS if _unavailable(name) is None]


def _unavailable(name: str) -> str | None:
    """Why target `name` cannot run here, or None."""
    try:
        TARGETS[name].kinds()
    except TargetUnavailable as e:
        return str(e)
    return None


_BASES = None


def make_case(seed: int, index: int, compile_fraction: float = 0.2, kind: str | None = None,
              target: str = "check") -> Case:
    """Case `index` of the campaign with this seed (and --kind, --target): a pure function of
    its arguments."""
    global _BASES
    if _BASES is None:
        _BASES = bases()
    target = target_of(seed, index, target)
    t = TARGETS[target]
    generators = t.kinds()
    rng = random.Random(f"mkc-fuzz:{seed}:{index}")
    kinds = list(generators)
    kind = kind or rng.choices(kinds, weights=[generators[k][1] for k in kinds])[0]
    base = rng.choices(list(t.base_weights), weights=list(t.base_weights.values()))[0]
    b = _BASES[base]
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
    b = (_BASES or bases())[case.base]
    new = case.spec.decode("utf-8", errors="backslashreplace")
    out = []
    if new != b.spec:
        diff = [ln.rstrip("\n") for ln in
                difflib.unified_diff(_lines(b.spec), _lines(new), "base.sched", "spec.sched", n=0)]
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
            diff = list(difflib.unified_diff(_lines(json.dumps(json.loads(shipped), indent=2)),
                                             _lines(text), b.config + ".json", rel, n=0))
            body = diff if len(diff) < 12 else [f"+ {_show(text, limit)}"]
            out += [ln.rstrip("\n")[:limit] for ln in body]
    model = f" --model {case.model!r}" if case.model and case.target != "fmt" else ""
    command = TARGETS[case.target].command.replace(" check ", " compile ") if case.compile else \
        TARGETS[case.target].command
    options = "".join(f" {_show(a, limit // 2)}" for a in case.argv)
    out.append(f"# base {case.base}; {case.desc}")
    out.append(f"# {command}{model}{options}   (files: benchmarks/fuzz_campaign.py --seed "
               f"{case.seed} --only {case.index} --target {case.target} --emit DIR)")
    return "\n".join(out)


# ---- the worker ----------------------------------------------------------------------------

def _mkc_frame(tb_frames, mkc_dir: str) -> str:
    inner = [f for f in tb_frames if f.filename.startswith(mkc_dir)]
    if not inner:
        return "no mkc frame"
    f = inner[-1]
    return f"mkc/{os.path.relpath(f.filename, mkc_dir)}:{f.name}"


def _norm(msg: str) -> str:
    return re.sub(r"\d+", "N", msg)[:80]


def _safe_module_name(name: str) -> str | None:
    import keyword
    if not name.isidentifier() or not name.isascii():
        return "module name is not an ASCII identifier"
    if keyword.iskeyword(name):
        return "module name is a Python keyword"
    if name.startswith("__") and name.endswith("__"):
        return "module name is a dunder name"
    if name in sys.stdlib_module_names or name in {"jax", "numpy", "mkc", "lark", "jinja2"}:
        return "module name shadows a standard or installed module"
    return None


def run_case(case: Case, work: Path) -> dict:
    """Run one case in the current process with its target; its outcome."""
    import traceback

    import mkc
    from mkc.diagnostics import MkcError
    mkc_dir = os.path.dirname(mkc.__file__) + os.sep
    d = work / f"case{case.index}"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    os.chdir(d)
    res = {"index": case.index, "kind": case.kind, "base": case.base, "target": case.target,
           "stage": "check"}
    try:
        res.update(TARGETS[case.target].run(case, d, res))
    except MkcError as e:
        res.update(_diagnostic_outcome(e, case.spec.decode("utf-8", errors="replace"), res["stage"]))
    except TargetUnavailable as e:
        res.update(cls="crash", sig=f"target {case.target} unavailable", detail=str(e))
    except CaseTimeout as e:             # the pool's SIGUSR2 at the deadline: where it was
        frames = traceback.extract_tb(e.__traceback__)
        mk = [f for f in frames if f.filename.startswith(mkc_dir)
              and not f.filename.endswith("compiler.py")][:3]
        res.update(cls="hang", sig="hang @ " + (" > ".join(
            f"mkc/{os.path.relpath(f.filename, mkc_dir)}:{f.name}" for f in mk) or "no mkc frame"),
            detail=_frames_text(frames, 6))
    except MemoryError as e:
        frames = traceback.extract_tb(e.__traceback__)
        res.update(cls="memory", sig=f"{res['stage']}: MemoryError @ {_mkc_frame(frames, mkc_dir)}",
                   detail=_frames_text(frames), restart=True)
    except BaseException as e:          # noqa: BLE001 - RecursionError, SystemExit, anything
        frames = traceback.extract_tb(e.__traceback__)
        res.update(cls="traceback",
                   sig=f"{res['stage']}: {type(e).__name__} @ {_mkc_frame(frames, mkc_dir)}",
                   detail=f"{type(e).__name__}: {str(e)[:300]}\n{_frames_text(frames)}")
    finally:
        os.chdir(work)
        shutil.rmtree(d, ignore_errors=True)
    if case.target != "check" and res.get("sig"):      # signatures name their target
        res["sig"] = f"[{case.target}] {res['sig']}"
    res.pop("stage")
    return {k: v for k, v in res.items() if v is not None}


def _diagnostic_outcome(e, source: str, stage: str) -> dict:
    """An MkcError's class: diagnostic if every diagnostic has a file, line, column, code and
    hint and the error renders; else bad_diagnostic."""
    bad = []
    for dg in e.diagnostics:
        s = dg.span
        if not (s.file and s.line >= 1 and s.column >= 1 and dg.hint and dg.code):
            bad.append(f"{dg.code}: file={s.file!r} line={s.line} column={s.column} "
                       f"hint={bool(dg.hint)}")
    try:
        e.render(source)
    except Exception as r:              # noqa: BLE001 - classify, do not crash the worker
        bad.append(f"render raises {type(r).__name__}")
    if not bad:
        return {"cls": "diagnostic", "codes": e.codes}
    return {"cls": "bad_diagnostic", "codes": e.codes,
            "sig": f"{stage}: {bad[0].split(':')[0]} "
                   f"{_norm(bad[0].split(':', 1)[1]) if ':' in bad[0] else ''}",
            "detail": "; ".join(bad) + f" | {str(e)[:300]}"}


def run_check(case: Case, d: Path, res: dict) -> dict:
    """`mkc check` (and, for a sample, `mkc compile` and an import, or the step-time model)."""
    from mkc import compiler
    spec = case.materialize(d)
    c = compiler.check_spec(spec, case.model)
    if case.compile:
        res["stage"] = "compile"
        c = compiler.compile_spec(spec, case.model)
        res["stage"] = "write"
        return _write_and_import(case, c, d)
    if case.perf:
        res["stage"] = "perf"
        _model_steps(c.ir)
    return {"cls": "ok"}


def _comment_texts(text: str) -> list[str]:
    """The comments as the grammar reads them (`#` to the line feed, outside strings), their
    trailing whitespace aside (fmt drops it)."""
    return [m.group().rstrip() for m in re.finditer(r'"[^"\n]*"|#[^\n]*', text)
            if m.group().startswith("#")]


def _fmt_failure(cls: str, what: str, text: str, a: str, b: str) -> dict:
    """A fmt failure: its signature (what differs, and whether the source has line breaks other
    than "\n", which lark and str.splitlines() count differently) and a diff."""
    odd = sorted({repr(c) for c in text if c in LINE_BREAKS})
    diff = [ln.rstrip("\n") for ln in difflib.unified_diff(_lines(a), _lines(b), n=0)][2:14]
    return {"cls": cls, "sig": f"{what}" + (" (odd line breaks in the source)" if odd else ""),
            "detail": (f"line breaks {' '.join(odd)}\n" if odd else "") + "\n".join(map(repr, diff))}


def run_fmt(case: Case, d: Path, res: dict) -> dict:
    """`mkc fmt -`: a spec the parser accepts formats to text that parses to the same AST with
    the same comments, and formatting that text again changes nothing."""
    from mkc.diagnostics import MkcError
    from mkc.lang import ast, parser
    from mkc.lang.fmt import format_text
    res["stage"] = "parse"
    sched, text = parser.parse_bytes(case.spec, "spec.sched")       # MkcError: a diagnostic
    res["stage"] = "fmt"
    once = format_text(text, "spec.sched")
    res["stage"] = "fmt again"
    try:
        again = parser.parse(once, "spec.sched")
    except MkcError as e:
        return {"cls": "fmt_changed_meaning", "sig": f"formatted text does not parse ({e.codes[0]})",
                "detail": str(e)[:400]}
    if ast.meaning(again) != ast.meaning(sched):
        return _fmt_failure("fmt_changed_meaning", "AST differs after fmt", text, text, once)
    if _comment_texts(once) != _comment_texts(text):
        before, after = _comment_texts(text), _comment_texts(once)
        return _fmt_failure("fmt_changed_meaning", "comments differ after fmt", text,
                            "\n".join(before) + "\n", "\n".join(after) + "\n")
    twice = format_text(once, "spec.sched")
    if twice != once:
        blank_only = [ln.strip() for ln in _lines(once) if ln.strip()] == \
            [ln.strip() for ln in _lines(twice) if ln.strip()]
        return _fmt_failure("fmt_unstable", "formatting its output again changes "
                            + ("blank lines" if blank_only else "text"), text, once, twice)
    return {"cls": "ok"}


def run_retarget(case: Case, d: Path, res: dict) -> dict:
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


def run_checkpoint(case: Case, d: Path, res: dict) -> dict:
    """`mkc check spec.sched --model ckpt` on a hostile checkpoint (benchmarks/fuzz_checkpoint.py
    writes it): the check and the requantization report `mkc check` prints."""
    from mkc import compiler
    from mkc.requantize import report
    res["stage"] = "write checkpoint"
    spec = case.materialize(d)
    res["base"] = case.base
    res["stage"] = "check"
    c = compiler.check_spec(spec, case.model)
    res["stage"] = "requantization"
    report(c.ir, c.schedule, case.model)
    return {"cls": "ok"}


def run_lsp(case: Case, d: Path, res: dict) -> dict:
    """A hostile session with `mkc lsp` (benchmarks/fuzz_lsp.py's `run_session`): a server that
    died or exited badly is a crash, one that did not exit on `exit` a hang, a traceback on its
    stderr or in an answer a traceback, a request it left unanswered lsp_unanswered."""
    hostile_session, run_session = _external("fuzz_lsp", "hostile_session", "run_session")
    res["stage"] = "session"
    frames = hostile_session(random.Random(f"mkc-fuzz-lsp:{case.seed}:{case.index}"))
    out = run_session(frames, LSP_SESSION_SECONDS)
    if out["died"] or out["exit_code"] not in (0, None):
        return {"cls": "crash", "sig": f"server died (exit status {out['exit_code']})",
                "detail": out["stderr"][-400:]}
    if out["tracebacks"]:
        first = json.dumps(out["tracebacks"][0])        # its innermost mkc frame is the signature
        where = re.findall(r'/(mkc/[\w/]+\.py)\\?", line \d+, in (\w+)', first)
        return {"cls": "traceback", "detail": first[-600:],
                "sig": "traceback @ " + (":".join(where[-1]) if where else "no mkc frame")}
    if out["unanswered"]:
        return {"cls": "lsp_unanswered", "sig": f"{len(out['unanswered'])} requests unanswered",
                "detail": "\n".join(out["unanswered"][:4])}
    if out["exit_code"] is None:
        return {"cls": "hang", "sig": "server did not exit after shutdown and exit",
                "detail": out["stderr"][-400:]}
    return {"cls": "ok"}


def run_serve(case: Case, d: Path, res: dict) -> dict:
    """The case's hostile requests against this worker's server (fuzz_serve.server(): started
    at its first case), beside good requests; fuzz_serve.run_case's outcome."""
    (server,) = _external("fuzz_serve", "server")
    res["stage"] = "serve"
    return server().run(case.seed, case.index, case.kind)


LSP_SESSION_SECONDS = 10.0
TARGETS.update({
    "check": Target("check", lambda: MUTATIONS, run_check, 10),
    # formatting is linear in the text (0.25 ms a line here), and a line repeated 5,000 times
    # is formatted twice: about 5 CPU seconds with the worker's start, no hang
    "fmt": Target("fmt", lambda: {k: MUTATIONS[k] for k in SPEC_TEXT_KINDS}, run_fmt, 4,
                  timeout_factor=2.5, command="mkc fmt - < spec.sched (then fmt its output again)"),
    # a retarget that gets past its arguments checks and models a few candidate layouts: seconds
    "retarget": Target("retarget", lambda: RETARGET_KINDS, run_retarget, 2, timeout_factor=6.0,
                       base_weights={**MINI_BASES, "qwen_full": 5},
                       command="mkc retarget spec.sched"),
    # writing and checking a K3 MINI checkpoint (114 MB; the requantization report reads every
    # expert) takes about 6 CPU seconds
    "checkpoint": Target("checkpoint", _checkpoint_kinds, run_checkpoint, 2, timeout_factor=4.0,
                         base_weights=MINI_BASES, command="mkc check spec.sched"),
    # the session opens schedules/qwen3_8_27b.sched with its own model line
    "lsp": Target("lsp", _lsp_kinds, run_lsp, 2, timeout_factor=2.0, base_weights={"qwen_full": 1},
                  command="mkc lsp < session"),
    # a case takes milliseconds of the stand-in; the worker's first starts it (JAX's import
    # and the step's compile: a few CPU seconds)
    "serve": Target("serve", _serve_kinds, run_serve, 2, timeout_factor=3.0,
                    base_weights={"qwen_full": 1},
                    command="mkc serve <- hostile requests"),
})


def _model_steps(s) -> None:
    """`mkc perf` on an accepted spec: its smallest and largest batch, and its verify step."""
    from mkc import perf
    perf.run(s, s.batch_min, min(s.context, 64))
    perf.run(s, s.batch_max)
    if s.verify_rows:
        perf.run(s, None, None, s.verify_rows)


class CaseTimeout(BaseException):
    """Raised in a worker by SIGUSR2 when its case overran (not an Exception: mkc cannot catch it)."""


def _frames_text(frames, n: int = 4) -> str:
    return "\n".join(f"  {f.filename}:{f.lineno} in {f.name}" for f in frames[-n:])


def _write_and_import(case: Case, c, d: Path) -> dict:
    """Write the module as `mkc compile -o out` does (into a package) and import it."""
    import traceback

    from mkc import compiler, files
    name = compiler.module_name(c)
    out = d / "out"
    out.mkdir()
    (out / "__init__.py").write_text("# package marker\n")
    path = out / f"{name}.py"
    existed = path.exists()
    files.write_atomically(path, c.module_source)
    if existed:
        return {"cls": "bad_output", "sig": f"writes over an existing file ({path.name})",
                "detail": f"module name {name!r}"}
    why = _safe_module_name(name)
    if why:
        return {"cls": "bad_output", "sig": why,
                "detail": f"module name {_show(name, 80)}"}
    try:
        files.import_generated(path, name=f"_mkc_fuzz_{case.index}")
    except BaseException as e:          # noqa: BLE001
        frames = traceback.extract_tb(e.__traceback__)
        where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames)
                      if f.filename == str(path)), "?")
        return {"cls": "bad_output", "sig": f"import: {type(e).__name__}: {_norm(str(e))}",
                "detail": f"{type(e).__name__}: {str(e)[:300]} at {where}"}
    finally:
        sys.modules.pop(f"_mkc_fuzz_{case.index}", None)
    return {"cls": "ok", "compiled": True}


def worker_main(work: str, mem_bytes: int, timeout: float, compile_fraction: float,
                preimport: bool) -> None:
    """Serve cases: read `seed index [kind]` lines on stdin, answer one JSON line each."""
    import faulthandler
    import resource
    import signal
    os.nice(10)
    try:                                 # Linux: die with the pool, even in a hanging case
        import ctypes
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)       # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
    if mem_bytes:
        resource.setrlimit(resource.RLIMIT_AS, (mem_bytes, mem_bytes))
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)                        # anything the checker or a module prints goes to stderr
    sys.setrecursionlimit(10000)
    import mkc.compiler  # noqa: F401
    if preimport:                        # a generated module's imports, paid once per worker
        from jax.experimental.pallas import tpu  # noqa: F401
    workdir = Path(work)
    stack = open(workdir / "stack.txt", "w")
    faulthandler.register(signal.SIGUSR1, file=stack)    # the pool asks for a stack on a hang

    def overran(*_):
        raise CaseTimeout
    signal.signal(signal.SIGUSR2, overran)               # the pool interrupts an overrunning case
    proto.write("READY\n")
    for line in sys.stdin:
        seed, index, target, *kind = line.split()
        t0 = time.perf_counter()
        try:
            res = run_case(make_case(int(seed), int(index), compile_fraction, kind[0] if kind else None,
                                     target), workdir)
        except MemoryError:
            res = {"index": int(index), "cls": "memory", "sig": "MemoryError in the harness",
                   "restart": True}
        res["seconds"] = round(time.perf_counter() - t0, 4)
        proto.write(json.dumps(res) + "\n")
        if res.get("restart"):
            return


# ---- the pool ------------------------------------------------------------------------------

# A case blocked without computing (on a pipe, a lock) is a hang after this much wall time in
# which it and its children gained less than STALL_CPU_SECONDS: a computing process gets more
# on a machine loaded hundreds of times over. No wall-clock limit on a case that computes.
STALL_SECONDS = 60.0
STALL_CPU_SECONDS = 0.1


class _Worker:
    def __init__(self, args: list[str], work: Path, log: Path):
        self.work = work
        self.log = open(log, "ab")
        env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--worker",
                                      str(work), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.log, cwd=work, env=env)
        self.buf = b""
        self.current: int | None = None
        self.deadline = time.monotonic() + 300      # start-up: imports on a loaded machine
        self.ready = False
        self.cpu0 = 0.0
        self.interrupted = False         # SIGUSR2 sent for the current case
        self.case_timeout = 0.0          # CPU seconds the current case may take
        self.progress = (0.0, 0.0)       # (CPU seconds, monotonic time) when it last computed

    def cpu(self) -> float:
        """CPU seconds the worker and its children (an lsp case's server) have used: the
        machine may be shared, so a hang is measured in CPU time, and a case blocked without
        computing by a stretch of wall time without CPU progress."""
        (process_cpu,) = _external("fuzz_lsp", "process_cpu")
        return process_cpu(self.proc.pid)

    def overdue(self, timeout: float) -> bool:
        now = time.monotonic()
        if not self.ready:
            return now > self.deadline
        cpu = self.cpu()
        if cpu - self.cpu0 > max(timeout, self.case_timeout):
            return True
        if self.interrupted:             # asked where it is: it has until the deadline to say
            return now > self.deadline
        if cpu - self.progress[0] >= STALL_CPU_SECONDS:
            self.progress = (cpu, now)
        return now - self.progress[1] > STALL_SECONDS

    def send(self, seed: int, index: int, kind: str | None, target: str, timeout: float) -> None:
        self.current = index
        self.interrupted = False
        self.cpu0 = self.cpu()
        self.case_timeout = timeout
        self.progress = (self.cpu0, time.monotonic())
        self.proc.stdin.write(f"{seed} {index} {target} {kind or ''}\n".encode())
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.log.close()


def _stack_signature(path: Path, mkc_dir: str) -> tuple[str, str]:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "no stack dump", ""
    frames = re.findall(r'File "([^"]+)", line (\d+) in (\S+)', text)
    # faulthandler lists the most recent call first (the pool asks for the dump with SIGUSR1
    # at the deadline). The signature is the outermost three mkc frames below the compiler
    # driver, where the unbounded loop is entered; the innermost frame moves with the moment.
    mk = [(f, ln, fn) for f, ln, fn in frames if f.startswith(mkc_dir)]
    detail = "\n".join(f"  {a}:{b} in {c}" for a, b, c in frames[:7])
    if not mk:
        lines = [f"{Path(f).name}:{fn}" for f, _, fn in frames[:1]]
        return f"no mkc frame ({lines[0] if lines else 'empty dump'})", detail
    outer = [x for x in reversed(mk) if not x[0].endswith("compiler.py")][:3]
    return " > ".join(f"mkc/{os.path.relpath(f, mkc_dir)}:{fn}" for f, _, fn in outer), detail


class _Progress:
    """The campaign's progress when asked: a bar on stderr on a terminal; otherwise (a log) a
    line on stdout every 30 s."""

    def __init__(self, total: int, show: bool):
        from mkc.progress import bar
        self.bar = bar(total=total, desc="fuzz cases", unit="case", show=show)
        self.lines, self.total, self.t_last = show and self.bar.disable, total, time.monotonic()

    def advance(self, results: list[dict]) -> None:
        def bad() -> int:
            return sum(r["cls"] in FAILURE_CLASSES for r in results)
        if len(results) > self.bar.n:
            self.bar.set_postfix_str(f"{bad()} failures", refresh=False)
            self.bar.update(len(results) - self.bar.n)
        if self.lines and time.monotonic() - self.t_last > 30:
            self.t_last = time.monotonic()
            print(f"  ... {len(results)}/{self.total} cases, {bad()} failures", flush=True)

    def close(self) -> None:
        self.bar.close()


def case_timeout(seed: int, index: int, target: str, timeout: float) -> float:
    """CPU seconds case `index` may take: its target's share of `timeout` (and more for a
    check case that models its steps)."""
    name = target_of(seed, index, target)
    factor = PERF_TIMEOUT_FACTOR if name == "check" and models_steps(seed, index) else 1.0
    return timeout * TARGETS[name].timeout_factor * factor


def run_campaign(seed: int, indices: list, workers: int = 2, timeout: float = 10.0,
                 mem_gib: float = 4.0, compile_fraction: float = 0.2, kind: str | None = None,
                 progress: bool = False, target: str = "check") -> list[dict]:
    """Run cases on a pool of long-lived workers (at most `workers` processes at a time).

    indices: case numbers, or (number, kind) or (number, kind, target) tuples forcing a
    mutation kind (and a target) per case."""
    kinds = {i[0]: i[1] for i in indices if isinstance(i, tuple)}
    targets = {i[0]: i[2] for i in indices if isinstance(i, tuple) and len(i) > 2}
    indices = [i[0] if isinstance(i, tuple) else i for i in indices]
    mkc_dir = str(ROOT / "mkc") + os.sep           # the workers import mkc from ROOT
    todo = list(reversed(indices))
    total = len(todo)
    results: list[dict] = []
    root = Path(tempfile.mkdtemp(prefix="mkc_fuzz_"))
    args = [str(int(mem_gib * (1 << 30))), str(timeout), str(compile_fraction),
            "0"]        # "1": import jax at worker start; lazily is cheaper after a hang restart
    n_started = 0

    def start() -> _Worker:
        nonlocal n_started
        n_started += 1
        w = root / f"w{n_started}"
        w.mkdir()
        return _Worker(args, w, root / f"w{n_started}.log")

    shown = _Progress(total, progress)
    pool = [start() for _ in range(max(1, min(workers, total)))]
    sel = selectors.DefaultSelector()
    for w in pool:
        sel.register(w.proc.stdout, selectors.EVENT_READ, w)

    def replace(w: _Worker) -> None:
        sel.unregister(w.proc.stdout)
        w.stop()
        pool.remove(w)
        if todo or any(x.current is not None for x in pool):
            nw = start()
            pool.append(nw)
            sel.register(nw.proc.stdout, selectors.EVENT_READ, nw)

    def log_tail(w: _Worker) -> str:
        try:
            return (w.work.parent / f"{w.work.name}.log").read_text(errors="replace")[-800:]
        except OSError:
            return ""

    try:
        while todo or any(w.current is not None for w in pool):
            for w in list(pool):
                if w.ready and w.current is None and todo:
                    idx = todo.pop()
                    tgt = targets.get(idx, target)
                    w.send(seed, idx, kinds.get(idx, kind), tgt, case_timeout(seed, idx, tgt, timeout))
            for key, _ in sel.select(timeout=0.25):
                w = key.data
                chunk = os.read(w.proc.stdout.fileno(), 1 << 16)
                if not chunk:                                     # the worker died
                    if w.current is not None:
                        idx = w.current
                        rc = w.proc.wait()
                        tail = log_tail(w)
                        cls = "memory" if "MemoryError" in tail or "std::bad_alloc" in tail else "crash"
                        results.append({"index": idx, "cls": cls, "sig": f"worker exit {rc}",
                                        "detail": tail[-400:], "seconds": None})
                    replace(w)
                    continue
                w.buf += chunk
                while b"\n" in w.buf:
                    line, w.buf = w.buf.split(b"\n", 1)
                    if line == b"READY":
                        w.ready = True
                        continue
                    res = json.loads(line)
                    results.append(res)
                    w.current = None
                    if res.get("restart"):
                        replace(w)
                        break
            for w in list(pool):
                if (w.current is not None or not w.ready) and w.overdue(timeout):
                    if not w.ready:
                        raise RuntimeError(f"fuzz worker did not start: {log_tail(w)}")
                    if not w.interrupted:        # first ask the case to stop where it is
                        w.interrupted = True
                        w.proc.send_signal(signal.SIGUSR2)
                        w.cpu0 += 2.0            # it has 2 more CPU seconds (or 30 s) to answer
                        w.deadline = time.monotonic() + 30
                        continue
                    idx = w.current
                    (w.work / "stack.txt").write_text("")
                    w.proc.send_signal(signal.SIGUSR1)
                    time.sleep(0.5)
                    sig, detail = _stack_signature(w.work / "stack.txt", mkc_dir)
                    case = make_case(seed, idx, compile_fraction, kinds.get(idx, kind),
                                     targets.get(idx, target))
                    prefix = "" if case.target == "check" else f"[{case.target}] "
                    results.append({"index": idx, "kind": case.kind, "base": case.base,
                                    "target": case.target, "cls": "hang",
                                    "sig": f"{prefix}hang @ {sig}", "detail": detail,
                                    "seconds": w.case_timeout})
                    w.current = None
                    replace(w)
            shown.advance(results)
    except KeyboardInterrupt:            # Ctrl-C (or kill -INT): report the cases done so far
        print(f"  interrupted after {len(results)} of {total} cases", flush=True)
    finally:
        shown.close()
        for w in pool:
            w.stop()
        shutil.rmtree(root, ignore_errors=True)
    for r in results:                    # crash records lack kind/base/target: fill them in
        if "kind" not in r:
            case = make_case(seed, r["index"], compile_fraction, kinds.get(r["index"], kind),
                             targets.get(r["index"], target))
            r["kind"], r["base"], r["target"] = case.kind, case.base, case.target
        if r["index"] in kinds:
            r["forced_kind"] = kinds[r["index"]]
        if r["index"] in targets:
            r["forced_target"] = targets[r["index"]]
    results.sort(key=lambda r: r["index"])
    return results


# ---- the report ----------------------------------------------------------------------------

def summarize(results: list[dict], seed: int, compile_fraction: float, kind: str | None = None,
              target: str = "check") -> dict:
    by_class = {c: 0 for c in CLASSES}
    by_target: dict[str, dict[str, int]] = {}
    by_kind: dict[str, dict[str, int]] = {}      # "kind" for check's cases, else "target/kind"
    by_base: dict[str, dict[str, int]] = {}
    sigs: dict[str, dict] = {}
    for r in results:
        by_class[r["cls"]] += 1
        kind_key = r["kind"] if r["target"] == "check" else f"{r['target']}/{r['kind']}"
        for table, key in ((by_target, r["target"]), (by_kind, kind_key), (by_base, r["base"])):
            table.setdefault(key, {c: 0 for c in CLASSES})[r["cls"]] += 1
        if r["cls"] in FAILURE_CLASSES:
            key = f"{r['cls']}: {r['sig']}"
            case = make_case(seed, r["index"], compile_fraction, r.get("forced_kind", kind),
                             r.get("forced_target", target))
            size = (len(reproducer(case)), len(case.spec))
            s = sigs.setdefault(key, {"count": 0, "kinds": {}, "bases": {}, "best": None})
            s["count"] += 1
            s["kinds"][r["kind"]] = s["kinds"].get(r["kind"], 0) + 1
            s["bases"][r["base"]] = s["bases"].get(r["base"], 0) + 1
            if s["best"] is None or size < s["best"][0]:
                s["best"] = (size, r["index"], r.get("detail", ""), reproducer(case))
    slow = sorted((r for r in results if r.get("seconds") and r["cls"] != "hang"),
                  key=lambda r: -r["seconds"])[:5]
    return {"by_class": by_class, "by_target": by_target, "by_kind": by_kind, "by_base": by_base,
            "signatures": sigs, "slowest": slow}


def _row_order(title: str, key: str) -> tuple:
    """Report rows in the registries' order: targets, their kinds, bases."""
    names = list(TARGETS)
    if title == "target":
        return (names.index(key),)
    if title == "base":
        return (list(BASE_WEIGHTS).index(key),)
    target, _, kind = key.rpartition("/")
    kinds = list(TARGETS[target or "check"].kinds())
    return (names.index(target or "check"), kinds.index(kind) if kind in kinds else len(kinds), kind)


def print_report(summary: dict, results: list[dict], args, wall: float) -> None:
    n = len(results)
    print(f"\nmkc fuzz campaign: {n} cases, seed {args.seed}, {args.workers} workers, "
          f"timeout {args.timeout} s, memory cap {args.mem_gib} GiB")
    print(f"wall time {wall:.1f} s, {n / wall:.1f} cases/s")
    print("\noutcomes: " + ", ".join(f"{c} {v}" for c, v in summary["by_class"].items()))
    cols = [c for c in CLASSES if summary["by_class"][c]]
    for title, table in (("target", "by_target"), ("kind", "by_kind"), ("base", "by_base")):
        width = max([17] + [len(k) + 2 for k in summary[table]])
        print(f"\n{title:<{width}}" + "".join(f"{c:>15}" for c in cols))
        for key, row in sorted(summary[table].items(), key=lambda kv: _row_order(title, kv[0])):
            print(f"{key:<{width}}" + "".join(f"{row[c]:>15}" for c in cols))
    sigs = summary["signatures"]
    print(f"\n{len(sigs)} distinct failure signatures")
    for key, s in sorted(sigs.items(), key=lambda kv: -kv[1]["count"]):
        _, idx, detail, repro = s["best"]
        print(f"\n== {key}\n   {s['count']} cases; kinds {s['kinds']}; bases {s['bases']}")
        if detail:
            print("   " + detail.replace("\n", "\n   ")[:900])
        print("   reproducer (case %d):\n     " % idx + repro.replace("\n", "\n     "))
    if summary["slowest"]:
        print("\nslowest non-hanging cases: " + ", ".join(
            f"#{r['index']} {r['kind']} {r['seconds']:.2f} s" for r in summary["slowest"]))
    print(f"\nreproduce: .venv/bin/python benchmarks/fuzz_campaign.py --cases {args.cases} "
          f"--seed {args.seed} --workers {args.workers} --timeout {args.timeout} "
          f"--compile-fraction {args.compile_fraction} --target {args.target}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--worker":
        work, mem, timeout, frac, pre = argv[1:6]
        worker_main(work, int(mem), float(timeout), float(frac), pre == "1")
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", type=int, default=10000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=10.0,
                    help="CPU seconds per case (wall-clock cap: 3x, at least 30 s)")
    ap.add_argument("--mem-gib", type=float, default=4.0, help="address-space cap per worker")
    ap.add_argument("--compile-fraction", type=float, default=0.2,
                    help="share of cases also compiled, written and imported when accepted")
    ap.add_argument("--target", choices=[*TARGETS, "all"], default="check",
                    help="what runs each case (default check; all: every available target)")
    ap.add_argument("--kind", help="only this mutation kind (of the target's kinds)")
    ap.add_argument("--json", help="write the summary and every failing case here")
    ap.add_argument("--only", type=int, help="run (or --emit) only case I")
    ap.add_argument("--emit", help="with --only: write the case's spec and files to this directory")
    args = ap.parse_args(argv)
    if args.target == "all":
        missing = [n for n in TARGETS if n not in available_targets()]
        if missing:
            print(f"--target all skips {', '.join(missing)}: {_unavailable(missing[0])}", flush=True)
    elif why := _unavailable(args.target):
        ap.error(f"--target {args.target}: {why}")
    if args.kind is not None:
        known = sorted({k for n in available_targets() for k in TARGETS[n].kinds()}
                       if args.target == "all" else TARGETS[args.target].kinds())
        if args.kind not in known:
            ap.error(f"--kind {args.kind}: not a kind of --target {args.target}; its kinds: "
                     f"{', '.join(known)}")
    if args.emit is not None:
        case = make_case(args.seed, args.only, args.compile_fraction, args.kind, args.target)
        d = Path(args.emit)
        d.mkdir(parents=True, exist_ok=True)
        spec = case.materialize(d)
        print(reproducer(case))
        print(f"wrote {spec}")
        return 0
    indices = [args.only] if args.only is not None else list(range(args.cases))
    sys.path.insert(0, str(ROOT))        # this checkout's mkc, as the workers import it

    def stop(*_):
        raise KeyboardInterrupt
    signal.signal(signal.SIGINT, stop)   # also when started in the background (SIGINT ignored)
    signal.signal(signal.SIGTERM, stop)  # kill PID: stop and report the cases done so far
    t0 = time.perf_counter()
    results = run_campaign(args.seed, indices, args.workers, args.timeout, args.mem_gib,
                           args.compile_fraction, args.kind, progress=True, target=args.target)
    wall = time.perf_counter() - t0
    summary = summarize(results, args.seed, args.compile_fraction, args.kind, args.target)
    print_report(summary, results, args, wall)
    if args.json:
        sigs = {k: {"count": s["count"], "kinds": s["kinds"], "bases": s["bases"],
                    "case": s["best"][1], "detail": s["best"][2], "reproducer": s["best"][3]}
                for k, s in summary["signatures"].items()}
        Path(args.json).write_text(json.dumps({
            "cases": len(results), "seed": args.seed, "wall_seconds": round(wall, 2),
            "target": args.target, "by_class": summary["by_class"],
            "by_target": summary["by_target"], "by_kind": summary["by_kind"],
            "by_base": summary["by_base"], "signatures": sigs,
            "failures": [r for r in results if r["cls"] in FAILURE_CLASSES]}, indent=2))
    return 1 if any(summary["by_class"][c] for c in FAILURE_CLASSES) else 0


if __name__ == "__main__":
    sys.exit(main())
