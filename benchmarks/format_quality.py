"""What a rounding weight format costs in model quality, end to end: for each shipped spec
offering a rounded expert format, and for K3's, Qwen 27B's and Muse Spark's dense classes as
FP8 or int8 codes with a scale per output column (`bundles.dense_text`: every bf16 class but
the router, K3's attention streamed; Muse Spark's on its bf16 MINI, the experts bf16), its
MINI model's decode run by the family's pure-JAX reference (plain f32) on a checkpoint's exact
weights and on the weights as the rounded format holds them (`requantized_weights`: what the
kernel is packed with), side by side.

    .venv/bin/python benchmarks/format_quality.py            # the table (about 15 minutes)
    .venv/bin/python benchmarks/format_quality.py --write    # and benchmarks/data/format_quality.json
    .venv/bin/python benchmarks/format_quality.py --only kimi_k3 --steps 64 --json

K3's MINI checkpoint holds MXFP4 experts drawn as Gaussians, whose 32-row scales barely differ
inside a block; a real checkpoint's spread. Each spread s in --spreads lowers every 32-row scale
by a random 0..s octaves (E8M0: its exponent byte minus an integer drawn uniformly from 0..s),
the codes kept, so the exact checkpoint itself has sub-blocks up to s octaves apart. Qwen3.5
MoE's MINI checkpoint is bf16. Reported per spec, format and spread: each matrix class's weight
error (relative RMS) and, over --steps decode steps of --batch rows from seeded prompts,
  - free-running greedy decoding: tokens equal to the exact weights' greedy text, and the step
    of each row's first difference;
  - teacher-forced (both fed the exact weights' tokens): argmax agreement, and the KL divergence
    of the rounded format's next-token distribution from the exact one (mean and max).
The exact format each spec ships is checked to hold the checkpoint's values unchanged. MINI
random weights are not a trained model: the figures say how far the format moves this model,
not a real one's benchmark score.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "examples"))

COMMAND = ".venv/bin/python benchmarks/format_quality.py"
DATA = ROOT / "benchmarks" / "data" / "format_quality.json"


@dataclass(frozen=True)
class Case:
    """A shipped spec with a rounding expert format: its MINI model, the exact format it ships
    and the rounding one (names in `bundles.EXPERT_FORMATS`), and whether its checkpoint holds
    MXFP4 scales to spread; or (`dense`) its dense classes as `rounded` codes ("fp8", "int8":
    `bundles.dense_text`), the shipped spec keeping them in the checkpoint's bf16."""
    spec: str
    model: str
    exact: str
    rounded: str | tuple[str, str]   # a name in `bundles.EXPERT_FORMATS`, or (gate_up, down)
    spreads: bool
    dense: bool = False
    # the routed experts' (gate_up, down) formats for the MINI's checkpoint, where the spec's
    # are another checkpoint's (Muse Spark ships the NVFP4 release's; its MINI is bf16)
    experts: tuple[str, str] | None = None


# Each rounded expert format under the searched bf16 block scale it ships with, and under E8M0
# (power-of-two) scales beside it for comparison (docs/formats.md#which-block-scale).
K3_E8M0, QWEN_E8M0 = ("fp4 block 512 rounded", "fp4 block 128 rounded"), \
    ("fp8 block 512 rounded", "fp8 block 128 rounded")
CASES = {"kimi_k3": Case("kimi_k3.sched", "kimi_k3_mini", "mxfp4", "fp4 block", True),
         "kimi_k3 e8m0": Case("kimi_k3.sched", "kimi_k3_mini", "mxfp4", K3_E8M0, True),
         "qwen3_5_35b_a3b": Case("qwen3_5_35b_a3b.sched", "qwen3_5_moe_mini", "bf16", "fp8 block",
                                 False),
         "qwen3_5_35b_a3b e8m0": Case("qwen3_5_35b_a3b.sched", "qwen3_5_moe_mini", "bf16", QWEN_E8M0,
                                      False),
         **{f"{spec} dense {fmt}": Case(f"{spec}.sched", model, "bf16", fmt, False, dense=True,
                                        experts=experts)
            for spec, model, experts in (("qwen3_8_27b", "qwen3_8_mini", None),
                                         ("kimi_k3", "kimi_k3_mini", None),
                                         ("muse_spark", "muse_spark_mini", ("bf16", "bf16")))
            for fmt in ("fp8", "int8")}}


