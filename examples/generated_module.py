"""Shared by the MINI run scripts: compile a spec for a model into a temporary directory and
import the generated module (optionally a mutant of it); the reference trajectory a run is
judged against; one kernel run compared step by step; the summary tail and exit status."""
from __future__ import annotations

import dataclasses
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from mkc import compiler, files, numerics
from mkc.diagnostics import MkcError

ROOT = Path(__file__).resolve().parents[1]

# Mutants: one op's output scaled by 1.01, as a textual edit of the generated module that must
# match exactly once (so a template change that moves the text fails loudly, not silently).
# Each is an edit of a MINI module copy; the shipped generated/ files are never touched. In the
# edit, `{scale}(x)` scales x by 1.01 (on the mutant's row of axis 0 only, when mutants share a
# run: `load_generated`), and `{factor}(b)` is 1.01 for that row b (1.0 for the others).
# A mutant may have an edit per family's text of its op: the one whose text the module holds.
MUTANTS: dict[str, tuple[str, str] | tuple[tuple[str, str], ...]] = {
    # Qwen (generic module: one line per op, so a mutant scales that op's output)
    "gdn.gated_norm": ("    core = lower.gated_norm(c, core, proj)\n",
                       "    core = {scale}(lower.gated_norm(c, core, proj))\n"),
    "gqa.o_proj": ("    attn_out = lower.o_proj(c, core)\n",
                   "    attn_out = {scale}(lower.o_proj(c, core))\n"),
    "gqa.k_norm": ("    q, k_new = lower.qk_norm_rope(c, proj)\n",
                   "    q, k_new = lower.qk_norm_rope(c, proj)\n    k_new = [{scale}(k) for k in k_new]\n"),
    # Llama (the library's GQA without q/k norms): the new key after its rotary embedding
    "gqa.k_rope": ("    q, k_new = lower.rope(c, proj)\n",
                   "    q, k_new = lower.rope(c, proj)\n    k_new = [{scale}(k) for k in k_new]\n"),
    # a NoPE GQA's normed query (Muse Spark's full layers: weightless q/k norm, no rotation)
    "gqa.q_norm_nope": ("    q, k_new = lower.qk_norm(c, proj)\n",
                        "    q, k_new = lower.qk_norm(c, proj)\n    q = [{scale}(x) for x in q]\n"),
    # the gated attention output (Qwen3.5's gate from q_proj; Muse Spark's normed, from gate_proj)
    "gqa.out_gate": (("    core = lower.out_gate(c, core, proj)\n",
                      "    core = {scale}(lower.out_gate(c, core, proj))\n"),
                     # two kinds gated alike (Muse Spark's): the NoPE kind's
                     ("    q, k_new = lower.qk_norm(c, proj)\n    lower.kv_write(c, k_new, proj)\n"
                      "    core = lower.attention(c, q)\n    core = lower.out_gate(c, core, proj)\n",
                      "    q, k_new = lower.qk_norm(c, proj)\n    lower.kv_write(c, k_new, proj)\n"
                      "    core = lower.attention(c, q)\n"
                      "    core = {scale}(lower.out_gate(c, core, proj))\n")),
    # Qwen3.5 MoE (generic module)
    "qwen_moe.routed_experts": (
        "    routed_out = lower.routed_experts(c, h, expert_ids, expert_weights)\n",
        "    routed_out = {scale}(lower.routed_experts(c, h, expert_ids, expert_weights))\n"),
    "qwen_moe.shared_down": ("    shared_out = lower.shared_down(c, shared_act)\n",
                             "    shared_out = {scale}(lower.shared_down(c, shared_act))\n"),
    "qwen_moe.router": ("    router_logits = lower.router(c, h)\n",
                        "    router_logits = {scale}(lower.router(c, h))\n"),
    # Kimi K3 (generic module)
    "kda.gated_norm": ("    core = lower.gated_norm(c, core, proj)\n",
                       "    core = {scale}(lower.gated_norm(c, core, proj))\n"),
    # the kv_norm output: the normed latent part of the new cache row
    "mla.kv_norm": ("    q_low, kv_row = lower.latent_norms(c, q_low, kv_row)\n",
                    "    q_low, kv_row = lower.latent_norms(c, q_low, kv_row)\n"
                    "    lora = DIMS.kv_lora_rank\n"
                    "    kv_row = kv_row.at[:, :lora].set({scale}(kv_row[:, :lora]))\n"),
    # DeepSeek-V3 (the library's MLA with RoPE): the new cache row's rotated shared key
    "mla.k_rope": ("    q_low, kv_row = lower.latent_norms(c, q_low, kv_row)\n",
                   "    q_low, kv_row = lower.latent_norms(c, q_low, kv_row)\n"
                   "    lora = DIMS.kv_lora_rank\n"
                   "    kv_row = kv_row.at[:, lora:].set({scale}(kv_row[:, lora:]))\n"),
    "mla.o_proj": ("    core = lower.out_gate(c, core, gate_logits)\n"
                   "    attn_out = lower.o_proj(c, core)\n",
                   "    core = lower.out_gate(c, core, gate_logits)\n"
                   "    attn_out = {scale}(lower.o_proj(c, core))\n"),
    "dense.down": ("    mlp_out = lower.down(c, act)\n", "    mlp_out = {scale}(lower.down(c, act))\n"),
    # K3's routed experts are RMS-normed after their sum, so scaling all of them is invisible by
    # design: scale the routing weight of every even-numbered expert (K3's; the library MoE's,
    # edited where the route is made, so that qwen_moe.routed_experts may share its module).
    "moe.expert": (("    routed_out = lower.routed_experts(c, latent_in, expert_ids, expert_weights)\n",
                    "    even = lax.rem(lax.broadcasted_iota(jnp.int32, expert_weights.shape, 1), 2) == 0\n"
                    "    expert_weights = jnp.where(even, {scale}(expert_weights), expert_weights)\n"
                    "    routed_out = lower.routed_experts(c, latent_in, expert_ids, expert_weights)\n"),
                   ("    expert_ids, expert_weights = lower.route(c, router_logits)\n",
                    "    expert_ids, expert_weights = lower.route(c, router_logits)\n"
                    "    even = lax.rem(lax.broadcasted_iota(jnp.int32, expert_weights.shape, 1), 2) == 0\n"
                    "    expert_weights = jnp.where(even, {scale}(expert_weights), expert_weights)\n")),
    "moe.shared_down": ("    shared_out = lower.shared_down(c, shared_act)\n",
                        "    shared_out = {scale}(lower.shared_down(c, shared_act))\n"),
    # gated residuals (`mkc.layers.gated_residuals`): the MLP place's centred pre-norm, the
    # embedding's weightless norm (the stream it starts); the soft-capped logits
    "gres.pre_ffn_norm": ("    h = lower.pre_ffn_norm(c)\n", "    h = {scale}(lower.pre_ffn_norm(c))\n"),
    "gres.embed_norm": ("        lower.prologue(k)\n",
                        "        lower.prologue(k)\n        r.x[...] = {scale}(r.x[...])\n"),
    "logits.softcap": ('        logits = lower.final_logits(k, logits, SHARDS.rule("vocab"))\n',
                       '        logits = {scale}(lower.final_logits(k, logits, SHARDS.rule("vocab")))\n'),
    # Muse Spark's MoE options: the latent normed before the experts, and the picks' normed
    # outputs summed by their weights (a scale of each pick's output before its norm would
    # be invisible by design)
    "moe.latent_norm_input": ("    latent_in = lower.latent_norm(c, latent_in)\n",
                              "    latent_in = {scale}(lower.latent_norm(c, latent_in))\n"),
    "moe.expert_norm": ("    routed_out = lower.expert_norm(c, expert_outs, expert_ids, expert_weights)\n",
                        "    routed_out = {scale}(lower.expert_norm(c, expert_outs, expert_ids, "
                        "expert_weights))\n"),
}


