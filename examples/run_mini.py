"""Compile a schedule against a MINI config and run decode steps in TPU interpret mode on
virtual CPU devices (16 of them; Qwen3.5 by default; any family on the generic module, e.g.
`--spec schedules/qwen3_5_35b_a3b.sched --model qwen3_5_moe_mini`), checking every step
against the family's pure-JAX reference: plainly (f32, the independent oracle) and in its
rounding-emulating mode (rounding where the kernel rounds, taken from the spec's schedule IR),
with the tolerances of `mkc.numerics`.

    .venv/bin/python examples/run_mini.py --steps 3 --mode on_wait
    .venv/bin/python examples/run_mini.py --mode eager --races
    .venv/bin/python examples/run_mini.py --checkpoint DIR     # an HF-format checkpoint
    .venv/bin/python examples/run_mini.py --mutants gqa.o_proj,gdn.gated_norm --steps 1
    .venv/bin/python examples/run_mini.py --spec schedules/qwen3_5_35b_a3b.sched --model qwen3_5_moe_mini
    .venv/bin/python examples/run_mini.py --verify --steps 4 --batch 1   # one verify step of 4 rows

With --verify the kernel runs one verify step instead: the --steps tokens of each of the
--batch sequences as consecutive rows, each row judged like the decode step it replaces (its
logits, and the state committed after it).

Prints one line per step and, with --json, a final JSON summary (used by the tests). Exits 1
when the kernel disagrees with either reference. --mutate NAME runs a copy of the generated
module with one op scaled by 1.01 (`generated_module.MUTANTS`; a name that does not apply to
the spec is a usage error naming those that do) instead: it must exit 1.
--mutants A,B runs the module, then each mutant in the same process; it exits 0 only if the
module passes and every mutant is rejected. --context fit runs the spec at the least context
that holds every row's positions (the tests do: interpret mode copies every launch's caches).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=16").strip()
from mkc.numerics import pin_cpu_isa  # noqa: E402

pin_cpu_isa()      # the same vector routines on every x86 host (mkc.numerics)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.experimental.pallas import tpu as pltpu  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from generated_module import (add_context_option, add_interpret_host_option,  # noqa: E402
                              add_mutant_options, at_context, check_applicable_mutants,
                              check_batch, check_mutant_options, check_spec_and_model,
                              finish, interpret_host,
                              load_generated,
                              plain_trajectory, rounding_for, row_positions, step_references,
                              run_kernel, run_mutants, run_verify)

from mkc.checkpoint import CheckpointError, family_of, load_checkpoint  # noqa: E402
from mkc.diagnostics import MkcError  # noqa: E402
from mkc.arguments import int_at_least  # noqa: E402
from mkc.numerics import host_facts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", default=str(ROOT / "schedules" / "qwen3_8_27b.sched"),
                    help="the schedule to compile (default: the shipped Qwen 3.8 27B spec)")
    ap.add_argument("--model", default="qwen3_8_mini", help="a shipped MINI config (random weights)")
    ap.add_argument("--checkpoint", help="HF-format checkpoint dir (instead of --model)")
    ap.add_argument("--batch", type=int_at_least(1), default=2, help="rows (sequences) per step")
    ap.add_argument("--steps", type=int_at_least(1), default=3, help="decode steps to run and judge")
    ap.add_argument("--mode", choices=("on_wait", "eager"), default="on_wait",
                    help="when interpret mode's DMAs land: at their wait, or as soon as issued")
    ap.add_argument("--races", action="store_true", help="detect_races with vector_clock_size=64")
    ap.add_argument("--mutate", help="run this mutant (one op scaled by 1.01) instead of the module")
    ap.add_argument("--emulation-check", choices=("exact", "flips", "none"), default="exact",
                    help="how the rounding emulation judges every step, from the kernel's own "
                         "state (mkc.numerics): 'exact' (to f32 rounding, the default), 'flips' "
                         "(a few bf16 roundings may flip), or 'none' (reported only)")
    ap.add_argument("--strict-emulation", action="store_true", help="same as --emulation-check exact")
    ap.add_argument("--verify", action="store_true",
                    help="one verify step of --steps rows per sequence instead of decode steps")
    ap.add_argument("--first-position", type=int_at_least(0),
                    help="row 0's position (rows b > 0: + 131 b); default 136, 141 with --verify")
    add_mutant_options(ap)
    add_interpret_host_option(ap)
    add_context_option(ap)
    ap.add_argument("--kernel-state", action="store_true",
                    help="after each decode step, write the state's reference view back in the "
                         "kernel's layout (kernel_state) and require the kernel's state exactly")
    ap.add_argument("--json", action="store_true", help="also print the summary as one JSON line")
    args = ap.parse_args(argv)
    check_spec_and_model(ap, args)
    check_mutant_options(ap, args)
    replaced = interpret_host(args)

    # A verify step's rows start 3 before a 16-row block ends (141, 142, 143 | 144).
    first = args.first_position if args.first_position is not None else (141 if args.verify else 136)
    model = str(Path(args.checkpoint).resolve()) if args.checkpoint else args.model
    spec = at_context(ap, Path(args.spec), model, args.context, first, args.batch, args.steps)
    try:        # compiled first: a model the spec cannot run is refused before a weight is read
        check_applicable_mutants(ap, args, spec, model)
        gen = load_generated(spec, model, args.mutate)
        if args.checkpoint:
            config, hf = load_checkpoint(args.checkpoint)
        else:
            config = json.loads((ROOT / f"mkc/model/configs/{model}.json").read_text())
    except MkcError as e:
        print(e.render(spec.read_text()), file=sys.stderr)
        return 1
    except CheckpointError as e:
        print(f"{args.checkpoint}: {e}\n  hint: {e.hint}", file=sys.stderr)
        return 1
    family = family_of(config)
    reference = family.module("reference")
    cfg = reference.load_config(config)
    if not args.checkpoint:
        hf = reference.init_params(cfg, seed=0)
    check_batch(ap, gen, args.batch)
    rounding = rounding_for(spec, model)

    B = args.batch
    mesh = Mesh(np.array(jax.devices()[:gen.RANKS]), (gen.AXIS,))
    params = pltpu.InterpretParams(dma_execution_mode=args.mode, detect_races=args.races,
                                   vector_clock_size=64 if args.races else None)
    weights = gen.place_weights(hf, mesh)
    rng = np.random.default_rng(1)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, B), jnp.int32)
    positions = jnp.asarray(row_positions(first, B, gen.CONTEXT, args.steps), jnp.int32)
    # The checkpoint as the kernel holds it (a format that requantizes, e.g. Qwen3.5 MoE's
    # `fp8 block N rounded`, rounds its values): the references run on it; hf itself otherwise.
    ref_hf, requantization = gen.requantized_weights(hf)
    trajectory = plain_trajectory(reference, ref_hf, cfg, B, gen.CONTEXT, tokens, positions, args.steps)
    refs = step_references(reference, ref_hf, cfg, rounding, B, gen.CONTEXT)

    run = run_verify if args.verify else run_kernel
    kernel_states: list = []       # the kernel's state before each decode step (for mutants)
    check = "exact" if args.strict_emulation else (
        None if args.emulation_check == "none" else args.emulation_check)
    summary = {"family": family.name, "mode": args.mode, "races": args.races, "batch": B,
               "verify": args.verify, "mutant": args.mutate, "emulation_check": check,
               "host": host_facts(), "interpret_host_replaced": replaced,
               "requantization": requantization,
               "steps": run(gen, weights, gen.init_state(B), trajectory, mesh, params, refs,
                            **({} if args.verify else {"states": kernel_states,
                                                        "kernel_state": args.kernel_state}))}
    if args.mutants:
        summary.update(run_mutants(lambda mutants: load_generated(spec, model, mutants),
                                   args.mutants.split(","), weights, kernel_states, trajectory,
                                   mesh, params, refs, args.mutants_from, args.mutant_steps,
                                   by_row=args.mutants_by_row))
    return finish(summary, args.races, args.json)


if __name__ == "__main__":
    sys.exit(main())
