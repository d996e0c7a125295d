"""Prefill through each of `mkc serve`'s paths, side by side on one module in one process: the
decode step a token a step (`decode`), the verify step R tokens a launch (`verify`), and the
family's reference under `jit` (`reference`, then one decode step for the last prompt token).

    JAX_PLATFORMS=cpu .venv/bin/python benchmarks/serve_prefill.py [--spec SPEC] [--model NAME]
        [--lengths 4,16,32] [--repeats 2] [--batch 1] [--modes decode,verify,reference]

Each mode gets its own serving engine (`mkc.serve.engine.Engine`, warmed up as `mkc serve`
warms it: its compile is reported apart), then serves greedy requests of `max_tokens` 1 with
prompts of each length (random token ids, `--seed`), one at a time on an otherwise idle batch:
the time to the first token is the prefill's. Prints, per mode and prompt length, the median
seconds to the first token and per prompt token, and each mode's ratio to `decode`; every
mode's first token must be the same (exit 1 otherwise). On a CPU host the kernel runs in TPU
interpret mode: the numbers compare the paths on this host, not on a TPU.
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "schedules" / "qwen3_8_27b.sched"))
    ap.add_argument("--model", default="qwen3_8_mini", help="a shipped config (random weights) or "
                                                            "a checkpoint directory")
    ap.add_argument("--lengths", type=_ints, default=[4, 16, 32], help="prompt lengths (tokens)")
    ap.add_argument("--repeats", type=int, default=2, help="requests per mode and length")
    ap.add_argument("--batch", type=int, default=1, help="the kernel's rows (one request at a time)")
    ap.add_argument("--modes", default="decode,verify,reference")
    ap.add_argument("--seed", type=int, default=0, help="the prompts' token ids")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")

    from mkc.serve.model import prepare_devices
    prepare_devices(args.spec)                       # before JAX starts
    import numpy as np

    from mkc import numerics
    from mkc.serve.engine import Engine, Request
    from mkc.serve.model import load_served
    from mkc.serve.prefill import ReferencePrefill
    from mkc.serve.sampling import SamplingParams

    print("$ " + shlex.join([sys.executable, *sys.argv]), flush=True)
    served, batch = load_served(args.spec, args.model, args.batch)
    gen = served.gen
    rng = np.random.default_rng(args.seed)
    prompts = {(L, i): rng.integers(0, gen.DIMS.vocab_size, L).tolist()
               for L in args.lengths for i in range(args.repeats)}

    async def first_token(engine: Engine, prompt: list[int]) -> tuple[float, int]:
        req = Request(prompt=prompt, sampling=SamplingParams(1, temperature=0.0),
                      loop=asyncio.get_running_loop())
        t0 = time.perf_counter()
        engine.submit(req)
        while (await req.events.get()).finish_reason is None:
            pass
        return time.perf_counter() - t0, req.generated[0]

    seconds: dict[tuple[str, int], list[float]] = {}
    tokens: dict[tuple[int, int], dict[str, int]] = {}
    for mode in modes:
        prefiller = (ReferencePrefill(gen, served.hf, numerics.rounding_from_ir(served.ir))
                     if mode == "reference" else None)
        engine = Engine(gen, served.weights, served.mesh, batch, served.interpret, prefill=mode,
                        prefiller=prefiller)
        warm = engine.warm_up()
        if prefiller is not None:             # the warm-up's compile is not a prefill
            prefiller.seconds, prefiller.tokens = 0.0, 0
        print(f"{mode}: warm-up (compiles) {warm:.1f} s", flush=True)
        engine.start()
        try:
            for (L, i), prompt in prompts.items():
                s, token = asyncio.run(first_token(engine, prompt))
                seconds.setdefault((mode, L), []).append(s)
                tokens.setdefault((L, i), {})[mode] = token
                print(f"  {mode} L={L} #{i}: first token {token} after {s:.2f} s "
                      f"({s / L:.3f} s a prompt token)", flush=True)
        finally:
            engine.stop()
        if prefiller is not None and prefiller.tokens:
            print(f"  reference steps alone: {prefiller.seconds / prefiller.tokens:.3f} s a token "
                  f"({prefiller.tokens} tokens)", flush=True)

    mode_where = "TPU interpret mode on CPU" if served.interpret is not None else "on device"
    print(f"\n{args.model} ({Path(args.spec).name}), batch {batch}, {mode_where}; median of "
          f"{args.repeats}: seconds to the first token (per prompt token)")
    others = [m for m in modes if m != "decode"] if "decode" in modes else []
    print("length  " + "".join(f"{m:>22}" for m in modes) + "".join(f"{m + '/decode':>18}" for m in others))
    for L in args.lengths:
        med = {m: statistics.median(seconds[(m, L)]) for m in modes}
        row = "".join(f"{med[m]:>10.2f} ({med[m] / L:.3f})".rjust(22) for m in modes)
        ratios = "".join(f"{med[m] / med['decode']:>18.3f}" for m in others)
        print(f"{L:>6}  {row}{ratios}")
    differ = {k: v for k, v in tokens.items() if len(set(v.values())) > 1}
    if differ:
        print(f"FAIL: the modes' first tokens differ: {differ}", file=sys.stderr)
        return 1
    print("every mode gave the same first token")
    return 0


if __name__ == "__main__":
    sys.exit(main())
