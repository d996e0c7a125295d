"""`mkc serve` for real: the MINI Qwen module (schedules/qwen3_8_27b.sched for qwen3_8_mini) in
TPU interpret mode at batch 2, one server process for each prefill (through the decode step,
the verify step, and the family reference under jit), driven by OpenAI's own client. Every
greedy completion must equal the family reference's greedy decoding of its prompt (in its
rounding-emulating mode, as examples/speculative.py compares) token for token, whichever rows
the requests share and in whatever order they arrive."""
from __future__ import annotations

import concurrent.futures
import time

import pytest

from mkc.numerics import pin_cpu_isa

pin_cpu_isa()       # the same vector routines as the server's kernel (mkc.numerics)

import httpx  # noqa: E402
import openai  # noqa: E402
from serve_process import MODEL, reference_greedy, running_server  # noqa: E402
from serve_process import token_ids as _tokens  # noqa: E402

pytestmark = pytest.mark.slow      # interpret-mode steps: about a minute per server

BATCH = 2


# Through the verify step and through the reference: a minute more each, in the extended tier
# (CI's speculative server prefills through the verify step, tests/serve/test_serve_speculative.py;
# test_serve_prefill.py holds the reference's jitted emulation bit-equal to the eager one)
@pytest.fixture(scope="module", params=["decode", pytest.param("verify", marks=pytest.mark.extended),
                                        pytest.param("reference", marks=pytest.mark.extended)])
def server(request):
    with running_server(["--batch", str(BATCH), "--queue", "4", "--prefill", request.param]) as url:
        yield url


@pytest.fixture
def decode_server(server, request):
    """Streaming, cancelling and refusing do not depend on how a prompt is prefilled: they run
    on the decode-prefill server only."""
    if request.node.callspec.params["server"] != "decode":
        pytest.skip("prefill-independent: run on the decode-prefill server")
    return server


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def greedy():
    return reference_greedy()


PROMPTS = [([5, 17, 99], 3), ([1000], 3), ([7, 7], 2)]


def test_concurrent_requests_equal_greedy_decoding(client, greedy):
    # three requests on two rows: they sit at different positions in one step, and the third
    # takes over a freed row (whose recurrent state must start clean)
    def complete(i):
        time.sleep(0.2 * i)          # arrival order: as listed
        prompt, n = PROMPTS[i]
        return client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)

    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        results = list(pool.map(complete, range(len(PROMPTS))))
    for (prompt, n), result in zip(PROMPTS, results):
        expected, finish = greedy(prompt, n)
        assert _tokens(result.choices[0]) == expected, prompt
        assert result.choices[0].finish_reason == finish
        assert result.usage.prompt_tokens == len(prompt)
        assert result.usage.completion_tokens == len(expected)


def test_streaming_equals_greedy_decoding(client, decode_server, greedy):
    prompt, n = [7, 7], 3
    stream = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0,
                                       stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    tokens = [t for c in chunks for choice in c.choices for t in _tokens(choice)]
    expected, finish = greedy(prompt, n)
    assert tokens == expected
    assert [choice.finish_reason for c in chunks for choice in c.choices][-1] == finish
    assert chunks[-1].usage.completion_tokens == len(expected)


def test_cancel_mid_stream_frees_the_row(client, decode_server, greedy):
    stream = client.completions.create(model=MODEL, prompt=[3, 4], max_tokens=40, temperature=0,
                                       stream=True)
    first = next(iter(stream))
    assert _tokens(first.choices[0])
    stream.close()
    prompt, n = [42], 2
    result = client.completions.create(model=MODEL, prompt=prompt, max_tokens=n, temperature=0)
    assert _tokens(result.choices[0]) == greedy(prompt, n)[0]
    deadline = time.monotonic() + 120
    while httpx.get(decode_server + "/stats").json()["busy_rows"]:
        assert time.monotonic() < deadline, "the cancelled request still holds its row"
        time.sleep(0.5)


def test_bad_requests_get_4xx_and_the_server_keeps_serving(client, decode_server):
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="nope", prompt=[1], max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="passes the context"):
        client.completions.create(model=MODEL, prompt=[1], max_tokens=10**6)
    with pytest.raises(openai.BadRequestError, match="the model's context is 4096"):
        client.completions.create(model=MODEL, prompt=[1] * 4097, max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="the prompt is empty"):
        client.completions.create(model=MODEL, prompt=[], max_tokens=1)
    r = httpx.post(decode_server + "/v1/completions", content=b'{"model": "qwen3_8_mini", "prompt": [1], '
                   b'"temperature": NaN}', headers={"content-type": "application/json"})
    assert r.status_code == 400 and "finite" in r.json()["error"]["message"]
    assert [m.id for m in client.models.list()] == [MODEL]
