"""Compile the Qwen schedule against the MINI config and run decode steps in TPU interpret mode
on 8 virtual CPU devices, checking every step against the pure-JAX reference.

    .venv/bin/python examples/run_mini.py --steps 3 --mode on_wait
    .venv/bin/python examples/run_mini.py --mode eager --races
    .venv/bin/python examples/run_mini.py --checkpoint DIR     # an HF-format checkpoint

Prints one line per step and, with --json, a final JSON summary (used by the tests).
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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generated_module import finish, load_generated  # noqa: E402

from mkc.checkpoint import load_checkpoint  # noqa: E402
from mkc.reference import qwen3_5 as reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _relative_errors(ours: dict, cache: dict, kind: str) -> float:
    """Largest ||ours - reference|| / ||reference|| over the layers holding this state."""
    worst = 0.0
    for name in (k for k in ours if k.endswith(kind)):
        ref = np.asarray(cache[name], np.float32)
        worst = max(worst, float(np.linalg.norm(ours[name] - ref) / np.linalg.norm(ref)))
    return worst


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--spec", default=str(ROOT / "schedules" / "qwen3_8_27b.sched"))
    ap.add_argument("--checkpoint", help="HF-format checkpoint dir (default: random MINI weights)")
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--mode", choices=("on_wait", "eager"), default="on_wait")
    ap.add_argument("--races", action="store_true", help="detect_races with vector_clock_size=64")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    if args.checkpoint:
        config, hf = load_checkpoint(args.checkpoint)
        model = str(Path(args.checkpoint).resolve())
    else:
        model = "qwen3_8_mini"
        config = json.loads((ROOT / "mkc/model/configs/qwen3_8_mini.json").read_text())
        hf = reference.init_params(reference.load_config(config), seed=0)
    cfg = reference.load_config(config)
    gen = load_generated(Path(args.spec), model)

    B = args.batch
    mesh = Mesh(np.array(jax.devices()[:gen.RANKS]), (gen.AXIS,))
    params = pltpu.InterpretParams(dma_execution_mode=args.mode, detect_races=args.races,
                                   vector_clock_size=64 if args.races else None)
    weights = gen.place_weights(hf, mesh)
    state = gen.init_state(B)
    cache = reference.init_cache(cfg, B, gen.CONTEXT)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
    # Rows start at different positions, past the first KV tile, so per-row masking, cache
    # writes inside a 16-row block and multi-tile KV streaming are all exercised.
    positions = jnp.asarray((136 + 131 * np.arange(B)) % (gen.CONTEXT - args.steps), jnp.int32)
    summary = {"steps": [], "mode": args.mode, "races": args.races, "batch": B}
    for i in range(args.steps):
        t0 = time.perf_counter()
        logits, next_token, state = gen.decode_step(weights, state, tokens, positions,
                                                    mesh=mesh, interpret=params)
        logits.block_until_ready()
        seconds = time.perf_counter() - t0
        ref_logits, cache = reference.decode_step(hf, cfg, cache, tokens, positions)
        ref_next = np.asarray(jnp.argmax(ref_logits, axis=-1))
        ours = gen.reference_states(state)
        # Every state the step carries: recurrent, conv, and the KV caches.
        errors = {kind: _relative_errors(ours, cache, kind)
                  for kind in ("recurrent_state", "conv_state", "key_cache", "value_cache")}
        rec = [k for k in ours if k.endswith("recurrent_state")]
        state_err = max(float(np.max(np.abs(ours[k] - np.asarray(cache[k])))) for k in rec)
        state_scale = max(float(np.max(np.abs(np.asarray(cache[k])))) for k in rec)
        state_rel = errors["recurrent_state"]
        rec = {"step": i, "seconds": seconds,
               "logits_max_abs_err": float(jnp.max(jnp.abs(logits - ref_logits))),
               "logits_max_abs": float(jnp.max(jnp.abs(ref_logits))),
               "next_token": np.asarray(next_token).tolist(), "ref_next_token": ref_next.tolist(),
               "state_max_abs_err": state_err, "state_max_abs": state_scale,
               "state_rel_err": state_rel, "cache_rel_err": errors}
        summary["steps"].append(rec)
        print(f"step {i}: {seconds:.1f} s, logits |err| {rec['logits_max_abs_err']:.4f} "
              f"(|ref| {rec['logits_max_abs']:.2f}), state |err| {state_err:.2e} of "
              f"{state_scale:.2f} (relative {state_rel:.1e}; conv {errors['conv_state']:.1e}, "
              f"keys {errors['key_cache']:.1e}, values {errors['value_cache']:.1e}), "
              f"next {rec['next_token']} (reference {rec['ref_next_token']})", flush=True)
        tokens = jnp.asarray(ref_next, jnp.int32)   # teacher-force so both stay on one path
        positions = positions + 1
    finish(summary, args.races, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
