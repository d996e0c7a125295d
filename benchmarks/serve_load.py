"""A bounded load test of an OpenAI-compatible completions server (`mkc serve`, or any other):
N streamed requests, C at a time, of mixed prompt and output lengths; throughput, time to first
token, inter-token latency and end-to-end latency percentiles.

    .venv/bin/python benchmarks/serve_load.py --url http://127.0.0.1:8000 [options]
    .venv/bin/python benchmarks/serve_load.py SPEC --model NAME [options] [-- mkc serve options]

With --url it drives a running server; with SPEC and --model it starts `mkc serve SPEC --model
NAME` on a free port itself (arguments after `--` go to `mkc serve`, e.g. `-- --batch 8`) and
stops it at the end. Prompts are random token ids (the completions API takes ids, so no
tokenizer is needed) and each request asks for exactly its output length (`ignore_eos`).
Lengths are drawn log-uniformly from --prompt-tokens and --output-tokens with --seed, so a run
repeats the same workload. A 429 (the server's queue is full) is counted as rejected, apart
from failures. Needs `httpx` (the test extra: `pip install -e ".[test]"`).

On a CPU host the server runs a MINI model in TPU interpret mode: its numbers say nothing
about TPU speed (the report says so when the server's /stats does); the harness working is the
point there.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import shlex
import sys
import time
from dataclasses import dataclass, field

try:
    import httpx
except ImportError:            # main() says how to install it
    httpx = None

from serve_common import (HarnessError, against_server, at_least, exit_status, parse_server_args,
                          served_model, server_parser, server_stats)

PROMPT_TOKEN_IDS = 1000     # default --token-ids: prompt ids below it fit every vocabulary served here
ERRORS_KEPT = 5             # distinct failure messages kept for the report
INTERPRET_NOTE = ("the server runs in TPU interpret mode on CPU: these numbers say nothing about "
                  "TPU speed")


@dataclass(frozen=True)
class Job:
    prompt: list[int]
    max_tokens: int
    seed: int


@dataclass
class Outcome:
    """One request: `completed`, else `rejected` (a 429) or failed with `error`; its time to
    first token, the gaps between its token-carrying chunks, its end-to-end seconds, and its
    output tokens."""

    completed: bool = False
    rejected: bool = False
    error: str | None = None
    ttft: float | None = None
    itl: list[float] = field(default_factory=list)
    e2e: float | None = None
    output_tokens: int = 0


def length_mix(n: int, low: int, high: int, rng: random.Random) -> list[int]:
    """n lengths from low to high inclusive, log-uniform (as many from 16 to 32 as from 256
    to 512): mostly short requests with some long ones."""
    lo, hi = math.log(low), math.log(high + 1)
    return [min(high, int(math.exp(rng.uniform(lo, hi)))) for _ in range(n)]


def workload(n: int, prompt_tokens: tuple[int, int], output_tokens: tuple[int, int],
             seed: int, token_ids: int = PROMPT_TOKEN_IDS) -> list[Job]:
    """The n requests of a run, their prompts' ids below `token_ids`: the same for the same
    arguments and seed."""
    rng = random.Random(seed)
    prompts = length_mix(n, *prompt_tokens, rng)
    outputs = length_mix(n, *output_tokens, rng)
    return [Job([rng.randrange(token_ids) for _ in range(p)], o, seed + i)
            for i, (p, o) in enumerate(zip(prompts, outputs))]


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0 to 100), interpolated linearly between the closest ranks (numpy's
    default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    below = math.floor(rank)
    above = min(below + 1, len(ordered) - 1)
    return ordered[below] + (ordered[above] - ordered[below]) * (rank - below)


def _percentiles(values: list[float], qs: tuple[int, ...]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in qs}


def _error_message(body: bytes, status: int) -> str:
    try:
        return f"{status}: {json.loads(body)['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{status}: {body[:200].decode(errors='replace')}"


async def one_request(client: httpx.AsyncClient, url: str, model: str, job: Job,
                      temperature: float) -> Outcome:
    """Stream one completion; what it measured."""
    body = {"model": model, "prompt": job.prompt, "max_tokens": job.max_tokens,
            "temperature": temperature, "seed": job.seed, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = Outcome()
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                out.rejected = r.status_code == 429
                out.error = _error_message(await r.aread(), r.status_code)
                return out
            usage = None
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    out.error = f"in the stream: {chunk['error'].get('message', chunk['error'])}"
                    return out
                usage = chunk.get("usage") or usage
                # mkc serve sends each token's id; other servers may send text alone
                tokens = sum(len(c["token_ids"]) if c.get("token_ids") is not None else bool(c.get("text"))
                             for c in chunk.get("choices") or ())
                if tokens:
                    now = time.perf_counter()
                    if out.output_tokens == 0:
                        out.ttft = now - start
                    else:
                        out.itl.append(now - last)
                    last = now
                    out.output_tokens += tokens
            if usage is not None:
                out.output_tokens = usage.get("completion_tokens", out.output_tokens)
    except httpx.HTTPError as e:
        out.error = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        return out
    except ValueError as e:            # a chunk that is not JSON
        out.error = f"a malformed stream chunk: {e}"
        return out
    out.e2e = time.perf_counter() - start
    out.completed = out.output_tokens > 0
    if not out.completed:
        out.error = "the stream ended without a token"
    return out


async def run_load(client: httpx.AsyncClient, url: str, model: str, jobs: list[Job], concurrency: int,
                   temperature: float) -> tuple[list[Outcome], float]:
    """Every job, at most `concurrency` in flight (each worker starts its next job when its
    last one ends); the outcomes in job order and the wall seconds."""
    from mkc.progress import bar
    outcomes: list[Outcome | None] = [None] * len(jobs)
    todo = iter(range(len(jobs)))
    progress = bar(len(jobs), "requests", "req")

    async def worker() -> None:
        for i in todo:
            outcomes[i] = await one_request(client, url, model, jobs[i], temperature)
            progress.update()

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(min(concurrency, len(jobs)))))
    seconds = time.perf_counter() - start
    progress.close()
    return outcomes, seconds


def summarize(outcomes: list[Outcome], seconds: float) -> dict:
    """The report's counts, rates and latency percentiles (seconds)."""
    done = [o for o in outcomes if o.completed]
    errors: list[str] = []
    for o in outcomes:
        if not o.completed and not o.rejected and o.error not in errors and len(errors) < ERRORS_KEPT:
            errors.append(o.error)
    tokens = sum(o.output_tokens for o in done)
    return {
        "completed": len(done), "rejected_429": sum(o.rejected for o in outcomes),
        "failed": sum(not o.completed and not o.rejected for o in outcomes), "errors": errors,
        "duration_s": seconds, "output_tokens": tokens,
        "output_tokens_per_s": tokens / seconds if seconds > 0 else None,
        "requests_per_s": len(done) / seconds if seconds > 0 else None,
        "ttft_s": _percentiles([o.ttft for o in done if o.ttft is not None], (50, 90, 99)),
        "itl_s": _percentiles([g for o in done for g in o.itl], (50, 90, 99)),
        "e2e_s": _percentiles([o.e2e for o in done if o.e2e is not None], (50, 99)),
    }


