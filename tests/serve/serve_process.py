"""The real `mkc serve` process for the slow tests: the MINI Qwen module
(schedules/qwen3_8_27b.sched for qwen3_8_mini) in TPU interpret mode, and the family
reference's greedy decoding (in its rounding-emulating mode, as examples/speculative.py
compares) that its greedy completions must equal token for token."""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Callable, Iterator

import pytest

from mkc.serve import launch
from tests_support import cpu_compilation_cache

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
MODEL = "qwen3_8_mini"


def cpu_env() -> dict[str, str]:
    """The environment of a child that runs mkc serve on CPU (it sets its own device count),
    sharing the session's CPU compilation cache."""
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    return env | {"JAX_PLATFORMS": "cpu", "PYTHONPATH": str(ROOT)} | cpu_compilation_cache()


def run_benchmark(script: str, *argv: str, timeout: float) -> subprocess.CompletedProcess:
    """benchmarks/<script> *argv in a child on CPU (the servers it starts too)."""
    return subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), *argv],
                          capture_output=True, text=True, timeout=timeout, env=cpu_env(), cwd=ROOT)


@contextlib.contextmanager
def running_server(args: list[str], spec: Path = SPEC, model: str = MODEL) -> Iterator[str]:
    """`mkc serve SPEC --model MODEL *args` on CPU until the block ends; its URL once /health
    answers (a server that does not come up fails the test with its output)."""
    try:
        with launch.running_server(spec, model, args, env=cpu_env()) as url:
            yield url
    except launch.ServerError as e:
        pytest.fail(str(e))


def reference_greedy(spec: Path = SPEC, model: str = MODEL, hf: dict | None = None
                     ) -> Callable[[list[int], int], tuple[list[int], str]]:
    """prompt, n -> (the reference's greedy tokens, finish reason), stopping at EOS as the
    server does: `model`'s family reference with the weights `hf` (default the server's
    random_weights(0)), rounding as `spec` compiles it for `model` (a shipped config name)."""
    from mkc import compiler, numerics
    from mkc.checkpoint import family_of
    sys.path.insert(0, str(ROOT / "examples"))
    from speculative import reference_greedy as greedy
    config = json.loads((ROOT / f"mkc/model/configs/{model}.json").read_text())
    reference = family_of(config).module("reference")
    cfg = reference.load_config(config)
    if hf is None:
        hf = reference.init_params(cfg, seed=0)      # what the server's random_weights(0) gives
    ir = compiler.check_spec(spec, model).ir
    rounding = numerics.rounding_from_ir(ir)
    eos = config["eos_token_id"]

    def run(prompt: list[int], n: int) -> tuple[list[int], str]:
        out = greedy(reference, hf, cfg, rounding, prompt, n, ir.context, stop_token=eos)
        return out, "stop" if out[-1] == eos else "length"
    return run


def token_ids(choice) -> list[int]:
    return list(choice.model_extra["token_ids"])
