"""Shared by the MINI run scripts: compile a spec for a model into a temporary directory and
import the generated module (optionally a mutant of it); the reference trajectory a run is
judged against; one kernel run compared step by step; the summary tail and exit status."""
from __future__ import annotations

import importlib.util
import json
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from mkc import compiler, numerics
from mkc.reference.rounding import one_row_as_two

ROOT = Path(__file__).resolve().parents[1]

# Mutants: one op's output scaled by 1.01, as a textual edit of the generated module that must
# match exactly once (so a template change that moves the text fails loudly, not silently).
# Each is an edit of a MINI module copy; the shipped generated/ files are never touched.
MUTANTS: dict[str, tuple[str, str]] = {
    # Qwen (generic module: one line per op, so a mutant scales that op's output)
    "gdn.gated_norm": ("    core = lower.gated_norm(c, core, proj)\n",
                       "    core = 1.01 * lower.gated_norm(c, core, proj)\n"),
    "gqa.o_proj": ("    attn_out = lower.o_proj(c, core)\n",
                   "    attn_out = 1.01 * lower.o_proj(c, core)\n"),
    "gqa.k_norm": ("    q, k_new = lower.qk_norm_rope(c, proj)\n",
                   "    q, k_new = lower.qk_norm_rope(c, proj)\n    k_new = [1.01 * k for k in k_new]\n"),
    # Qwen3.5 MoE (generic module)
    "qwen_moe.routed_experts": (
        "    routed_out = lower.routed_experts(c, h, expert_ids, expert_weights)\n",
        "    routed_out = 1.01 * lower.routed_experts(c, h, expert_ids, expert_weights)\n"),
    "qwen_moe.shared_down": ("    shared_out = lower.shared_down(c, shared_act)\n",
                             "    shared_out = 1.01 * lower.shared_down(c, shared_act)\n"),
    "qwen_moe.router": ("    router_logits = lower.router(c, h)\n",
                        "    router_logits = 1.01 * lower.router(c, h)\n"),
    # Kimi K3 (generic module)
    "kda.gated_norm": ("    core = lower.gated_norm(c, core, proj)\n",
                       "    core = 1.01 * lower.gated_norm(c, core, proj)\n"),
    # the kv_norm output: the normed latent part of the new cache row
    "mla.kv_norm": ("    q_low, kv_row = lower.latent_norms(c, q_low, kv_row)\n",
                    "    q_low, kv_row = lower.latent_norms(c, q_low, kv_row)\n"
                    "    kv_row = kv_row.at[:, :DIMS.kv_lora].multiply(1.01)\n"),
    "mla.o_proj": ("    core = lower.out_gate(c, core, gate_logits)\n"
                   "    attn_out = lower.o_proj(c, core)\n",
                   "    core = lower.out_gate(c, core, gate_logits)\n"
                   "    attn_out = 1.01 * lower.o_proj(c, core)\n"),
    "dense.down": ("    mlp_out = lower.down(c, act)\n", "    mlp_out = 1.01 * lower.down(c, act)\n"),
    # The routed experts are RMS-normed after their sum, so scaling all of them is invisible by
    # design: scale the routing weight of every even-numbered expert.
    "moe.expert": ("    routed_out = lower.routed_experts(c, latent_in, expert_ids, expert_weights)\n",
                   "    even = lax.rem(lax.broadcasted_iota(jnp.int32, expert_weights.shape, 1), 2) == 0\n"
                   "    expert_weights = jnp.where(even, 1.01 * expert_weights, expert_weights)\n"
                   "    routed_out = lower.routed_experts(c, latent_in, expert_ids, expert_weights)\n"),
    "moe.shared_down": ("    shared_out = lower.shared_down(c, shared_act)\n",
                        "    shared_out = 1.01 * lower.shared_down(c, shared_act)\n"),
}


def mutate(source: str, name: str) -> str:
    old, new = MUTANTS[name]
    count = source.count(old)
    if count != 1:
        raise ValueError(f"mutant {name}: its text occurs {count} times in the generated module, "
                         f"not once: {old!r}")
    return source.replace(old, new)


_COMPILED: dict[tuple[str, str, str], object] = {}


def load_generated(spec: Path, model: str, mutant: str | None = None):
    """Compile `spec` for `model` and import the generated module (with `mutant` applied). The
    compilation is reused while the spec text is unchanged (mutants of one module)."""
    key = (str(spec), Path(spec).read_text(), model)
    if key not in _COMPILED:
        _COMPILED[key] = compiler.compile_spec(spec, model)
    c = _COMPILED[key]
    source = c.module_source if mutant is None else mutate(c.module_source, mutant)
    stem = compiler.module_name(c) + ("" if mutant is None else "__" + mutant.replace(".", "_"))
    out = Path(tempfile.mkdtemp(prefix="mkc-")) / f"{stem}.py"
    compiler.write_atomically(out, source)
    mod_spec = importlib.util.spec_from_file_location(out.stem, out)
    module = importlib.util.module_from_spec(mod_spec)
    mod_spec.loader.exec_module(module)
    return module