def spread_scales(hf: dict, octaves: int, rng: np.random.Generator) -> dict:
    """`hf` with every MXFP4 32-row scale lowered by 0..`octaves` octaves at random."""
    out = dict(hf)
    for name, v in hf.items():
        if name.endswith(".weight_scale") and octaves:
            drop = rng.integers(0, octaves + 1, v.shape)
            out[name] = np.maximum(v.astype(np.int32) - drop, 1).astype(v.dtype)
    return out


def load_variant(case: Case, formats: str):
    """The generated module of `case`'s spec with its routed experts in `formats` (dense: its
    dense classes, or the shipped spec for the exact format), compiled for its MINI model
    (K3's moved to the MINI config's 16 cores, as examples/run_k3_mini.py runs it)."""
    from bundles import dense_text, format_edits, format_text
    from generated_module import k3_mini_text

    from mkc import compiler
    from mkc.codegen.emit import render
    from mkc.serve.model import import_generated
    spec = ROOT / "schedules" / case.spec
    if case.dense:
        k3 = case.spec.startswith("kimi_k3")
        text = spec.read_text() if formats == case.exact else dense_text(spec, formats, k3)
        for old, new in format_edits(spec, case.experts) if case.experts else ():
            text = text.replace(old, new)
    else:
        text = format_text(spec, formats)
    k3_mini = case.spreads or case.spec.startswith("kimi_k3")
    c = compiler.check_source(k3_mini_text(text) if k3_mini else text, str(spec), case.model)
    c.module_source = render(c.ir, c.spec_text)
    return import_generated(c.module_source, compiler.module_name(c).replace("-", "_"))


def _kl(p_logits: np.ndarray, q_logits: np.ndarray) -> np.ndarray:
    lp = p_logits - np.logaddexp.reduce(p_logits, axis=-1, keepdims=True)
    lq = q_logits - np.logaddexp.reduce(q_logits, axis=-1, keepdims=True)
    return (np.exp(lp) * (lp - lq)).sum(-1)


def compare(reference, cfg, exact: dict, held: dict, prompts: np.ndarray, steps: int,
            context: int) -> dict:
    """Greedy decoding of `prompts` ([B, P]) for `steps` tokens with `exact` and `held` weights."""
    import jax
    import jax.numpy as jnp
    step = jax.jit(reference.decode_step, static_argnums=(1, 5))
    B, P = prompts.shape

    def run(params, forced=None):
        cache = reference.init_cache(cfg, B, context)
        token, tokens, logits_seen = prompts[:, 0], [], []
        for t in range(P + steps - 1):
            logits, cache = step(params, cfg, cache, jnp.asarray(token, jnp.int32),
                                 jnp.full((B,), t, jnp.int32), None)
            logits = np.asarray(logits, np.float64)
            if t + 1 < P:
                token = prompts[:, t + 1]
                continue
            logits_seen.append(logits)
            tokens.append(logits.argmax(-1))
            token = forced[:, t + 1 - P] if forced is not None else tokens[-1]
        return np.stack(tokens, 1), np.stack(logits_seen, 1)

    ref_tokens, ref_logits = run(exact)
    free, _ = run(held)
    forced, forced_logits = run(held, ref_tokens)
    same = free == ref_tokens
    prefix = [int(np.argmin(r)) if not r.all() else steps for r in same]
    kl = _kl(ref_logits, forced_logits)
    return {"greedy_equal": int(same.sum()), "greedy_prefix": prefix, "tokens": int(same.size),
            "forced_argmax_equal": int((forced_logits.argmax(-1) == ref_tokens).sum()),
            "kl_mean": float(kl.mean()), "kl_max": float(kl.max())}


def _small(x: float) -> str:
    return f"{x:.3f}" if x >= 1e-3 or x == 0 else f"{x:.1e}"


