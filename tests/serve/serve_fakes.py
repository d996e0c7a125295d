"""A stand-in for a generated module, for testing the serving engine and API without running a
kernel: one rank, one per-row recurrent state, and a step whose next token depends on the
row's whole history (so a row reused without its state cleared, or a row fed another row's
token, gives other tokens than `fake_greedy`)."""
from __future__ import annotations

import contextlib
import threading
import time
import types
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

VOCAB = 64
CONTEXT = 32
EOS = VOCAB - 1
VERIFY_ROWS = 3


def _next(total, position):
    # never EOS on its own: the tests choose when a request stops
    return (total * 7 + position * 3 + 1) % (VOCAB - 1)


def fake_module(batch_range=(1, 4), verify: bool = True, step_seconds: float = 0.0):
    """`verify=False`: as a module compiled without a `verify` line (no verify step, commit or
    ROW_STATES; its per-row state known only as no kind's KV cache); `step_seconds`: how long
    a decode step takes (as a real kernel's would), 0 as fast as it runs."""
    def init_state(B):
        return {"rec": np.zeros((1, 1, B, 1), np.float32)}   # rank, layer, row, value

    def make_decode_step(mesh, B, interpret=None):
        @jax.jit
        def step(weights, state, tokens, positions):
            rec = state["rec"] + tokens.astype(jnp.float32).reshape(1, 1, B, 1)
            nxt = _next(rec.reshape(B).astype(jnp.int32), positions)
            logits = jax.nn.one_hot(nxt, VOCAB) * 10.0
            return logits, nxt, {"rec": rec}
        if not step_seconds:
            return step

        def slow(*args):
            time.sleep(step_seconds)
            return step(*args)
        return slow

    def state_shapes(S, R=1):
        return {"rec": ((1, S * R, 1), np.float32)}

    def make_verify_step(mesh, S, R, interpret=None):
        # R rows a sequence at consecutive positions; the state after every row (row r * S + s)
        @jax.jit
        def step(weights, caches, states, tokens, starts):
            totals = states["rec"].reshape(1, S) + jnp.cumsum(tokens.astype(jnp.float32), axis=1).T
            nxt = _next(totals.T.astype(jnp.int32), starts[:, None] + jnp.arange(R)[None, :])
            return jax.nn.one_hot(nxt, VOCAB) * 10.0, nxt, {"rec": totals.reshape(1, 1, R * S, 1)}
        return step

    def commit(state, verified, accepted):
        S = state["rec"].shape[2]
        rows = [(int(a) - 1) * S + s for s, a in enumerate(np.asarray(accepted))]
        return {"rec": verified["rec"][:, :, np.array(rows)]}

    gen = types.SimpleNamespace(
        BATCH_RANGE=batch_range, CONTEXT=CONTEXT, AXIS="tp", KINDS={},
        DIMS=types.SimpleNamespace(vocab_size=VOCAB), init_state=init_state,
        make_decode_step=make_decode_step, state_shapes=state_shapes)
    if verify:
        gen.__dict__.update(ROW_STATES={"rec": 0}, VERIFY_ROWS=VERIFY_ROWS, VERIFY_SEQUENCES=(1, 2),
                            make_verify_step=make_verify_step, commit=commit)
    return gen


def fake_prefill(tokens: list[int]) -> dict[str, np.ndarray]:
    """`--prefill reference`'s prefiller for the stand-in: its state of one sequence after
    `tokens` (rank, layer, row, value), as its own steps would leave it."""
    return {"rec": np.full((1, 1, 1, 1), sum(tokens), np.float32)}


def fake_mesh():
    return Mesh(np.array(jax.devices()[:1]), ("tp",))


def fake_greedy(prompt: list[int], n: int) -> list[int]:
    """What the fake model generates greedily after `prompt` from a clean state."""
    total, out = 0, []
    history = list(prompt)
    for position in range(len(prompt) + n - 1):
        total += history[position]
        if position >= len(prompt) - 1:
            out.append(int(_next(total, position)))
            history.append(out[-1])
    return out


def fake_prompt_logprobs(prompt: list[int]) -> list[float]:
    """The fake model's logprob of each prompt token past the first, under its logits at the
    position before (a one-hot of 10 over VOCAB tokens), from a clean state."""
    total, out = 0, []
    for position, token in enumerate(prompt[:-1]):
        total += token
        hit = prompt[position + 1] == _next(total, position)
        out.append(10.0 * hit - float(np.log(np.exp(10.0) + VOCAB - 1)))
    return out


class LetterTokenizer:
    """Token t is the letter chr(97 + t % 26), one a character (in pure Python, so a long text
    takes as long to encode as a real tokenizer's CPU work); a chat is its messages' texts. Every
    id it makes is a token of the stand-in's vocabulary."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) % 26 for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(97 + t % 26) for t in ids)

    def chat(self, messages: list[dict]) -> list[int]:
        from mkc.serve.model import _text_of
        return self.encode("".join(_text_of(m.get("content")) for m in messages))


@contextlib.contextmanager
def fake_server(batch: int = 2, queue: int = 8, tokenizer=None, name: str = "fake_mini",
                limits=None, step_seconds: float = 0.0) -> Iterator[str]:
    """The HTTP API over the stand-in module (its steps `step_seconds` long), on uvicorn in a
    thread of this process (as `mkc serve` configures it, under `limits`, default
    mkc.serve.api.Limits()): its URL (for clients that need a real socket: the load and eval
    scripts)."""
    import uvicorn

    from mkc.serve.api import Limits, uvicorn_config
    from mkc.serve.engine import Engine
    from mkc.serve.launch import free_port
    from mkc.serve.model import Served
    gen = fake_module(step_seconds=step_seconds)
    served = Served(name=name, gen=gen, weights={}, mesh=fake_mesh(), interpret=None,
                    tokenizer=tokenizer, eos_token_ids=frozenset({EOS}))
    engine = Engine(gen, {}, served.mesh, batch, None, max_queue=queue, eos_token_ids=served.eos_token_ids)
    engine.start()
    port = free_port()
    server = uvicorn.Server(uvicorn_config(served, engine, "127.0.0.1", port, limits or Limits(),
                                           log_level="warning"))
    thread = threading.Thread(target=server.run, name="mkc-serve-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)
        engine.stop()
