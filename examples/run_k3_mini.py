"""Compile the Kimi K3 schedule against the MINI config on 2 hosts (tpu7x 2x2x2: 16 cores) and
run decode steps in TPU interpret mode on 16 virtual CPU devices, checking every step against
the pure-JAX reference.

    .venv/bin/python examples/run_k3_mini.py --steps 2 --mode on_wait
    .venv/bin/python examples/run_k3_mini.py --mode eager --races

The MINI config (16 heads, 32 experts) needs 16 cores: the spec's topology is rewritten from
2x2x4 to 2x2x2, which also re-derives the collectives' groups (2 hosts instead of 4). Prints
one line per step and, with --json, a final JSON summary (used by the tests).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generated_module import load_generated  # noqa: E402

from mkc.reference import kimi_k3 as reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def mini_spec() -> Path:
    """The shipped K3 spec on 2 hosts, for the MINI config."""
    text = (ROOT / "schedules" / "kimi_k3.sched").read_text()
    text = text.replace("topology 2x2x4", "topology 2x2x2").replace("tp = 32", "tp = 16")
    path = Path(tempfile.mkdtemp(prefix="mkc-k3-")) / "kimi_k3.sched"
    path.write_text(text)
    return path


def _relative_error(ours: np.ndarray, ref) -> float:
    ref = np.asarray(ref, np.float32)
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--mode", choices=("on_wait", "eager"), default="on_wait")
    ap.add_argument("--races", action="store_true", help="detect_races with vector_clock_size=64")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)

    config = json.loads((ROOT / "mkc/model/configs/kimi_k3_mini.json").read_text())
    cfg = reference.load_config(config)
    hf = reference.init_params(cfg, seed=0)
    gen = load_generated(mini_spec(), "kimi_k3_mini")

    B = args.batch
    mesh = Mesh(np.array(jax.devices()[:gen.RANKS]), (gen.AXIS,))
    params = pltpu.InterpretParams(dma_execution_mode=args.mode, detect_races=args.races,
                                   vector_clock_size=64 if args.races else None)
    t0 = time.perf_counter()
    weights = gen.place_weights(hf, mesh)
    pack_seconds = time.perf_counter() - t0
    state = gen.init_state(B)
    cache = reference.init_cache(cfg, B, gen.CONTEXT)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
    # Rows at different positions past the first latent tile: per-row masking, cache writes
    # inside a 16-row block and multi-tile streaming are all exercised.
    positions = jnp.asarray((136 + 131 * np.arange(B)) % (gen.CONTEXT - args.steps), jnp.int32)
    summary = {"steps": [], "mode": args.mode, "races": args.races, "batch": B,
               "pack_seconds": pack_seconds}
    for i in range(args.steps):
        t0 = time.perf_counter()
        logits, next_token, state = gen.decode_step(weights, state, tokens, positions,
                                                    mesh=mesh, interpret=params)
        logits.block_until_ready()
        seconds = time.perf_counter() - t0
        ref_logits, cache = reference.decode_step(hf, cfg, cache, tokens, positions)
        ref_next = np.asarray(jnp.argmax(ref_logits, axis=-1))
        ours = gen.reference_states(state)
        errors = {kind: max(_relative_error(ours[k], cache[k]) for k in ours if k.endswith(kind))
                  for kind in ("recurrent_state", "conv_state", "latent_cache")}
        rec = {"step": i, "seconds": seconds,
               "logits_max_abs_err": float(jnp.max(jnp.abs(logits - ref_logits))),
               "logits_max_abs": float(jnp.max(jnp.abs(ref_logits))),
               "next_token": np.asarray(next_token).tolist(), "ref_next_token": ref_next.tolist(),
               "state_rel_err": errors}
        summary["steps"].append(rec)
        print(f"step {i}: {seconds:.1f} s, logits |err| {rec['logits_max_abs_err']:.4f} "
              f"(|ref| {rec['logits_max_abs']:.2f}), relative errors: recurrent "
              f"{errors['recurrent_state']:.1e}, conv {errors['conv_state']:.1e}, latent cache "
              f"{errors['latent_cache']:.1e}; next {rec['next_token']} (reference "
              f"{rec['ref_next_token']})", flush=True)
        tokens = jnp.asarray(ref_next, jnp.int32)   # teacher-force so both stay on one path
        positions = positions + 1
    if args.races:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        summary["races_found"] = bool(ipc.races.races_found)
        print(f"races found: {summary['races_found']}")
    if args.json:
        print("JSON " + json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