# State-only mutants: a 1.01 scale on an op that acts only on carried state, so a step from a
# zeroed state (step 0) cannot see it. Each is a textual edit of one lowering function (the
# family's `lower.NAME`), made in a copy of that function bound into the mutant module alone:
# (function, old, new). A decay scaled by 1.01 is its log plus log(1.01).
LOWERING_MUTANTS: dict[str, tuple[str, str, str]] = {
    # Qwen3.5 and Qwen3.5 MoE (the gated delta net's and gated attention's lowering)
    "gdn.decay": ("delta_rule", "g[b:b + 1, h:h + 1],", "g[b:b + 1, h:h + 1] + jnp.log({factor}(b)),"),
    "gdn.conv_state": ("conv", "window = [state[j, source] for j in range(taps - 1)]",
                       "window = [{scale}(state[j, source]) for j in range(taps - 1)]"),
    # the values of the cached tokens before each row's position (not the row's own new entry)
    "gqa.kv_read": ("attention", "kt, vt = keys[c.sequence(b)], values[c.sequence(b)]\n",
                    "kt, vt = keys[c.sequence(b)], values[c.sequence(b)]\n"
                    "            vt = jnp.where((tokens < c.refs.positions[b]).reshape(-1, 1), "
                    "{factor}(b) * vt.astype(F32), vt.astype(F32))\n"),
    # the library GQA's softmax scale (Muse Spark's `qk_scale_factor / sqrt(head_dim)`)
    "gqa.softmax_scale": ("attention", "acc, scale))", "acc, scale * {factor}(b)))"),
    # Kimi K3
    "kda.decay": ("delta_rule", "decay[b:b + 1, lanes], beta",
                  "decay[b:b + 1, lanes] + jnp.log({factor}(b)), beta"),
    "kda.conv_state": ("conv", "window = [state[j, source] for j in range(taps - 1)]",
                       "window = [{scale}(state[j, source]) for j in range(taps - 1)]"),
    # GPT-OSS: each head's sink logit (which only grows the softmax denominator; the edit is
    # of the library GQA's attention, a no-op on kinds without sinks), and the biases of the
    # q/k/v projection, of o_proj (added once, after its all-reduce), of the router and of the
    # experts' down projection
    "oss.sink": ("attention", "init = tuple(_start(s, c, g) for _ in range(B) for g in groups)",
                 "init = tuple((lambda m, d, a: ({scale}(m), d, a))(*_start(s, c, g)) "
                 "for _ in range(B) for g in groups)"),
    "oss.qkv_bias": ("qkv", '+ c.vector("qkv_bias")', '+ {scale}(c.vector("qkv_bias"))'),
    "oss.o_bias": ("attn_residual", '(attn_out + c.vector("o_bias"))',
                   '(attn_out + {scale}(c.vector("o_bias")))'),
    "oss.router_bias": ("router", '+ c.vector("router_bias")', '+ {scale}(c.vector("router_bias"))'),
    "oss.expert_bias": ("routed_experts", '_expert_bias(c, k, "down_bias")',
                        '{scale}(_expert_bias(c, k, "down_bias"))'),
    # GPT-OSS's sliding window one position too wide (p - W <= q instead of p - W < q): the
    # position that just left a row's window, still in the layer's KV ring, stays visible
    "oss.window": ("attention", "visible = _visible(s, c, tokens, c.refs.positions[b])\n",
                   "visible = _visible(s, c, tokens, c.refs.positions[b]) | (c.kv_positions("
                   "tokens, c.refs.positions[b]) == c.refs.positions[b] - c.dims.sliding_window)\n"),
    # DeepSeek-V3: each row's rotated query rope part
    "mla.q_rope": ("absorb_query", "(q_lat, _rotate(c, q_ext, cos[b:b + 1], sin[b:b + 1]))",
                   "(q_lat, {factor}(b) * _rotate(c, q_ext, cos[b:b + 1], sin[b:b + 1]))"),
    # gated residuals: each place's post-normed output as it enters the stream (beta's term)
    "gres.attn_update": ("attn_residual", "gated_update(c.refs.x[...], normed,",
                         "gated_update(c.refs.x[...], {scale}(normed),"),
    "gres.mlp_update": ("mlp_residual", "gated_update(c.refs.x[...], normed,",
                        "gated_update(c.refs.x[...], {scale}(normed),"),
    "mla.kv_read": ("attention", "cached = latent[c.sequence(b)]\n",
                    "cached = latent[c.sequence(b)].astype(F32)\n"
                    "            cached = jnp.where((tokens < c.refs.positions[b]).reshape(-1, 1), "
                    "{factor}(b) * cached, cached)\n"),
}
# Runtime mutants: an edit of one function of `mkc.runtime.collectives` (the mechanism a generated
# module's collective stages run), bound into the mutant module alone: its stage constants are
# rebuilt as stages whose `run` reaches the edited copy. (function, old, new).
RUNTIME_MUTANTS: dict[str, tuple[str, str, str]] = {
    # each member of a reduce-scatter sends a peer the next member's column chunk, not its own
    "collectives.scatter_chunk": ("_send_chunks", "staged(member), slot(local)",
                                  "staged(lax.rem(member + 1, size)), slot(local)"),
}
MUTANT_FACTOR = 1.01


def _vector(name: str) -> Callable:
    return lambda module: any(name in families for families in module.VECTORS.layout.values())


# What a mutant scales that a module may lack: its edit's text is in the library's shared
# lowering either way, where on a module without it the edit changes nothing.
MUTANT_NEEDS: dict[str, Callable] = {
    "oss.sink": _vector("sinks"), "oss.qkv_bias": _vector("qkv_bias"), "oss.o_bias": _vector("o_bias"),
    "oss.router_bias": _vector("router_bias"),
    "oss.expert_bias": lambda module: any("down_bias" in es.matrices
                                          for es in module.HOST.expert_slots.values()),
    "oss.window": lambda module: getattr(module.DIMS, "sliding_window", None) is not None,
    # every GQA scales its scores; this mutant judges the factor of a model that has one
    "gqa.softmax_scale": lambda module: hasattr(module.DIMS, "qk_scale_factor"),
    # every module calls its prologue; this mutant judges the gated residuals' embedding norm
    "gres.embed_norm": lambda module: "gated_residuals" in module.lowering.prologue.__module__,
}


def mutant_scale(row: int | None) -> Callable:
    """`{scale}` of a mutant: x times 1.01 (in f32, back to x's dtype) on row `row` of axis 0,
    or on every row (None); every other row is x exactly."""
    import jax.numpy as jnp
    from jax import lax

    def scale(x):
        x = jnp.asarray(x)
        factor = jnp.float32(MUTANT_FACTOR)
        if row is not None:
            rows = lax.broadcasted_iota(jnp.int32, x.shape, 0)
            factor = jnp.where(rows == row, factor, jnp.float32(1.0))
        return (x.astype(jnp.float32) * factor).astype(x.dtype)
    return scale