def rounding_for(spec: Path, model: str):
    """The rounding emulation facts of `spec` compiled for `model` (from its schedule IR)."""
    return numerics.rounding_from_ir(compiler.check_spec(spec, model).ir)


def k3_mini_text(text: str) -> str:
    """A shipped K3 spec's text moved to 2 hosts (tpu7x 2x2x2, 16 cores), for the MINI config
    (16 heads): the topology change re-derives per-rank shapes and collective groups; heads split
    over a numbered subgroup keep their share of the mesh (`kimi_k3_64.sched`'s heads over 32
    of 64 become heads over 8 of 16, within one host: o_proj then reduces chip by chip)."""
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
    path = Path(tempfile.mkdtemp(prefix="mkc-k3-")) / Path(spec).name
    path.write_text(k3_mini_text(Path(spec).read_text()))
    return path


def reference_trajectory(reference, hf, cfg, rounding, batch: int, context: int, tokens,
                         positions, steps: int, rows=None, judged: bool = True) -> list[dict]:
    """Both references over `steps` steps, teacher-forced by the plain reference's next tokens:
    per step the inputs, the plain and the emulated logits and caches, and (after the first,
    when the emulation is `judged`: only its bounds need them) the measured sensitivity gains
    of the emulated step (`numerics.measure_sensitivity`)."""
    import jax.numpy as jnp

    plain = reference.init_cache(cfg, batch, context)
    emulated = reference.init_cache(cfg, batch, context)
    out = []
    for i in range(steps):
        t0 = time.perf_counter()
        gains = None
        if i > 0 and judged:
            def step(cache, tokens, positions):
                return reference.decode_step(hf, cfg, cache, tokens, positions, rounding)
            gains = numerics.measure_sensitivity(step, emulated, tokens, positions, rows)
        plain_logits, plain = reference.decode_step(hf, cfg, plain, tokens, positions)
        # The emulation of a batch of one runs as two rows (its f32 order; the K3 reference
        # does this itself, the Qwen one is wrapped here).
        emu_logits, emulated = one_row_as_two(
            lambda c, t, p: reference.decode_step(hf, cfg, c, t, p, rounding), emulated, tokens,
            positions)
        out.append({"tokens": tokens, "positions": positions, "gains": gains,
                    "plain_logits": np.asarray(plain_logits), "plain": dict(plain),
                    "emu_logits": np.asarray(emu_logits), "emulated": dict(emulated),
                    "seconds": time.perf_counter() - t0})
        tokens = jnp.asarray(np.argmax(np.asarray(plain_logits), axis=-1), jnp.int32)
        positions = positions + 1
    return out


def _record(i: int, label: str, seconds: float, logits, next_token, ours: dict, ref: dict,
            rows_list=None, what: str = "step") -> dict:
    """One step (or verify row) of the kernel compared with both references, printed."""
    pick = (lambda a: a) if rows_list is None else (lambda a: np.asarray(a)[rows_list])
    plain_logits = ref["plain_logits"]
    rec = {"step": i, "seconds": seconds,
           "logits_max_abs_err": float(np.max(np.abs(pick(logits) - pick(plain_logits)))),
           "logits_max_abs": float(np.max(np.abs(pick(plain_logits)))),
           "next_token": pick(np.asarray(next_token)).tolist(),
           "ref_next_token": pick(np.argmax(plain_logits, axis=-1)).tolist(),
           "state_rel_err": numerics.state_errors(ours, ref["plain"], rows_list),
           "emulation": {"logits": numerics.logits_error(logits, ref["emu_logits"], rows_list),
                         "logits_frob": numerics.logits_frob(logits, ref["emu_logits"], rows_list),
                         "states": numerics.state_errors(ours, ref["emulated"], rows_list)},
           "gains": ref["gains"], "reference_seconds": ref["seconds"]}
    emu = rec["emulation"]
    gains = "" if rec["gains"] is None else (
        f"; measured gains: logits {rec['gains']['logits']:.3g}, states {rec['gains']['states']:.3g}")
    print(f"{label}{what} {i}: {seconds:.1f} s; plain reference: logits |err| "
          f"{rec['logits_max_abs_err']:.4f} of {rec['logits_max_abs']:.2f}, states "
          + ", ".join(f"{k} {v:.1e}" for k, v in rec["state_rel_err"].items())
          + f"; rounding emulation: logits {emu['logits']:.2e} "
          + f"(Frobenius {emu['logits_frob']:.2e}), states "
          + ", ".join(f"{k} {v:.1e}" for k, v in emu["states"].items())
          + f"{gains}; next {rec['next_token']} (reference {rec['ref_next_token']})", flush=True)
    return rec