def _server_part(before: dict | None, after: dict | None) -> dict | None:
    """What mkc serve's /stats says of the run: its decode steps, their mean seconds and busy rows."""
    if not before or not after or "steps" not in after:
        return None
    steps = after["steps"] - before["steps"]
    return {"batch": after.get("batch"), "steps": steps,
            "step_s": (after["step_seconds"] - before["step_seconds"]) / steps if steps else None,
            "busy_rows": (after["busy_row_steps"] - before["busy_row_steps"]) / steps if steps else None}


async def measure(url: str, args: argparse.Namespace, command: str) -> dict:
    """The whole run against the server at `url`: the report."""
    model, context = served_model(url)
    longest = args.prompt_tokens[1] + args.output_tokens[1]
    if context is not None and longest > context:
        raise HarnessError(f"--prompt-tokens up to {args.prompt_tokens[1]} and --output-tokens up "
                           f"to {args.output_tokens[1]} make {longest} tokens, past the model's "
                           f"context of {context}: lower them")
    jobs = workload(args.requests, args.prompt_tokens, args.output_tokens, args.seed, args.token_ids)
    before = server_stats(url)
    timeout = httpx.Timeout(args.timeout, connect=10)
    limits = httpx.Limits(max_connections=args.concurrency + 2)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        outcomes, seconds = await run_load(client, url, model, jobs, args.concurrency, args.temperature)
    after = server_stats(url)
    interpret = (before or {}).get("interpret")
    return {"command": command, "url": url, "model": model, "requests": args.requests,
            "concurrency": args.concurrency, "prompt_tokens_range": list(args.prompt_tokens),
            "output_tokens_range": list(args.output_tokens), "temperature": args.temperature,
            "seed": args.seed, **summarize(outcomes, seconds),
            "server": _server_part(before, after), "interpret": interpret,
            "note": INTERPRET_NOTE if interpret else None}