def mutant_factor(row: int | None) -> Callable:
    """`{factor}(b)` of a mutant: 1.01 for row b == `row` (every row for None), else 1.0."""
    return lambda b: MUTANT_FACTOR if row is None or b == row else 1.0


def _replace_once(text: str, old: str, new: str, name: str, where: str) -> str:
    count = text.count(old)
    if count != 1:
        raise ValueError(f"mutant {name}: its text occurs {count} times in {where}, not once: {old!r}")
    return text.replace(old, new)


def _bind(new: str, index: int) -> str:
    return new.replace("{scale}", f"_mutant_scale_{index}").replace("{factor}", f"_mutant_factor_{index}")


def _helpers(mutants: dict[str, int | None]) -> dict[str, Callable]:
    """The names mutant texts use: their scale and factor functions, and `lax` (a module
    imports it only if its own bodies use it)."""
    from jax import lax
    out: dict = {"lax": lax}
    for index, row in enumerate(mutants.values()):
        out[f"_mutant_scale_{index}"] = mutant_scale(row)
        out[f"_mutant_factor_{index}"] = mutant_factor(row)
    return out


def _edit(source: str, name: str) -> tuple[str, str]:
    """Mutant `name`'s edit of `source`: of its edits, the one whose text `source` holds."""
    edits = MUTANTS[name] if isinstance(MUTANTS[name][0], tuple) else (MUTANTS[name],)
    return next((e for e in edits if e[0] in source), edits[0])


def mutate(source: str, mutants: dict[str, int | None]) -> str:
    """The module text with every mutant of MUTANTS in `mutants` applied (name -> its row):
    at each layer kind's call of the op (Muse Spark's moe and moe_bf16 both run the MoE's)."""
    for index, name in enumerate(mutants):
        if name in MUTANTS:
            old, new = _edit(source, name)
            if old not in source:
                raise ValueError(f"mutant {name}: its text is not in the generated module: {old!r}")
            source = source.replace(old, _bind(new, index))
    return source


def _stages(value) -> list:
    """The collective stages a module constant holds (a tuple of them, or a `FromRows`)."""
    from mkc.runtime import collectives
    if isinstance(value, collectives.FromRows):
        return _stages(value.below) + _stages(value.stages)
    if isinstance(value, tuple):
        return [s for v in value for s in _stages(v)]
    return [value] if isinstance(value, collectives.Stage | collectives.ReduceScatter
                                 | collectives.GatherSums) else []


def _applies(module, name: str) -> bool:
    """Whether mutant `name` changes `module` (a generated module, unmutated): its edit's text
    is there, and what it scales is."""
    import inspect
    import textwrap
    if name in MUTANTS:
        source = Path(module.__file__).read_text()
        found = _edit(source, name)[0] in source
    elif name in LOWERING_MUTANTS:
        func, old, _ = LOWERING_MUTANTS[name]
        try:
            body = lowering_function(module.lowering, func)
        except AttributeError:
            return False
        found = textwrap.dedent(inspect.getsource(body)).count(old) == 1
    else:        # an edit of the collectives: the function it edits runs the module's reduce-scatters
        from mkc.runtime import collectives
        found = any(isinstance(stage, collectives.ReduceScatter) for key, value in vars(module).items()
                    if key.isupper() for stage in _stages(value))
    return found and MUTANT_NEEDS.get(name, lambda _: True)(module)


def applicable_mutants(spec: Path, model: str) -> list[str]:
    """The mutants that apply to `spec` compiled for `model`."""
    module = load_generated(spec, model)
    return sorted(n for n in {**MUTANTS, **LOWERING_MUTANTS, **RUNTIME_MUTANTS} if _applies(module, n))


def lowering_function(lowering, func: str) -> Callable:
    """The Python function behind the family's body `func`: a composed kind's (the function a
    `BODIES` entry binds its options to, `mkc.layers.sublayer.Sublayer.bodies`) or the
    lowering module's own."""
    for (_, op), body in getattr(lowering, "BODIES", {}).items():
        if op == func:
            return getattr(body, "func", body)
    return getattr(lowering, func)


def _mutate_lowering(module, mutants: dict[str, int | None]) -> None:
    """Bind into `module` (alone) a `lower` whose bodies named by the LOWERING_MUTANTS in
    `mutants` are edited copies, compiled in the globals of the module that defines each (and
    run in their op's scope, as the module's own `lower` runs the family's)."""
    import functools
    import inspect
    import textwrap
    import types

    edited: dict[str, str] = {}                     # function -> its edited source
    for index, name in enumerate(mutants):
        if name not in LOWERING_MUTANTS:
            continue
        func, old, new = LOWERING_MUTANTS[name]
        original = lowering_function(module.lowering, func)
        source = edited.get(func) or textwrap.dedent(inspect.getsource(original))
        edited[func] = _replace_once(source, old, _bind(new, index), name,
                                     f"{original.__module__}.{func}")
    if not edited:
        return
    replaced = {}                                   # original function -> its mutant
    for func, source in edited.items():
        original = lowering_function(module.lowering, func)
        namespace = dict(vars(sys.modules[original.__module__])) | _helpers(mutants)
        names = "+".join(n for n in mutants if n in LOWERING_MUTANTS and LOWERING_MUTANTS[n][0] == func)
        exec(compile(source, f"<mutant {names} of {original.__module__}.{func}>", "exec"), namespace)
        replaced[original] = namespace[func]
    bodies = {key: functools.partial(replaced[body.func], *body.args)
              if isinstance(body, functools.partial) and body.func in replaced else body
              for key, body in getattr(module.lowering, "BODIES", {}).items()}
    own = {n: replaced[f] for n, f in vars(module.lowering).items() if callable(f) and f in replaced}
    from mkc.runtime import scopes
    module.lower = scopes.named_ops(types.SimpleNamespace(
        **{**vars(module.lowering), **own, "BODIES": bodies, "__name__": module.lowering.__name__}))


def _mutate_runtime(module, mutants: dict[str, int | None]) -> None:
    """Bind into `module` (alone) the RUNTIME_MUTANTS in `mutants`: the edited functions
    compiled in a copy of `mkc.runtime.collectives`' globals, and every stage the module's
    constants hold (`Stage`, `ReduceScatter`, `GatherSums`, in a tuple or `FromRows`) replaced
    by one whose `run` reads those globals."""
    import dataclasses
    import inspect
    import textwrap
    import types

    from mkc.runtime import collectives
    edited: dict[str, str] = {}
    for name in mutants:
        if name in RUNTIME_MUTANTS:
            func, old, new = RUNTIME_MUTANTS[name]
            source = edited.get(func) or textwrap.dedent(inspect.getsource(getattr(collectives, func)))
            edited[func] = _replace_once(source, old, new, name, f"mkc.runtime.collectives.{func}")
    if not edited:
        return
    namespace = dict(vars(collectives))

    def reading_namespace(f, name: str):
        return types.FunctionType(f.__code__, namespace, name, f.__defaults__, f.__closure__)

    # the module's other functions read the copied globals too, so that a call from one of them
    # (`reduce_scatter` calling `_send_chunks`) reaches an edited copy
    for key, f in vars(collectives).items():
        if inspect.isfunction(f) and f.__module__ == collectives.__name__:
            namespace[key] = reading_namespace(f, key)
    for func, source in edited.items():
        exec(compile(source, f"<mutant of mkc.runtime.collectives.{func}>", "exec"), namespace)
    # a stage run at once (`run`) or overlapped (`start`, `finish`)
    mutant = {cls: type(cls.__name__, (cls,), {m: reading_namespace(getattr(cls, m), m)
                                               for m in ("run", "start", "finish")})
              for cls in (collectives.Stage, collectives.ReduceScatter, collectives.GatherSums)}

    def rebind(value):
        if type(value) in mutant:
            return mutant[type(value)](**{f.name: getattr(value, f.name)
                                          for f in dataclasses.fields(value)})
        if isinstance(value, collectives.FromRows):
            return dataclasses.replace(value, below=rebind(value.below), stages=rebind(value.stages))
        if isinstance(value, tuple):
            return tuple(rebind(v) for v in value)
        return value

    for key, value in list(vars(module).items()):
        if isinstance(value, (tuple, collectives.FromRows)) and key.isupper():
            setattr(module, key, rebind(value))