def run_kernel(gen, weights, state, trajectory: list[dict], mesh, interpret, rows=None,
               label: str = "") -> list[dict]:
    """Run the kernel along `trajectory` and compare every step with both references."""
    rows_list = None if rows is None else np.asarray(rows)
    out = []
    for i, ref in enumerate(trajectory):
        t0 = time.perf_counter()
        logits, next_token, state = gen.decode_step(weights, state, ref["tokens"], ref["positions"],
                                                    mesh=mesh, interpret=interpret)
        logits = np.asarray(logits)
        seconds = time.perf_counter() - t0
        out.append(_record(i, label, seconds, logits, next_token, gen.reference_states(state), ref,
                           rows_list))
    return out


def _past_committed(ours: dict, ref: dict, starts, accepted: int, context: int) -> dict:
    """`ours` with every cache entry at or past each sequence's committed positions (starts +
    accepted) taken from `ref`: the verify step wrote the later rows there, which the next step
    overwrites and masks until then, so they are not part of the committed state. A cache is a
    reference array named `*_cache`: sequences first, then its first `context`-long axis."""
    out = {}
    for name, a in ours.items():
        a = np.array(a, np.float32)
        if name.endswith("_cache"):
            axis = next(i for i, n in enumerate(a.shape) if i > 0 and n == context)
            t = np.arange(context).reshape([-1 if i + 1 == axis else 1 for i in range(a.ndim - 1)])
            for s, start in enumerate(np.asarray(starts)):
                a[s] = np.where(t >= start + accepted, np.asarray(ref[name], np.float32)[s], a[s])
        out[name] = a
    return out


def run_verify(gen, weights, state, trajectory: list[dict], mesh, interpret, rows=None,
               label: str = "") -> list[dict]:
    """One verify step over the trajectory's tokens (row r: step r's tokens, one per sequence,
    at consecutive positions), compared row by row with the trajectory's steps: row r's logits
    with step r's, and the state committed after r + 1 accepted rows with step r's states.
    Committing 0 rows must give back the state before the step, exactly. `rows`: the sequences
    to compare (default all)."""
    tokens = np.stack([np.asarray(ref["tokens"]) for ref in trajectory], axis=1)   # [S, R]
    starts = np.asarray(trajectory[0]["positions"])
    before = {n: np.asarray(a) for n, a in state.items()}
    t0 = time.perf_counter()
    logits, next_token, verified = gen.verify_step(weights, state, tokens, starts, mesh=mesh,
                                                   interpret=interpret)
    logits, next_token = np.asarray(logits), np.asarray(next_token)
    seconds = time.perf_counter() - t0
    none = gen.commit({n: before[n] for n in gen.ROW_STATES}, verified, np.zeros(len(starts), np.int32))
    for n in gen.ROW_STATES:
        if not np.array_equal(np.asarray(none[n]), before[n]):
            raise AssertionError(f"{label}committing 0 rows changed {n}")
    out = []
    for r, ref in enumerate(trajectory):
        committed = gen.commit({n: before[n] for n in gen.ROW_STATES}, verified,
                               np.full(len(starts), r + 1, np.int32))
        ours = _past_committed(gen.reference_states(committed), ref["plain"], starts, r + 1,
                               gen.CONTEXT)
        out.append(_record(r, label, seconds if r == 0 else 0.0, logits[:, r], next_token[:, r],
                           ours, ref, None if rows is None else np.asarray(rows), what="verify row"))
    return out


def finish(summary: dict, races: bool, as_json: bool) -> int:
    """Add the race detector's verdict (when it ran) and the numerics verdict (`mkc.numerics`),
    print the JSON summary (if asked); the exit status: 1 if the kernel disagrees with the
    references (or races), or if a mutant run was not rejected."""
    if races:
        from jax._src.pallas.mosaic.interpret import interpret_pallas_call as ipc
        summary["races_found"] = bool(ipc.races.races_found)
        print(f"races found: {summary['races_found']}")
    failed = numerics.failures(summary) if summary.get("steps") else []
    summary["failures"] = failed
    for line in failed:
        print("FAIL " + line, file=sys.stderr)
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
    return 1 if failed or survivors or summary.get("races_found") else 0
