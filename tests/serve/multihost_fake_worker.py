"""`mkc serve` (mkc.cli.main, its arguments as given) with the serving tests' stand-in module
(serve_fakes) in place of the compiled spec, for the multi-process tests: jax.distributed, the
launch descriptors, the lockstep confirmations, HTTP and shutdown are the real ones; only the
kernel is the stand-in. `--speculative` drafts with the stand-in's own greedy continuation
(every draft kept), so verify launches reach the followers.

    python tests/serve/multihost_fake_worker.py [--skew] SPEC --model NAME [mkc serve options]

`--skew`: this process's stand-in gives other tokens (a follower out of step).
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import jax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
import numpy as np  # noqa: E402

import mkc.cli  # noqa: E402
import mkc.serve.model  # noqa: E402
import serve_fakes  # noqa: E402


def main(argv: list[str]) -> int:
    skew = "--skew" in argv
    argv = [a for a in argv if a != "--skew"]

    def load_served(spec, model, batch=None, seed=0, tokenizer=None, place=True, name=None):
        gen = serve_fakes.fake_module()
        if skew:
            step = gen.make_decode_step

            def make_decode_step(mesh, B, interpret=None):
                inner = step(mesh, B, interpret)

                def skewed(weights, state, tokens, positions):
                    logits, nxt, state = inner(weights, state, tokens, positions)
                    return jax.numpy.roll(logits, 1, axis=-1), nxt, state
                return skewed
            gen.make_decode_step = make_decode_step
        mesh = Mesh(np.array(jax.local_devices()[:1]), ("tp",))
        served = mkc.serve.model.Served(name=name or model, gen=gen, weights={}, mesh=mesh, interpret=None,
                                        tokenizer=None, eos_token_ids=frozenset({serve_fakes.EOS}))
        return served, batch or 2

    mkc.serve.model.load_served = load_served
    mkc.cli._drafter = lambda args, served, batch: (serve_fakes.fake_greedy if args.speculative else None)
    return mkc.cli.main(["serve", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
