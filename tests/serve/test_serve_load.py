"""benchmarks/serve_load.py: its workload and percentiles; the whole run over HTTP against the API
on the stand-in module (serve_fakes, served by uvicorn in a thread: quick); its refusals and
429 counting over a mock transport; and (slow) the script starting a real MINI `mkc serve`
itself, whose report must say it is interpret mode."""
from __future__ import annotations

import asyncio
import json
import random
import sys

import httpx
import pytest
from serve_fakes import VOCAB, fake_server
from serve_process import MODEL, ROOT, SPEC, run_benchmark

sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_load  # noqa: E402

FIELDS = {"command", "url", "model", "requests", "concurrency", "prompt_tokens_range",
          "output_tokens_range", "temperature", "seed", "completed", "rejected_429", "failed", "errors",
          "duration_s", "output_tokens", "output_tokens_per_s", "requests_per_s", "ttft_s", "itl_s",
          "e2e_s", "server", "interpret", "note"}


def test_percentiles_interpolate_between_ranks():
    assert serve_load.percentile([], 50) is None
    assert serve_load.percentile([3.0], 99) == 3.0
    values = [4.0, 1.0, 3.0, 2.0]
    assert serve_load.percentile(values, 0) == 1.0 and serve_load.percentile(values, 100) == 4.0
    assert serve_load.percentile(values, 50) == 2.5
    assert serve_load.percentile(list(range(101)), 90) == 90


def test_workload_is_seeded_bounded_and_mixed():
    jobs = serve_load.workload(200, (16, 512), (4, 64), seed=3)
    assert jobs == serve_load.workload(200, (16, 512), (4, 64), seed=3)
    assert jobs != serve_load.workload(200, (16, 512), (4, 64), seed=4)
    prompts, outputs = [len(j.prompt) for j in jobs], [j.max_tokens for j in jobs]
    assert 16 <= min(prompts) and max(prompts) <= 512 and 4 <= min(outputs) and max(outputs) <= 64
    # log-uniform: as many short prompts (16 to 64) as long ones (128 to 512), both present
    short, long = sum(p < 64 for p in prompts), sum(p >= 128 for p in prompts)
    assert short > 40 and long > 40
    assert all(0 <= t < serve_load.PROMPT_TOKEN_IDS for j in jobs for t in j.prompt)
    assert max(t for j in serve_load.workload(50, (8, 8), (1, 1), 0, token_ids=5) for t in j.prompt) == 4
    assert len({j.seed for j in jobs}) == len(jobs)
    assert serve_load.length_mix(50, 7, 7, random.Random(0)) == [7] * 50


def check_report(report: dict, requests: int) -> None:
    assert FIELDS <= set(report), FIELDS - set(report)
    assert report["completed"] == requests and report["failed"] == 0 and report["rejected_429"] == 0
    assert report["output_tokens"] > 0 and report["output_tokens_per_s"] > 0
    assert report["requests_per_s"] > 0
    for key, qs in (("ttft_s", ("p50", "p90", "p99")), ("itl_s", ("p50", "p90", "p99")),
                    ("e2e_s", ("p50", "p99"))):
        values = [report[key][q] for q in qs]
        assert all(v is not None and v > 0 for v in values), (key, values)
        assert values == sorted(values), (key, values)


def test_a_run_over_http_reports_every_field(capsys):
    with fake_server() as url:
        status = serve_load.main(["--url", url, "--requests", "12", "--concurrency", "3",
                                  "--prompt-tokens", "1:8", "--output-tokens", "2:6",
                                  "--token-ids", str(VOCAB), "--json"])
    assert status == 0
    report = json.loads(capsys.readouterr().out)
    check_report(report, 12)
    jobs = serve_load.workload(12, (1, 8), (2, 6), 0, VOCAB)
    assert report["output_tokens"] == sum(j.max_tokens for j in jobs)      # EOS ignored
    assert report["model"] == "fake_mini" and report["interpret"] is False and report["note"] is None
    assert report["server"]["batch"] == 2 and report["server"]["steps"] > 0
    assert 0 < report["server"]["busy_rows"] <= 2
    assert report["command"].startswith("benchmarks/serve_load.py --url ")