def add_mutant_options(ap) -> None:
    """The runners' mutant options (run_mini.py, run_k3_mini.py); `check_mutant_options` after
    parsing."""
    ap.add_argument("--mutants", help="comma-separated mutants to run after the module, one process")
    ap.add_argument("--mutant-steps", type=int, help="run mutants for only this many steps")
    ap.add_argument("--mutants-by-row", action="store_true",
                    help="run every mutant in one kernel run, mutant i on batch row i alone (the "
                         "batch must exceed the mutant count: the rows past them are controls)")
    ap.add_argument("--mutants-from", type=int, default=0,
                    help="start mutants at this step, from the kernel's own state before it (1: "
                         "a nonzero state, where state-only mutants show)")


def check_spec_and_model(ap, args) -> None:
    """The runners' --spec must be a file and --model (where they take one) a shipped MINI
    config: said as a usage error, not a traceback from deep in the loader."""
    if not Path(args.spec).is_file():
        ap.error(f"--spec {args.spec}: no such file (the shipped specs are in schedules/)")
    model = getattr(args, "model", None)
    from mkc.model.config import CONFIG_DIR
    shipped = sorted(p.stem for p in CONFIG_DIR.glob("*.json"))
    if model is not None and model not in shipped:
        minis = [m for m in shipped if "_mini" in m]
        ap.error(f"--model {model}: not a shipped config; choose one of {', '.join(minis)} "
                 f"(full-size: {', '.join(m for m in shipped if m not in minis)})"
                 + (", or pass --checkpoint DIR" if hasattr(args, "checkpoint") else ""))


def check_mutant_options(ap, args) -> None:
    known = {**MUTANTS, **LOWERING_MUTANTS, **RUNTIME_MUTANTS}
    named = ([args.mutate] if getattr(args, "mutate", None) else []) + \
        (args.mutants.split(",") if args.mutants else [])
    if unknown := [n for n in named if n not in known]:
        ap.error(f"unknown mutants {', '.join(unknown)}: choose from {', '.join(sorted(known))}")
    if args.mutants and (args.verify or not 0 <= args.mutants_from < args.steps):
        ap.error("--mutants run decode steps: no --verify, and --mutants-from below --steps")
    if args.mutants_by_row and (not args.mutants or len(args.mutants.split(",")) >= args.batch):
        ap.error("--mutants-by-row needs --mutants, and a --batch above their count "
                 "(a row each and a control row)")


def check_applicable_mutants(ap, args, spec: Path, model: str) -> None:
    """The runners' mutants must apply to the spec (a usage error naming those that do)."""
    named = ([args.mutate] if getattr(args, "mutate", None) else []) + \
        (args.mutants.split(",") if args.mutants else [])
    if not named:
        return
    applicable = applicable_mutants(spec, model)
    if other := [n for n in named if n not in applicable]:
        ap.error(f"{', '.join(other)}: no such mutant of {spec} for {Path(model).name}; its "
                 f"mutants are {', '.join(applicable)}")


def check_batch(ap, gen, batch: int) -> None:
    """--batch within the batch range the spec builds its kernel for (a usage error otherwise)."""
    low, high = gen.BATCH_RANGE
    if not low <= batch <= high:
        ap.error(f"--batch {batch}: the spec builds its kernel for batches {low} to {high}")


def add_interpret_host_option(ap) -> None:
    """Every runner's choice of interpret mode's host side; `interpret_host` after parsing."""
    ap.add_argument("--jax-callbacks", action="store_true",
                    help="interpret mode through JAX's own io_callback path (about 3x slower; "
                         "the default makes its host side lean: mkc.interpret)")


def interpret_host(args) -> list[str]:
    """Make interpret mode's host side lean unless --jax-callbacks; what was replaced."""
    from mkc.interpret import lean_interpreter
    return [] if args.jax_callbacks else lean_interpreter()


# Interpret mode copies a launch's caches into its buffers and back, once a device: at a
# spec's 4096 tokens a MINI run's caches are most of its memory traffic, though its rows reach
# a few hundred positions. A fitted context is a multiple of this (every KV tile divides it).
CONTEXT_STEP = 512
ROW_STRIDE = 131     # row b starts 131 b positions after row 0 (`row_positions`)


def add_context_option(ap) -> None:
    """Every runner's --context; `at_context` after parsing."""
    ap.add_argument("--context", help="run the spec at this context (its `context` line "
                    "replaced, line numbers kept), or `fit`: the least multiple of "
                    f"{CONTEXT_STEP} that holds every row's positions, which stay those at the "
                    "spec's context (caches are most of what interpret mode copies a launch)")


def row_positions(first: int, batch: int, context: int, steps: int) -> np.ndarray:
    """Each row's first position: rows 131 apart from `first` (past the first KV tile, inside
    and across 16-row blocks: per-row masking, block writes and multi-tile streaming), wrapped
    where they would run past the context within `steps`."""
    return (first + ROW_STRIDE * np.arange(batch)) % (context - steps)