def _seconds(v: float | None) -> str:
    return "-" if v is None else f"{v:.3f} s"


def render(report: dict) -> str:
    """The report as text."""
    r = report
    lines = [f"serve_load: {r['model']} at {r['url']}",
             f"  command     {r['command']}",
             f"  workload    {r['requests']} requests, {r['concurrency']} concurrent, prompts "
             f"{r['prompt_tokens_range'][0]}-{r['prompt_tokens_range'][1]} tokens, outputs "
             f"{r['output_tokens_range'][0]}-{r['output_tokens_range'][1]} tokens, temperature "
             f"{r['temperature']}, seed {r['seed']}",
             f"  requests    {r['completed']} completed, {r['rejected_429']} rejected (429), "
             f"{r['failed']} failed, in {r['duration_s']:.1f} s"]
    if r["completed"]:
        lines.append(f"  throughput  {r['output_tokens_per_s']:.2f} output tokens/s, "
                     f"{r['requests_per_s']:.3f} requests/s ({r['output_tokens']} tokens)")
        for name, key in (("TTFT", "ttft_s"), ("ITL", "itl_s"), ("E2E", "e2e_s")):
            lines.append(f"  {name:<11} " + "  ".join(f"{p} {_seconds(v)}" for p, v in r[key].items()))
    if r["server"] and r["server"]["steps"]:
        s = r["server"]
        lines.append(f"  server      {s['steps']} decode steps, {_seconds(s['step_s'])} a step, "
                     f"{s['busy_rows']:.2f} of {s['batch']} rows busy a step")
    lines += [f"  error       {e}" for e in r["errors"]]
    if any("outside the vocabulary" in e for e in r["errors"]):
        lines.append("  (prompts draw ids below --token-ids: lower it under the model's vocabulary)")
    if r["note"]:
        lines.append(f"  NOTE: {r['note']}")
    return "\n".join(lines)


def _length_range(text: str) -> tuple[int, int]:
    try:
        low, _, high = text.partition(":")
        lo, hi = int(low), int(high or low)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not LOW:HIGH (two whole numbers, e.g. 16:256)")
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"'{text}': need 1 <= LOW <= HIGH")
    return lo, hi


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options; what follows `--` goes to `mkc serve` (as `serve_args`)."""
    ap = server_parser(__doc__)
    ap.add_argument("--requests", type=at_least(1), default=200, help="requests in all (default 200)")
    ap.add_argument("--concurrency", type=at_least(1), default=16,
                    help="requests in flight at once (default 16)")
    ap.add_argument("--prompt-tokens", type=_length_range, default=(16, 512), metavar="LOW:HIGH",
                    help="prompt lengths, drawn log-uniformly (default 16:512)")
    ap.add_argument("--output-tokens", type=_length_range, default=(16, 256), metavar="LOW:HIGH",
                    help="output lengths (max_tokens, EOS ignored), drawn log-uniformly (default 16:256)")
    ap.add_argument("--token-ids", type=at_least(1), default=PROMPT_TOKEN_IDS, metavar="N",
                    help=f"prompt token ids are drawn from 0 to N - 1 (default {PROMPT_TOKEN_IDS}: "
                         "inside the vocabulary of every model served here)")
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="sampling temperature (default 0: greedy, as speculative decoding serves)")
    ap.add_argument("--seed", type=int, default=0, help="the workload's seed (default 0)")
    ap.add_argument("--timeout", type=float, default=600.0,
                    help="seconds a request may wait for its next chunk (default 600)")
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = parse_server_args(ap, argv)
    if not 0 <= args.temperature <= 2:
        ap.error("--temperature must be from 0 to 2")
    if not args.timeout > 0:
        ap.error("--timeout must be positive")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if httpx is None:
        print("serve_load: needs httpx: pip install httpx (or the test extra: pip install -e "
              "\".[test]\")", file=sys.stderr)
        return 2
    command = shlex.join(["benchmarks/serve_load.py", *argv])

    def run() -> int:
        report = against_server(args, lambda url: asyncio.run(measure(url, args, command)), "serve_load")
        print(json.dumps(report, indent=2) if args.json else render(report))
        return 0 if report["completed"] and not report["failed"] else 1
    return exit_status("serve_load", run)


if __name__ == "__main__":
    sys.exit(main())