def test_the_text_report(capsys):
    with fake_server() as url:
        assert serve_load.main(["--url", url, "--requests", "4", "--concurrency", "2", "--prompt-tokens",
                                "2:4", "--output-tokens", "2:3", "--token-ids", str(VOCAB)]) == 0
    out = capsys.readouterr().out
    assert "4 completed, 0 rejected (429), 0 failed" in out
    for name in ("TTFT", "ITL", "E2E", "output tokens/s"):
        assert name in out
    assert "NOTE" not in out


def test_a_workload_past_the_context_is_refused(capsys):
    with fake_server() as url:          # the stand-in's context is 32
        assert serve_load.main(["--url", url, "--prompt-tokens", "20", "--output-tokens", "20"]) == 2
    err = capsys.readouterr().err
    assert "past the model's context of 32" in err and "Traceback" not in err


def _mock(handler) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.MockTransport(handler))


def _sse(*events: dict) -> bytes:
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


def test_429s_are_counted_apart_from_failures():
    calls = iter(range(100))

    def handler(request: httpx.Request) -> httpx.Response:
        n = next(calls)
        if n % 3 == 0:
            return httpx.Response(429, json={"error": {"message": "the server is busy"}})
        if n % 3 == 1:
            return httpx.Response(500, json={"error": {"message": "generation failed"}})
        tokens = {"choices": [{"token_ids": [1], "text": ""}]}
        return httpx.Response(200, content=_sse(tokens, tokens, {"choices": [], "usage":
                                                                 {"completion_tokens": 2}}))

    async def run():
        async with _mock(handler) as client:
            jobs = serve_load.workload(9, (1, 2), (2, 2), 0)
            return await serve_load.run_load(client, "http://x", "m", jobs, 3, 0.0)
    outcomes, seconds = asyncio.run(run())
    report = serve_load.summarize(outcomes, seconds)
    assert (report["completed"], report["rejected_429"], report["failed"]) == (3, 3, 3)
    assert report["errors"] == ["500: generation failed"]
    assert report["output_tokens"] == 6


def test_an_error_in_the_stream_is_a_failure():
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=_sse({"choices": [{"token_ids": [1]}]},
                                                {"error": {"message": "step failed"}}))

    async def run():
        async with _mock(handler) as client:
            return await serve_load.one_request(client, "http://x", "m", serve_load.Job([1], 4, 0), 0.0)
    out = asyncio.run(run())
    assert not out.completed and not out.rejected and out.error == "in the stream: step failed"


@pytest.mark.parametrize("argv, message", [
    ([], "give either --url"),
    (["--url", "localhost:8000"], "is not an http:// or https:// URL"),
    (["--url", "http://127.0.0.1:1", "--model", "m"], "not with --url"),
    (["spec.sched"], "SPEC needs --model"),
    (["--url", "http://127.0.0.1:1", "--requests", "0"], "at least 1"),
    (["--url", "http://127.0.0.1:1", "--output-tokens", "a:b"], "is not LOW:HIGH"),
    (["--url", "http://127.0.0.1:1"], "cannot reach the server at http://127.0.0.1:1"),
    (["missing.sched", "--model", MODEL], "missing.sched: no such spec file"),
])
def test_bad_arguments_and_no_server_are_clear_errors(argv, message):
    r = run_benchmark("serve_load.py", *argv, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.extended
def test_the_script_starts_a_mini_server_and_measures_it():
    # decode prefill: no verify-step compile at start-up; prompts of 1 or 2 tokens and outputs
    # of 2: each request is 2 or 3 interpret-mode steps, 4 of them in each step
    r = run_benchmark("serve_load.py", str(SPEC), "--model", MODEL, "--requests", "8",
                      "--concurrency", "4", "--prompt-tokens", "1:2", "--output-tokens", "2:2", "--json",
                      "--", "--batch", "4", "--prefill", "decode", timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout)
    check_report(report, 8)
    assert report["interpret"] is True and "say nothing about TPU speed" in report["note"]
    assert report["server"]["batch"] == 4