def at_context(ap, spec: Path, model: str, context: str | None, first: int, batch: int,
               steps: int) -> Path:
    """`spec`, or a copy whose `context` line says `context`. `fit`: the least multiple of
    CONTEXT_STEP past every row's last position (`row_positions` unwrapped, so positions are
    as at the spec's own context, which it never exceeds) at which the spec still checks for
    `model` (KV tiles in flight must fit it)."""
    if context is None:
        return spec
    text = spec.read_text()
    lines = re.findall(r"(?m)^[ \t]*context[ \t]+(\d+)[ \t]*$", text)
    if len(lines) != 1:
        ap.error(f"--context: {spec} has {len(lines)} `context` lines, not one")
    own = int(lines[0])
    out = files.process_folder("mkc-context-") / spec.name

    def written(tokens: int) -> Path:
        out.write_text(re.sub(r"(?m)^([ \t]*context[ \t]+)\d+", rf"\g<1>{tokens}", text))
        return out

    if context != "fit":
        if not (context.isdigit() and int(context) > 0):
            ap.error(f"--context {context}: a positive number of tokens, or `fit`")
        return spec if int(context) == own else written(int(context))
    last = first + ROW_STRIDE * (batch - 1) + steps
    for tokens in range(-(-(last + 1) // CONTEXT_STEP) * CONTEXT_STEP, own, CONTEXT_STEP):
        try:
            compiler.check_spec(written(tokens), model)
            return out
        except MkcError:
            continue
    return spec


_COMPILED: dict[tuple[str, str, str], object] = {}


def load_generated(spec: Path, model: str, mutants: str | dict[str, int | None] | None = None):
    """Compile `spec` for `model` and import the generated module, with `mutants` applied: a
    name, or names each with the batch row it acts on (None: every row), so several share one
    run, each on its own row. The compilation is reused while the spec text is unchanged."""
    if isinstance(mutants, str):
        mutants = {mutants: None}
    mutants = dict(mutants or {})
    known = {**MUTANTS, **LOWERING_MUTANTS, **RUNTIME_MUTANTS}
    unknown = [n for n in mutants if n not in known]
    if unknown:
        raise ValueError(f"unknown mutants {unknown}: choose from {sorted(known)}")
    key = (str(spec), Path(spec).read_text(), model)
    if key not in _COMPILED:
        _COMPILED[key] = compiler.compile_spec(spec, model)
    c = _COMPILED[key]
    source = mutate(c.module_source, mutants)
    stem = compiler.module_name(c) + "".join("__" + n.replace(".", "_") for n in mutants)
    out = files.process_folder("mkc-") / f"{stem}.py"
    files.write_atomically(out, source)
    module = files.import_generated(out, namespace=_helpers(mutants))
    _mutate_lowering(module, mutants)
    _mutate_runtime(module, mutants)
    return module


def rounding_for(spec: Path, model: str):
    """The rounding emulation facts of `spec` compiled for `model` (from its schedule IR)."""
    return numerics.rounding_from_ir(compiler.check_spec(spec, model).ir)


def k3_mini_text(text: str) -> str:
    """A shipped K3 spec's text moved to 2 hosts (tpu7x 2x2x2, 16 cores), for the MINI config
    (16 heads): the topology change re-derives per-rank shapes and collective groups; heads split
    over a numbered subgroup keep their share of the mesh (`kimi_k3_64.sched`'s heads over 32
    of 64 become heads over 8 of 16, within one host: o_proj then reduces chip by chip). Its
    all-reduces run one-shot: the MINI config's 512 columns over a host's 8 cores are chunks
    of 64, not the whole lane tiles `scatter` needs (MINI Qwen runs the scattered form:
    tests/runtime/test_allreduce_scatter.py)."""
    text = re.sub(r"(wire \w+) scatter( from \d+ rows)?", r"\1", text)
    ranks = int(re.search(r"mesh\s+tp\s*=\s*(\d+)", text).group(1))
    text = re.sub(r"topology \S+", "topology 2x2x2", text, count=1)
    text = re.sub(r"(mesh\s+tp\s*=\s*)\d+", r"\g<1>16", text, count=1)
    text, subgroup = re.subn(r"(shard heads over )(\d+)\b",
                             lambda m: f"{m.group(1)}{int(m.group(2)) * 16 // ranks}", text)
    if subgroup:    # the heads group now fits in one host: reduce it over chips and then hosts
        text = text.replace("allreduce o_proj two_level host", "allreduce o_proj two_level chip")
    return text


def k3_mini_spec(spec: Path = ROOT / "schedules" / "kimi_k3.sched") -> Path:
    """`k3_mini_text` of a spec file, written to a temporary directory under its name."""
    path = files.process_folder("mkc-k3-") / Path(spec).name
    path.write_text(k3_mini_text(Path(spec).read_text()))
    return path


# The plain reference's step runs on the KV and latent caches cut to the first multiple of
# PLAIN_PREFIX tokens past the last position: it attends to every cached token, masked past each
# row's position, so the rest is masked for every row and only costs time (K3 MINI at batch 8:
# a plain step 6.1 s at 4096 tokens, 2.3 s at 1088). Measured bit-equal to the whole cache:
# K3 MINI at batch 8 from random nonzero states, prefixes of 1056 to 2048 tokens; and the
# runners' JSON summaries (K3 batch 8 with the by-row mutants, Qwen's mutants) are unchanged.
PLAIN_PREFIX = 128


def plain_step(reference, hf, cfg, cache: dict, tokens, positions, context: int) -> tuple:
    """``reference.decode_step`` without rounding: (logits, new cache), the caches (``*_cache``,
    their first `context`-long axis after the batch) cut to the prefix the step reads
    (``PLAIN_PREFIX``) and their untouched rest put back after it."""
    import jax.numpy as jnp

    used = min(context, -(-(int(np.max(np.asarray(positions))) + 1) // PLAIN_PREFIX) * PLAIN_PREFIX)
    # (a cache without a context-long axis, a sliding window's ring, is read whole)
    axes = {name: next(i for i, n in enumerate(np.shape(a)) if i > 0 and n == context)
            for name, a in cache.items() if name.endswith("_cache") and context in np.shape(a)[1:]
            } if used < context else {}
    cut = {name: jnp.asarray(a)[(slice(None),) * axes[name] + (slice(0, used),)] if name in axes else a
           for name, a in cache.items()}
    logits, new = reference.decode_step(hf, cfg, cut, tokens, positions)
    new = dict(new)
    for name, axis in axes.items():
        rest = jnp.asarray(cache[name])[(slice(None),) * axis + (slice(used, None),)]
        new[name] = jnp.concatenate([new[name], rest], axis=axis)
    return logits, new


def plain_trajectory(reference, hf, cfg, batch: int, context: int, tokens, positions,
                     steps: int) -> list[dict]:
    """The plain reference alone over `steps` steps from a zeroed state, teacher-forced by its own
    next tokens: every step's inputs, and the logits and caches of an independent run, which the
    drift report compares the kernel with (reported, never judged: a step is judged from the
    kernel's own state, `reference_step`). Each step also has "route_margins": per row, the
    smallest gap of any MoE layer between the k-th and the next expert's selection score (inf
    where the family routes nothing)."""
    import jax.numpy as jnp

    cache = reference.init_cache(cfg, batch, context)
    out = []
    for _ in range(steps):
        with RouteRecorder(reference) as routes:
            logits, cache = plain_step(reference, hf, cfg, cache, tokens, positions, context)
        margins = [top_margins(scores, k) for scores, k in routes.scores]
        out.append({"tokens": tokens, "positions": positions, "logits": np.asarray(logits),
                    "states": dict(cache),
                    "route_margins": np.min(np.stack(margins), axis=0) if margins
                    else np.full(batch, np.inf)})
        tokens = jnp.asarray(np.argmax(np.asarray(logits), axis=-1), jnp.int32)
        positions = positions + 1
    return out


def reference_cache(reference, cfg, states: dict, batch: int, context: int) -> dict:
    """The kernel's state (``gen.reference_states``: the reference's names and layouts) as the
    reference's cache, in its dtypes (the kernel stores bf16 values where the reference does)."""
    import jax.numpy as jnp

    template = reference.init_cache(cfg, batch, context)
    return {name: jnp.asarray(np.asarray(states[name], np.float32), zero.dtype)
            for name, zero in template.items()}


class RouteRecorder:
    """While active, records each MoE layer's expert-selection scores ``[B, E]`` and its k, of a
    family reference whose ``route(*args)`` picks the top k of ``selection_scores(*args)`` (the
    K3 and Qwen3.5 MoE references; the others route nothing and record nothing); a
    group-limited router's choices each (its experts', then its groups')."""

    def __init__(self, reference):
        self.reference = reference
        self.scores: list[tuple[np.ndarray, int]] = []

    def __enter__(self):
        ref = self.reference
        self.route = getattr(ref, "route", None)
        # the module that calls it: a family's own, or the layer library's MoE it re-exports
        self.home = sys.modules[self.route.__module__] if self.route is not None else ref
        if self.route is not None and hasattr(ref, "selection_scores"):
            def recording(*args, **kwargs):
                # one choice (scores, k), or several: a group-limited router's experts, then groups
                chosen = ref.selection_scores(*args, **kwargs)
                for scores, k in chosen if isinstance(chosen, list) else [chosen]:
                    self.scores.append((np.asarray(scores, np.float32), k))
                return self.route(*args, **kwargs)
            self.home.route = recording
        return self

    def __exit__(self, *exc):
        if self.route is not None:
            self.home.route = self.route


def top_margins(scores: np.ndarray, k: int) -> np.ndarray:
    """Per row, the gap between the k-th and the (k+1)-th largest of ``scores [B, N]``; inf
    when k is all N (every expert picked: no choice to flip)."""
    top = np.sort(scores, axis=-1)
    if k >= top.shape[-1]:
        return np.full(top.shape[0], np.inf)
    return top[:, -k] - top[:, -k - 1]


def near_ties(emu_scores: list, plain_scores: list, emu_logits, plain_logits
              ) -> dict[str, dict[int, str]]:
    """Rows the plain reference may legitimately decide otherwise than the kernel, with why:
    "routing" (an expert pick: the row then differs at O(1), so it is not compared plainly at
    all) and "token" (the next token only).

    The kernel equals the rounding emulation exactly (checked separately), so a row's expert
    picks and next token are the emulation's. The plain reference, run from the same state,
    differs from the emulation by its f32 arithmetic: measured per row as d, the largest
    difference of any selection score (or logit) between the two runs. If the emulation's k-th
    choice wins by more than 2 d, no score can have crossed it, so the plain picks are the same;
    a row is a near-tie only where some margin is at most 2 d, and every other row must match."""
    routing: dict[int, str] = {}
    for layer, ((e, k), (p, _)) in enumerate(zip(emu_scores, plain_scores)):
        margin, d = top_margins(e, k), np.max(np.abs(e - p), axis=-1)
        for b in np.flatnonzero(margin <= 2 * d):
            routing.setdefault(int(b), f"routing, MoE call {layer}: margin {margin[b]:.2e} <= "
                                       f"2 x {d[b]:.2e}")
    emu_logits, plain_logits = np.asarray(emu_logits, np.float32), np.asarray(plain_logits, np.float32)
    margin = top_margins(emu_logits, 1)
    compared, plain_compared = numerics.masked_equal(emu_logits, plain_logits)   # -inf alike: masked
    d = np.max(np.abs(compared - plain_compared), axis=-1)
    token = {int(b): f"next token: top-2 margin {margin[b]:.2e} <= 2 x {d[b]:.2e}"
             for b in np.flatnonzero(margin <= 2 * d) if int(b) not in routing}
    return {"routing": routing, "token": token}


def emulated_step(reference, hf, cfg, rounding, start: dict, tokens, positions,
                  launch_rows: int | None = None) -> tuple:
    """The rounding emulation's step (logits, cache) from ``start``, its dots as wide as the
    kernel's launch: a verify kernel multiplies all its ``launch_rows`` rows at once, and XLA on
    CPU sums a dot's rows in an order that depends on how many there are (one row otherwise
    than several), so a verify row judged alone runs as the first of that many copies (the
    caches batch-first, the rows independent)."""
    import jax.numpy as jnp

    batch = np.shape(tokens)[0]
    copies = -(-(launch_rows or batch) // batch)
    if copies > 1:
        start = {k: jnp.concatenate([jnp.asarray(v)] * copies) for k, v in start.items()}
        tokens, positions = (jnp.concatenate([jnp.asarray(a, jnp.int32)] * copies)
                             for a in (tokens, positions))
    logits, cache = reference.decode_step(hf, cfg, start, tokens, positions, rounding)
    return logits[:batch], {k: v[:batch] for k, v in cache.items()}


def reference_step(reference, hf, cfg, rounding, start: dict, tokens, positions, context: int,
                   launch_rows: int | None = None) -> dict:
    """Both references for one step from ``start`` (the kernel's own state before the step, as
    ``reference_cache``, of `context` tokens): the emulated (``emulated_step``, as wide as the
    kernel's launch of ``launch_rows``) and the plain logits and caches, and the rows where the
    plain reference may decide otherwise (``near_ties``)."""
    t0 = time.perf_counter()
    batch = np.shape(tokens)[0]
    with RouteRecorder(reference) as emu_routes:
        emu_logits, emulated = emulated_step(reference, hf, cfg, rounding, start, tokens,
                                             positions, launch_rows)
    with RouteRecorder(reference) as plain_routes:
        plain_logits, plain = plain_step(reference, hf, cfg, start, tokens, positions, context)
    emu_logits, plain_logits = np.asarray(emu_logits), np.asarray(plain_logits)
    emu_scores = [(s[:batch], k) for s, k in emu_routes.scores]     # the rows judged
    ties = near_ties(emu_scores, plain_routes.scores, emu_logits, plain_logits)
    return {"emu_logits": emu_logits, "emulated": dict(emulated), "plain_logits": plain_logits,
            "plain": dict(plain), "near_ties": ties, "seconds": time.perf_counter() - t0}


def step_references(reference, hf, cfg, rounding, batch: int, context: int) -> Callable:
    """``refs(states, tokens, positions[, launch_rows])`` for ``run_kernel`` and ``run_verify``: both
    references' step (``reference_step``) from the kernel's state in the reference's layouts.
    A step asked again from the same bytes (every mutant starts from the module's own state) is
    answered from the first answer."""
    import hashlib
    answered: dict[str, dict] = {}

    def refs(states: dict, tokens, positions, launch_rows: int | None = None) -> dict:
        digest = hashlib.sha256(str(launch_rows).encode())
        for name in sorted(states):
            digest.update(name.encode() + np.ascontiguousarray(states[name]).tobytes())
        for a in (tokens, positions):
            digest.update(np.ascontiguousarray(a).tobytes())
        key = digest.hexdigest()
        if key in answered:
            return {**answered[key], "seconds": 0.0}
        start = reference_cache(reference, cfg, states, batch, context)
        answered[key] = reference_step(reference, hf, cfg, rounding, start, tokens, positions,
                                       context, launch_rows)
        return answered[key]
    return refs


def _record(i: int, label: str, seconds: float, logits, next_token, ours: dict, ref: dict,
            drift: dict | None = None, what: str = "step", rows: list[int] | None = None) -> dict:
    """One step (or verify row) of the kernel compared with both references from the kernel's
    own state before it (``reference_step``): the emulation on every row, the plain reference on
    the rows that are not near-ties. ``drift``: the independent plain run's step, reported.
    ``rows``: judge these batch rows only (default all), as if they had run alone."""
    batch = np.asarray(logits).shape[0]
    rows = list(range(batch)) if rows is None else list(rows)
    ties = ref["near_ties"]
    plain_rows = np.array([b for b in rows if b not in ties["routing"]], np.int64)
    token_rows = np.array([b for b in plain_rows if b not in ties["token"]], np.int64)
    pick = lambda a: np.asarray(a)[plain_rows]  # noqa: E731
    plain_logits = ref["plain_logits"]
    # a masked logit (-inf on both sides: a padded vocabulary id) is no error
    compared, plain_compared = numerics.masked_equal(pick(logits).astype(np.float32),
                                                     pick(plain_logits).astype(np.float32))
    rec = {"step": i, "seconds": seconds, "rows": rows, "plain_rows": plain_rows.tolist(),
           "token_rows": token_rows.tolist(),
           "near_ties": {str(b): why for kind in ("routing", "token") for b, why in ties[kind].items()
                         if b in rows},
           "logits_max_abs_err": float(np.max(np.abs(compared - plain_compared), initial=0.0)),
           "logits_max_abs": float(np.max(np.abs(plain_compared), initial=0.0)),
           "next_token": np.asarray(next_token)[token_rows].tolist(),
           "ref_next_token": np.argmax(plain_logits, axis=-1)[token_rows].tolist(),
           "state_rel_err": numerics.state_errors(ours, ref["plain"], plain_rows),
           "emulation": {"logits": numerics.logits_error(logits, ref["emu_logits"], rows),
                         "logits_frob": numerics.logits_frob(logits, ref["emu_logits"], rows),
                         "states": numerics.state_errors(ours, ref["emulated"], rows)},
           "reference_seconds": ref["seconds"]}
    # the rows past the exact bound, each alone (a diagnosis: the step is judged on them all)
    exact = numerics.emulation_bounds("exact")["logits"]
    per_row = {b: max(numerics.logits_error(logits, ref["emu_logits"], [b]),
                      *numerics.state_errors(ours, ref["emulated"], [b]).values()) for b in rows}
    rec["emulation"]["rows_off"] = {str(b): e for b, e in per_row.items() if e > exact}
    if drift is not None:
        # a kernel's window KV ring may keep more slots than the independent run's ring of
        # the window: those caches are not slot for slot comparable (the logits are)
        alike = {n: v for n, v in ours.items() if np.shape(v) == np.shape(drift["states"][n])}
        rec["drift"] = {"logits": numerics.logits_error(logits, drift["logits"], rows),
                        "states": numerics.state_errors(alike, drift["states"], rows)}
    emu = rec["emulation"]
    ties = "".join(f"; row {b} a near-tie ({why})" for b, why in rec["near_ties"].items())
    drifted = "" if drift is None else (
        f"; drift from the independent plain run: logits {rec['drift']['logits']:.2e}, states "
        + ", ".join(f"{k} {v:.1e}" for k, v in rec["drift"]["states"].items()))
    print(f"{label}{what} {i}: {seconds:.1f} s; from the kernel's state, {plain_summary(rec)}"
          + f"; rounding emulation: logits {emu['logits']:.2e} "
          + f"(Frobenius {emu['logits_frob']:.2e}), states "
          + ", ".join(f"{k} {v:.1e}" for k, v in emu["states"].items())
          + (f" (rows off it: {sorted(map(int, emu['rows_off']))})" if emu["rows_off"] else "")
          + f"{drifted}; next {np.asarray(next_token).tolist()} (reference "
          + f"{np.argmax(plain_logits, axis=-1).tolist()}){ties}", flush=True)
    return rec


def plain_summary(rec: dict) -> str:
    """The plain reference's comparison as a step's line says it, with the rows it covered
    when near-ties (judged by the emulation alone) left some out: none, then no figures."""
    judged, rows = len(rec["plain_rows"]), len(rec["rows"])
    if not judged:
        return f"plain reference: 0 of {rows} rows (near-ties)"
    covered = "" if judged == rows else f" ({judged} of {rows} rows, the rest near-ties)"
    return (f"plain reference{covered}: logits |err| {rec['logits_max_abs_err']:.4f} of "
            f"{rec['logits_max_abs']:.2f}, states "
            + ", ".join(f"{k} {v:.1e}" for k, v in rec["state_rel_err"].items()))


def kernel_state_mismatches(gen, state: dict, ours: dict) -> list[str]:
    """The states the kernel's own `state` is not given back exactly by writing its reference
    view `ours` (``gen.reference_states(state)``) in the kernel's layout (``gen.HOST.
    kernel_state``): every rank, so replicated parts and padding are checked as the kernel left
    them (gathers every rank's copy: a K3 MINI state at batch 8 is 850 MB)."""
    back = gen.HOST.kernel_state(ours, _sequences(gen, state))
    return [n for n, a in state.items() if not np.array_equal(np.asarray(a), back[n])]


def _sequences(gen, state: dict) -> int:
    """The sequences of a decode state: the first axis its shape at 1 and 2 sequences differ on."""
    one, two = gen.state_shapes(1), gen.state_shapes(2)
    name = next(iter(one))
    axis = next(i for i, (x, y) in enumerate(zip(one[name][0], two[name][0])) if x != y)
    return np.shape(state[name])[1 + axis]


def run_kernel(gen, weights, state, trajectory: list[dict], mesh, interpret, refs: Callable,
               label: str = "", first: int = 0, states: list | None = None,
               judged: dict[str, list[int]] | None = None, kernel_state: bool = False
               ) -> list[dict] | dict[str, list[dict]]:
    """Run the kernel along `trajectory`'s inputs (its steps `first`, `first` + 1, ...); judge
    every step from the kernel's own state before it: ``refs(states, tokens, positions)`` gives
    both references' step from ``gen.reference_states(state)`` (``reference_step``), and the
    trajectory's own step is the drift report. `states`, if given, collects the kernel's state
    before each step. `judged` ({label: batch rows}): the steps of each group of rows judged
    alone, by label, instead of one list for the whole batch. `kernel_state`: each step's
    record also lists the states `kernel_state_mismatches` finds ("kernel_state_mismatches")."""
    groups = {"": None} if judged is None else judged
    out: dict[str, list[dict]] = {g: [] for g in groups}
    for i, step in enumerate(trajectory[first:], start=first):
        if states is not None:       # a host copy: the step donates the state's buffers
            states.append({n: np.asarray(a) for n, a in state.items()})
        ref = refs(gen.reference_states(state), step["tokens"], step["positions"])
        t0 = time.perf_counter()
        logits, next_token, state = gen.decode_step(weights, state, step["tokens"], step["positions"],
                                                    mesh=mesh, interpret=interpret)
        logits = np.asarray(logits)
        seconds = time.perf_counter() - t0
        ours = gen.reference_states(state)
        mismatches = kernel_state_mismatches(gen, state, ours) if kernel_state else None
        for group, rows in groups.items():
            out[group].append(_record(i, label + (f"[{group}] " if group else ""), seconds, logits,
                                      next_token, ours, ref, step, rows=rows))
            if mismatches is not None:
                out[group][-1]["kernel_state_mismatches"] = mismatches
    return out[""] if judged is None else out


def run_mutants(load: Callable, names: list[str], weights, states: list, trajectory: list[dict],
                mesh, interpret, refs: Callable, first: int, steps: int | None,
                by_row: bool = False) -> dict:
    """Each mutant (``load({name: row})`` -> its module) run for `steps` steps (default: to the
    end) from step `first`, starting from the unmutated kernel's state before that step
    (`states`, collected by ``run_kernel``): from step 1 on the state is not zero, so a
    state-only mutant shows there, and every mutant is judged like the kernel, from its own
    state. `by_row`: all mutants in one module and one run, mutant i acting on batch row i
    only and judged on that row alone (rows are independent sequences: what a run of that
    mutant gives for that row); the rows past the last mutant are controls, judged like the
    kernel, so a mutant that leaks into another row fails loudly. Returns the summary's
    "mutants" (and, by row, "mutant_controls"). Mutants run without race detection: the
    unmutated kernel's run checks the schedule's races, and a mutant changes one op's values,
    not a copy or a wait."""
    end = len(trajectory) if steps is None else first + steps
    before = {"races_found": _races_found()} if getattr(interpret, "detect_races", False) else {}
    if dataclasses.is_dataclass(interpret):
        interpret = dataclasses.replace(interpret, detect_races=False, vector_clock_size=None)
    if not by_row:
        return before | {"mutants": {name: {"steps": run_kernel(load({name: None}), weights, states[first],
                                                                trajectory[:end], mesh, interpret, refs,
                                                                label=f"[{name}] ", first=first)}
                                     for name in names}}
    batch = np.asarray(trajectory[0]["tokens"]).shape[0]
    if len(names) >= batch:
        raise ValueError(f"{len(names)} mutants by row need a batch of at least {len(names) + 1} "
                         f"(one row each and a control row), not {batch}")
    judged = {name: [row] for row, name in enumerate(names)}
    judged["controls"] = list(range(len(names), batch))
    run = run_kernel(load({name: row for row, name in enumerate(names)}), weights, states[first],
                     trajectory[:end], mesh, interpret, refs, first=first, judged=judged)
    return before | {"mutants": {name: {"row": row, "steps": run[name]} for row, name in enumerate(names)},
                     "mutant_controls": {"rows": judged["controls"], "steps": run["controls"]}}


def _past_committed(ours: dict, ref: dict, starts, accepted: int, context: int,
                    rows: int) -> dict:
    """`ours` with every cache entry at or past each sequence's committed positions (starts +
    accepted) taken from `ref`: the verify step wrote the later rows there, which the next step
    overwrites and masks until then, so they are not part of the committed state. A cache is a
    reference array named `*_cache`: sequences first, then its first `context`-long axis; one
    without (a sliding window's KV ring of n slots, its slot axis second to last) has the
    verify step's later rows, positions starts + accepted .. starts + rows - 1, in slots p % n
    (what those slots held before, positions out of every later row's window, is masked)."""
    out = {}
    for name, a in ours.items():
        a = np.array(a, np.float32)
        if name.endswith("_cache"):
            ring = context not in a.shape[1:]
            axis = a.ndim - 2 if ring else next(i for i, n in enumerate(a.shape) if i > 0 and n == context)
            n = a.shape[axis]
            t = np.arange(n).reshape([-1 if i + 1 == axis else 1 for i in range(a.ndim - 1)])
            for s, start in enumerate(np.asarray(starts)):
                later = (np.isin(t, (start + np.arange(accepted, rows)) % n) if ring
                         else t >= start + accepted)
                a[s] = np.where(later, np.asarray(ref[name], np.float32)[s], a[s])
        out[name] = a
    return out


def run_verify(gen, weights, state, trajectory: list[dict], mesh, interpret, refs: Callable,
               label: str = "") -> list[dict]:
    """One verify step over the trajectory's tokens (row r: step r's tokens, one per sequence,
    at consecutive positions), judged row by row like the decode steps they replace: row r from
    the state the verify step commits after its first r rows (r = 0: the state before it),
    its logits and the state committed after r + 1 rows against both references' step from
    there. Committing 0 rows must give back the state before the step, exactly."""
    tokens = np.stack([np.asarray(step["tokens"]) for step in trajectory], axis=1)   # [S, R]
    starts = np.asarray(trajectory[0]["positions"])
    before = {n: np.asarray(a) for n, a in state.items()}
    t0 = time.perf_counter()
    logits, next_token, verified = gen.verify_step(weights, state, tokens, starts, mesh=mesh,
                                                   interpret=interpret)
    logits, next_token = np.asarray(logits), np.asarray(next_token)
    seconds = time.perf_counter() - t0

    def committed(rows: int) -> dict:
        return gen.commit({n: before[n] for n in gen.ROW_STATES}, verified,
                          np.full(len(starts), rows, np.int32))

    none = committed(0)
    for n in gen.ROW_STATES:
        if not np.array_equal(np.asarray(none[n]), before[n]):
            raise AssertionError(f"{label}committing 0 rows changed {n}")
    out = []
    start = {n: before[n] for n in state}
    for r, step in enumerate(trajectory):
        # The committed state's cache entries past its rows are the verify step's later rows,
        # which a decode step from there masks by position and overwrites.
        ref = refs(gen.reference_states(start), step["tokens"], step["positions"], tokens.size)
        start = committed(r + 1)
        ours = _past_committed(gen.reference_states(start), ref["plain"], starts, r + 1, gen.CONTEXT,
                               len(trajectory))
        out.append(_record(r, label, seconds if r == 0 else 0.0, logits[:, r], next_token[:, r],
                           ours, ref, step, what="verify row"))
    return out


def _races_found() -> bool:
    """The race detector's verdict on the last kernel interpreted with it (each kernel run
    starts a fresh one)."""
    from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
    return bool(ipc.races is not None and ipc.races.races_found)


def finish(summary: dict, races: bool, as_json: bool) -> int:
    """Add the race detector's verdict (when it ran) and the numerics verdict (`mkc.numerics`),
    print the JSON summary (if asked); the exit status: 1 if the kernel disagrees with the
    references (or races), or if a mutant run was not rejected."""
    if races:     # the last kernel run's verdict, or the one before the mutants ran (`run_mutants`)
        summary["races_found"] = bool(summary.get("races_found")) or _races_found()
        print(f"races found: {summary['races_found']}")
    failed = numerics.failures(summary) if summary.get("steps") else []
    summary["failures"] = failed
    for line in failed:
        print("FAIL " + line, file=sys.stderr)
    if "mutant_controls" in summary:     # the unmutated rows of a by-row mutant run
        controls = summary["mutant_controls"]
        controls["failures"] = numerics.failures({**summary, "steps": controls["steps"]})
        for line in controls["failures"]:
            print(f"FAIL rows {controls['rows']} of the mutant run (no mutant): " + line,
                  file=sys.stderr)
        failed = failed + [f"mutant run, control rows: {f}" for f in controls["failures"]]
        summary["failures"] = failed
    survivors = []
    for name, m in summary.get("mutants", {}).items():
        m["failures"] = numerics.failures({**summary, "steps": m["steps"]})
        verdict = "rejected" if m["failures"] else "NOT REJECTED"
        print(f"mutant {name}: {verdict}" + "".join(f"\n    {f}" for f in m["failures"]))
        if not m["failures"]:
            survivors.append(name)
            print(f"FAIL mutant {name} was not rejected", file=sys.stderr)
    if as_json:
        print("JSON " + json.dumps(summary))
    code = 1 if failed or survivors or summary.get("races_found") else 0
    print("PASS: every step matches both references" + (", every mutant rejected" if
                                                         summary.get("mutants") else "")
          if code == 0 else f"FAIL: {len(failed) + len(survivors)} failure(s), listed above"
          + ("; races found" if summary.get("races_found") else ""))
    return code
