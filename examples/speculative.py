"""Speculative greedy generation with a generated module's verify step, in TPU interpret mode
on virtual CPU devices (MINI config, random weights).

Each launch verifies the anchor (the last token, not yet in the state) and up to R - 1 drafts.
By default a draft model proposes them (`mkc.serve.drafting.DraftModel`, as `mkc serve
--speculative draft-model`: with random MINI weights no small model agrees with the kernel, so
the same model in the reference's plain f32 stands in for one);
`--drafter lookup` proposes the continuation of the most recent earlier occurrence of the
context's last n-gram (no second model, but random weights rarely repeat themselves). Greedy
acceptance keeps the drafts the model itself would have produced, plus the model's own token
after them; `commit` keeps the state after the accepted rows. The prompt is fed the same way,
R tokens per launch, all accepted.

    .venv/bin/python examples/speculative.py --tokens 12
    .venv/bin/python examples/speculative.py --spec schedules/qwen3_5_35b_a3b.sched --model qwen3_5_moe_mini

Prints the tokens, the launches and the mean acceptance length (tokens per launch), and checks
the text against plain greedy decoding by the family's pure-JAX reference in its
rounding-emulating mode (rounding where the kernel rounds: with random MINI weights the top
two logits are sometimes within 1e-3, where f32 and bf16 rounding pick different tokens), token
for token: exits 1 if they differ. `--drafter oracle` (for tests) drafts that greedy text with
one draft per launch corrupted, so acceptance lengths vary and rejections happen.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
from mkc.numerics import pin_cpu_isa  # noqa: E402

pin_cpu_isa()      # the same vector routines on every x86 host (mkc.numerics)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generated_module import (add_interpret_host_option, check_spec_and_model, interpret_host,  # noqa: E402
                              load_generated, rounding_for)

from mkc.arguments import int_at_least  # noqa: E402
from mkc.checkpoint import family_of  # noqa: E402
from mkc.serve.drafting import DraftModel, accepted_rows, prompt_lookup  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def oracle(greedy: list[int], prompt_len: int):
    """A drafter that knows the greedy text but corrupts one draft per launch (a different one
    each time, sometimes past the last): for testing acceptance and rejection."""
    launches = []

    def draft(context: list[int], drafts: int) -> list[int]:
        done = len(context) - prompt_len
        out = list(greedy[done:done + drafts])
        bad = len(launches) % (drafts + 1)
        if bad < len(out):
            out[bad] = (out[bad] + 1) % 7
        launches.append(bad)
        return out
    return draft


def speculative_generate(gen, weights, prompt: list[int], new_tokens: int, rows: int, mesh,
                         interpret, drafter=prompt_lookup) -> tuple[list[int], list[int]]:
    """Greedy generation of `new_tokens` after `prompt` (one sequence) -> (tokens, tokens
    emitted per generating launch)."""
    state = gen.init_state(1)
    position = 0

    def padded(tokens: list[int]) -> np.ndarray:
        # Every launch has `rows` rows (one compiled kernel); rows past the real tokens are
        # never accepted.
        return np.array([tokens + [tokens[-1]] * (rows - len(tokens))])

    # The prompt, `rows` tokens per launch; the last prompt token becomes the first anchor.
    for i in range(0, len(prompt) - 1, rows):
        chunk = prompt[i:min(i + rows, len(prompt) - 1)]
        _, _, verified = gen.verify_step(weights, state, padded(chunk), np.array([position]),
                                         mesh=mesh, interpret=interpret)
        state = gen.commit(state, verified, np.array([len(chunk)]))
        position += len(chunk)
    context, out, per_launch = list(prompt), [], []
    while len(out) < new_tokens:
        drafts = drafter(context, rows - 1)
        row_tokens = [context[-1]] + drafts
        _, next_token, verified = gen.verify_step(weights, state, padded(row_tokens),
                                                  np.array([position]), mesh=mesh,
                                                  interpret=interpret)
        predicted = np.asarray(next_token)[0].tolist()
        accepted = accepted_rows(row_tokens, len(drafts), predicted)
        emitted = predicted[:accepted]          # accepted drafts, then the model's next token
        state = gen.commit(state, verified, np.array([accepted]))
        position += accepted
        context += emitted
        out += emitted
        per_launch.append(len(emitted))
    return out[:new_tokens], per_launch


def reference_greedy(reference, hf, cfg, rounding, prompt: list[int], new_tokens: int,
                     context: int, stop_token: int | None = None) -> list[int]:
    """Greedy decoding by the reference in its rounding-emulating mode (ending after
    `stop_token`, when it is generated)."""
    cache = reference.init_cache(cfg, 1, context)
    out: list[int] = []
    for position in range(len(prompt) + new_tokens - 1):
        token = prompt[position] if position < len(prompt) else out[-1]
        logits, cache = reference.decode_step(hf, cfg, cache, jnp.array([token], jnp.int32),
                                              jnp.array([position], jnp.int32), rounding)
        if position >= len(prompt) - 1:
            out.append(int(np.argmax(np.asarray(logits)[0])))
            if out[-1] == stop_token:
                break
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "schedules" / "qwen3_8_27b.sched"),
                    help="a schedule with `verify R` (default: the shipped Qwen 3.8 27B spec)")
    ap.add_argument("--model", default="qwen3_8_mini", help="a shipped MINI config (random weights)")
    ap.add_argument("--prompt", default="5,17,99,5,17,42,5,17",
                    help="comma-separated prompt token ids")
    ap.add_argument("--tokens", type=int_at_least(1), default=12, help="tokens to generate")
    ap.add_argument("--rows", type=int_at_least(1),
                    help="rows per verify step (default: the spec's verify width)")
    ap.add_argument("--mode", choices=("on_wait", "eager"), default="on_wait",
                    help="when interpret mode's DMAs land: at their wait, or as soon as issued")
    ap.add_argument("--drafter", choices=("model", "lookup", "oracle"), default="model",
                    help="drafts from a draft model (model: the reference in plain f32, standing "
                         "in for a small model), from the context's last n-gram (lookup: "
                         "random weights rarely repeat, so few drafts land), or the reference's "
                         "greedy text with one wrong draft a launch (oracle, for tests)")
    add_interpret_host_option(ap)
    ap.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    args = ap.parse_args(argv)
    check_spec_and_model(ap, args)
    interpret_host(args)

    config = json.loads((ROOT / f"mkc/model/configs/{args.model}.json").read_text())
    reference = family_of(config).module("reference")
    cfg = reference.load_config(config)
    hf = reference.init_params(cfg, seed=0)
    gen = load_generated(Path(args.spec), args.model)
    if not hasattr(gen, "verify_step"):
        print(f"{args.spec} declares no verify step: add `verify R` to it", file=sys.stderr)
        return 2
    rows = args.rows or gen.VERIFY_ROWS
    if rows > gen.VERIFY_ROWS:
        ap.error(f"--rows {rows}: the spec's verify step takes at most {gen.VERIFY_ROWS}")
    try:
        prompt = [int(t) for t in args.prompt.split(",")]
    except ValueError:
        ap.error(f"--prompt {args.prompt!r}: expected comma-separated token ids, e.g. 5,17,99")
    if bad := [t for t in prompt if not 0 <= t < cfg.vocab_size]:
        ap.error(f"--prompt: token ids {bad[:5]} are outside the vocabulary (0 to {cfg.vocab_size - 1})")
    if len(prompt) + args.tokens > gen.CONTEXT:
        ap.error(f"--prompt and --tokens: {len(prompt)} + {args.tokens} tokens pass the context "
                 f"of {gen.CONTEXT}")
    mesh = Mesh(np.array(jax.devices()[:gen.RANKS]), (gen.AXIS,))
    weights = gen.place_weights(hf, mesh)

    greedy = reference_greedy(reference, hf, cfg, rounding_for(Path(args.spec), args.model), prompt,
                              args.tokens, gen.CONTEXT)
    drafter = {"model": lambda: DraftModel(config, hf, gen.CONTEXT),
               "lookup": lambda: prompt_lookup,
               "oracle": lambda: oracle(greedy, len(prompt))}[args.drafter]()
    t0 = time.perf_counter()
    tokens, per_launch = speculative_generate(gen, weights, prompt, args.tokens, rows, mesh,
                                              pltpu.InterpretParams(dma_execution_mode=args.mode),
                                              drafter)
    seconds = time.perf_counter() - t0
    mean = sum(per_launch) / len(per_launch)
    print(f"prompt {prompt}")
    print(f"speculative {tokens}")
    print(f"greedy      {greedy}")
    print(f"{len(per_launch)} verify launches of up to {rows} rows for {args.tokens} tokens "
          f"(tokens per launch {per_launch}); mean acceptance length {mean:.2f}; {seconds:.0f} s "
          "in interpret mode")
    same = tokens == greedy
    print("equal to plain greedy decoding" if same else "FAIL: differs from plain greedy decoding")
    if args.json:
        print("JSON " + json.dumps({"tokens": tokens, "greedy": greedy, "per_launch": per_launch,
                                    "mean_acceptance": mean, "rows": rows}))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
