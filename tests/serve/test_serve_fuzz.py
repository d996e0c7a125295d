"""The fuzz campaign's `serve` target in its quick form: seeded hostile requests of every kind
(tests/fuzz/serve.py) against mkc serve's API and engine over the stand-in module, each
beside good requests; and its verdicts on answers that are not acceptable."""
from __future__ import annotations

import json

import pytest

from fuzz import serve as fuzz_serve
from fuzz.targets import available_targets, make_case
from fuzz.worker import run_case

SEED = 0
CASES_PER_KIND = 20           # the campaign (benchmarks/fuzz_campaign.py --target serve) runs thousands
CASES = {"serve_slow": 6}     # each waits out a timeout: a second or two


@pytest.fixture(scope="module")
def server():
    with fuzz_serve.stand_in_server() as url:
        yield fuzz_serve.Server(url)


@pytest.mark.parametrize("kind", list(fuzz_serve.KINDS))
def test_hostile_requests_are_refused_cleanly_and_harm_no_neighbour(server, kind):
    outcomes = {i: server.run(SEED, i, kind) for i in range(CASES.get(kind, CASES_PER_KIND))}
    bad = {i: o for i, o in outcomes.items() if o["cls"] != "ok"}
    assert not bad, json.dumps(bad, indent=1)[:3000]


def test_the_campaign_runs_serve_cases(server, monkeypatch, tmp_path):
    monkeypatch.setattr(fuzz_serve, "_SERVER", server)
    assert "serve" in available_targets()
    case = make_case(SEED, 3, target="serve")
    assert case.target == "serve" and case.kind in fuzz_serve.KINDS
    outcome = run_case(case, tmp_path)
    assert outcome["cls"] == "ok", outcome


@pytest.mark.parametrize("status, content_type, content, verdict", [
    (500, "text/plain", b"Internal Server Error", "traceback"),
    (503, "text/plain", b"Service Unavailable", "traceback"),
    (503, "application/json", b'{"error": {"message": "m", "type": "t", "param": null, "code": 503}}', None),
    (500, "application/json", b'{"error": {"message": "m", "type": "t", "param": null, "code": 500}}',
     "traceback"),
    (400, "text/plain", b"bad", "bad_output"),
    (400, "application/json", b'{"detail": "x"}', "bad_output"),
    (422, "application/json", b'{"error": {"message": "m", "type": "t", "param": null, "code": 400}}',
     "bad_output"),
    (200, "text/event-stream", b'data: {"error": {"message": "decode step failed"}}\n\ndata: [DONE]\n\n',
     "bad_output"),
    (400, "application/json", b'{"error": {"message": "m", "type": "t", "param": null, "code": 400}}', None),
    (200, "text/event-stream", b'data: {"choices": []}\n\ndata: [DONE]\n\n', None),
])
def test_answers_are_judged(status, content_type, content, verdict):
    out = fuzz_serve.judge(status, content_type, content, "POST")
    assert (out and out[0]) == verdict