def table(data: dict) -> str:
    """The results as docs/formats.md shows them (tests/test_docs.py checks it against DATA)."""
    out = ["| spec (MINI model) | format | scale spread | weight error (relative RMS) | greedy tokens equal "
           "| first difference (step, each row) | teacher-forced argmax equal | next-token KL mean / max |",
           "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        err = ", ".join(f"{c} {e:.1%}" for c, e in r["weight_error"].items())
        spread = f"0-{r['spread']} octaves" if r["spread"] else "as drawn"
        steps = r["tokens"] // len(r["greedy_prefix"])
        first = ", ".join(str(s) if s < steps else "none" for s in r["greedy_prefix"])
        out.append(f"| `{r['spec']}` ({r['model']}) | `{r['format']}` | {spread} | {err} | "
                   f"{r['greedy_equal']} of {r['tokens']} | {first} | "
                   f"{r['forced_argmax_equal']} of {r['tokens']} | {_small(r['kl_mean'])} / "
                   f"{_small(r['kl_max'])} |")
    return "\n".join(out) + "\n"


def run_case(name: str, case: Case, spreads: list[int], args) -> list[dict]:
    from bundles import EXPERT_FORMATS
    from mkc.checkpoint import family_of
    config = json.loads((ROOT / "mkc/model/configs" / f"{case.model}.json").read_text())
    reference = family_of(config).module("reference")
    cfg = reference.load_config(config)
    base = reference.init_params(cfg, seed=args.seed)
    prompts = np.random.default_rng(args.seed).integers(0, cfg.vocab_size, (args.batch, args.prompt))
    exact_gen, gen = (load_variant(case, f) for f in (case.exact, case.rounded))
    if args.prompt + args.steps > gen.CONTEXT:
        raise SystemExit(f"--prompt + --steps must be at most {name}'s context, {gen.CONTEXT}")
    if case.dense:
        from bundles import DENSE_CLASSES
        classes = DENSE_CLASSES[ROOT / "schedules" / case.spec]
        classes += ("attention",) if case.spec.startswith("kimi_k3") else ()
        formats = (f"{case.rounded} channel rounded ({', '.join(classes)})",)
    else:
        formats = EXPERT_FORMATS[ROOT / "schedules" / case.spec].get(case.rounded, case.rounded)
    results = []
    for spread in (spreads if case.spreads else [0]):
        exact = spread_scales(base, spread, np.random.default_rng([args.seed, spread]))
        same, report = exact_gen.requantized_weights(exact)
        assert same is exact and not report, f"{case.exact} moved weights: {report}"
        held, report = gen.requantized_weights(exact)
        r = {"spec": case.spec, "model": case.model, "format": " / ".join(formats),
             "exact_format": case.exact, "spread": spread,
             "weight_error": {cls: v["relative_rms_error"] for cls, v in sorted(report.items())}}
        r |= compare(reference, cfg, exact, held, prompts, args.steps, gen.CONTEXT)
        results.append(r)
        print(table({"results": [r]}).splitlines()[-1], file=sys.stderr, flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", choices=sorted(CASES), help="one spec (default: every one)")
    ap.add_argument("--spreads", default="0,2,4",
                    help="octaves the MXFP4 32-row scales spread inside a block, comma-separated "
                         "(default 0,2,4)")
    ap.add_argument("--steps", type=int, default=32, help="decode steps after the prompt (default 32)")
    ap.add_argument("--batch", type=int, default=2, help="rows, each its own prompt (default 2)")
    ap.add_argument("--prompt", type=int, default=4, help="prompt tokens a row (default 4)")
    ap.add_argument("--seed", type=int, default=0, help="weights, spread and prompts (default 0)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON, not a table")
    ap.add_argument("--write", action="store_true", help=f"also write {DATA.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    try:
        spreads = [int(s) for s in args.spreads.split(",")]
    except ValueError:
        ap.error(f"--spreads {args.spreads!r}: integers, comma-separated")
    if min(spreads) < 0 or args.steps < 1 or args.batch < 1 or args.prompt < 1:
        ap.error("--steps, --batch and --prompt must be at least 1, --spreads at least 0")
    results = [r for name, case in CASES.items() if args.only in (None, name)
               for r in run_case(name, case, spreads, args)]
    data = {"command": COMMAND, "steps": args.steps, "batch": args.batch, "prompt": args.prompt,
            "seed": args.seed, "results": results}
    print(json.dumps(data, indent=1) if args.json else table(data), end="")
    if args.write:
        from mkc.files import write_atomically
        write_atomically(DATA, json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
