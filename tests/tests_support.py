import contextlib
import fcntl
import functools
import json
import os
import re
import sys
import tempfile
import types
from collections.abc import Callable, Mapping
from pathlib import Path

from mkc.files import process_folder

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
K3_SPEC = ROOT / "schedules" / "kimi_k3.sched"
QWEN_MOE_SPEC = ROOT / "schedules" / "qwen3_5_35b_a3b.sched"


def format_text(spec: Path, formats: str | tuple[str, str]) -> str:
    """A shipped spec (K3: the checkpoint's MXFP4 experts; Qwen3.5-35B-A3B: its bf16) with its
    routed experts in `formats`: benchmarks/bundles.py's rewrite of its format lines (a key of
    its `EXPERT_FORMATS`, e.g. "fp4 block" for K3's rounded FP4 blocks, "fp8 block" for Qwen's
    rounded FP8 blocks, or the (gate_up, down) formats), line numbers kept."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bundles import format_text as text
    return text(spec, formats)


def k3_format_text(formats: str | tuple[str, str]) -> str:
    return format_text(K3_SPEC, formats)


def k3_mini_text(text: str) -> str:
    """`examples/generated_module.k3_mini_text`: a K3 spec moved to 16 cores for its MINI
    config."""
    sys.path.insert(0, str(ROOT / "examples"))
    from generated_module import k3_mini_text as moved
    return moved(text)


def qwen_scatter_text(clause: str = "scatter from 2 rows") -> str:
    """The shipped Qwen spec (8 ranks; its all-reduces two-level over chips) with `clause` after
    the wire dtype: on the MINI config (256 columns) a chip's 2 cores scatter chunks of 128
    columns."""
    text = SPEC.read_text()
    for ops in ("out_proj, down", "o_proj, down"):
        line = f"allreduce {ops} two_level chip wire bf16"
        assert text.count(line + "\n") == 1, line
        text = text.replace(line + "\n", f"{line} {clause}\n")
    return text


K3_SCATTER = " scatter from 8 rows"     # the shipped K3 spec's clause on its run-at-once all-reduces


def k3_scatter_text(clause: str = "scatter from 8 rows") -> str:
    """The shipped K3 spec with `clause` ("": one-shot) after the wire dtype of each all-reduce
    it scatters from 8 rows (o_proj, down: 7168 columns, chunks of 896 over a host's 8 cores;
    the routed experts' 3584, chunks of 448 padded to 512), and the overlapped shared expert's
    sum run at once with that clause, lines kept."""
    text = K3_SPEC.read_text()
    assert text.count(K3_SCATTER) == 4 and text.count(K3_SHARED_SUM) == 1
    text = text.replace(K3_SHARED_SUM, K3_SHARED_SUM.replace(" scatter overlap", K3_SCATTER))
    return text.replace(K3_SCATTER, f" {clause}" if clause else "")


# the shipped K3 spec's overlapped shared-expert sum
K3_SHARED_SUM = "allreduce shared_down two_level host wire bf16 scatter overlap"


def k3_split_router_text() -> str:
    """The shipped K3 spec with its router's columns split over a chip's two cores, their
    logits swapped by the sibling exchange (the calibration spec's and kimi_k3_64's), lines
    kept: the shipped spec keeps the router whole."""
    text = K3_SPEC.read_text()
    whole, comment = "  shard router over 1\n", "    # (a router split over a chip's 2 cores"
    assert text.count(whole) == 1 and text.count(comment) == 1
    start = text.index(comment)
    end = text.index("\n", start) + 1
    return (text[:start] + "    exchange router with sibling wire f32\n" + text[end:]).replace(
        whole, "  shard router over chip\n")


def dense_text(spec: Path, fmt: str, attention: bool = False) -> str:
    """A shipped spec (K3 or Qwen 27B) with its dense classes as `fmt` ("fp8", "int8") codes with
    a scale per output column: benchmarks/bundles.py's `dense_text` (their `format` lines
    before the schedule's closing brace; K3's attention, streamed, with `attention`)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from bundles import dense_text as text
    return text(spec, fmt, attention)


def ring_text(text: str, slots: int, tile: tuple[int, int], ahead: int) -> str:
    """A spec's text with its one ring as `slots` slots of bf16 tiles up to `tile` (rows x
    columns), streamed `ahead` tiles ahead."""
    text, n = re.subn(r"\d+ slots of bf16 tiles up to \d+ x \d+",
                      f"{slots} slots of bf16 tiles up to {tile[0]} x {tile[1]}", text)
    text, m = re.subn(r"stream weights ahead \d+", f"stream weights ahead {ahead}", text)
    assert n == m == 1, (n, m)
    return text


def body_layer(dims, vectors: Mapping[str, object] = {}, **fields) -> types.SimpleNamespace:
    """A stand-in for the `Layer` (`mkc.runtime.context`) a family's lowering body is called
    with, so a test calls the body the generated module calls (not a neighbour in `ops`), on
    values: `dims`, `vector(name)` from `vectors`, and whatever else the body reads (`fields`:
    `B`, `per_rank`, `kernel`, `index`, `select_experts`, ...). A body reading anything else
    fails with AttributeError, naming it."""
    return types.SimpleNamespace(dims=dims, vector=lambda name: vectors[name], **fields)


def lowered_routed_experts(lowering, dims, per_rank: Mapping[str, int], experts: list[Mapping[str, object]],
                           x, weights):
    """A family's lowered `routed_experts` body (`lowering`, its module: its own or a composed
    kind's from its `BODIES`; activation, biases, routing weights as the body applies them)
    on `x [B, in]`, every expert of `experts`
    selected, each a dict of f32 values in the kernel's layout (`gate_up [in, 2 * half]`,
    `down [half, out]`, and GPT-OSS's `gate_up_bias`, `down_bias` rows); `weights [B, E]`. The
    slot reads the body makes (its decoded matmuls, and bias rows where it has them) are
    replaced by dense f32 ones on those values; the rest is the body's own."""
    from unittest import mock

    import jax.numpy as jnp

    def fold(body, acc):
        for k in range(len(experts)):
            acc = body(k, acc)
        return acc

    def matmul(c, k, h, name, group):
        return jnp.dot(h, experts[k][name], preferred_element_type=jnp.float32)

    def bias(c, k, name):
        return experts[k][name]

    c = body_layer(dims, B=x.shape[0], per_rank=per_rank, fold_experts=fold,
                   expert_weight=lambda w, k: w[:, k:k + 1])
    # a composed kind's body (options bound) or the family's own
    body = next((b for (_, op), b in getattr(lowering, "BODIES", {}).items() if op == "routed_experts"),
                None) or lowering.routed_experts
    module = sys.modules[getattr(body, "func", body).__module__]
    with contextlib.ExitStack() as patches:
        patches.enter_context(mock.patch.object(module, "expert_matmul", matmul))
        if hasattr(module, "_expert_bias"):
            patches.enter_context(mock.patch.object(module, "_expert_bias", bias))
        return body(c, x, None, weights)


def session_dir(uid: str) -> Path:
    """The folder a test session's xdist workers share (the controller removes it at the end)."""
    return Path(tempfile.gettempdir()) / f"mkc-tests-{uid}"


def _session_dir() -> Path | None:
    """This xdist session's shared folder, made if need be (None outside xdist)."""
    session = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not session:
        return None
    base = session_dir(session)
    base.mkdir(exist_ok=True)
    return base


@functools.cache
def _process_dir() -> Path:
    """A folder of this process's own outside xdist, removed at exit."""
    return process_folder("mkc-tests-")


def once_per_session(key: str, run: Callable[[], dict]) -> dict:
    """`run()`'s JSON-able result, computed once per test session however many xdist workers
    ask (a worker that asks while another computes it waits and reads it): a result several
    workers' tests share is not computed on each."""
    base = _session_dir()
    if base is None:     # one process: its caller's own cache suffices
        return run()
    path = base / f"{key}.json"
    with open(base / f"{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if path.exists():
            return json.loads(path.read_text())
        result = run()
        path.write_text(json.dumps(result))
        return result


def cpu_compilation_cache() -> dict[str, str]:
    """Environment for a CPU-only subprocess of this environment that shares the session's JAX
    compilation cache: interpret runs of one family compile the same references' ops and
    kernel again in every process (a third of a Qwen3 MoE MINI run). An executable comes back
    as compiled, so what runs is unchanged; the cache lives in the session's folder, and its
    file lock (JAX's, with eviction on) keeps two workers from reading an entry half written."""
    import importlib.util
    base = _session_dir() or _process_dir()
    env = {"JAX_COMPILATION_CACHE_DIR": str(base / "jax-cache"),
           "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
           "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}
    # without filelock (huggingface_hub's, through tokenizers) JAX refuses a size limit; a
    # half-written entry is then a warning and a compile, not an error
    if importlib.util.find_spec("filelock"):
        env["JAX_COMPILATION_CACHE_MAX_SIZE"] = str(8 << 30)
    return env


FITTED_RUNNERS = ("examples/run_mini.py", "examples/run_k3_mini.py")


def run_example(script: str, *args: str, timeout: int, python: str = sys.executable) -> dict:
    """Run an interpret-mode example script with --json in a fresh process (of `python`; this
    environment's shares the session's CPU compilation cache); its summary. The MINI runners
    run at the context their rows' positions need (`--context fit`, unless the test gives
    one): the same positions as at the spec's 4096 tokens, a fraction of the caches interpret
    mode copies in and out of every launch."""
    from conftest import run_python
    if script in FITTED_RUNNERS and "--context" not in args:
        args = (*args, "--context", "fit")
    r = run_python([script, "--json", *args], timeout=timeout, python=python,
                   env=cpu_compilation_cache() if python == sys.executable else None)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("JSON "))
    return json.loads(line[5:])


def assert_within_exact_bound(summary: dict) -> None:
    """An interpret run's every step within the emulation's exact bound (`mkc.numerics`,
    2**-17 of the largest element, about 1,000x under a 1 % error in any op) and judged against
    both references without failure."""
    from mkc import numerics
    assert summary["steps"] and summary["emulation_check"] == "exact"
    assert numerics.failures(summary) == []


def assert_bit_equal(summary: dict) -> None:
    """An interpret run's every step equal to the rounding emulation to the bit, logits and
    states, and judged against both references without failure."""
    assert_within_exact_bound(summary)
    for step in summary["steps"]:
        assert step["emulation"]["logits"] == 0.0, step["step"]
        assert set(step["emulation"]["states"].values()) == {0.0}, step["step"]


def assert_decode_follows(ref, d, params, tokens, want: list, context: int = 64) -> None:
    """A family reference's decode step, from f32 caches (as upstream's f32 model), fed tokens
    [B, T] (an array) one a step: row b's logits at step t within 1e-5 of want[b][t]'s largest."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    batch, steps = tokens.shape
    step = jax.jit(ref.decode_step, static_argnums=(1, 5))
    cache = ref.init_cache(d, batch, context, jnp.float32)
    for t in range(steps):
        logits, cache = step(params, d, cache, jnp.asarray(tokens[:, t], jnp.int32),
                             jnp.full((batch,), t, jnp.int32))
        for b in range(batch):
            got = np.asarray(logits[b], np.float64)
            assert np.max(np.abs(got - want[b][t])) <= 1e-5 * np.max(np.abs(want[b][t])), (t, b)


def assert_each_mutant_rejected(summary: dict, mutants) -> None:
    """A `--mutants` run: the rounding emulation rejected every mutant."""
    for name in mutants:
        fails = summary["mutants"][name]["failures"]
        assert any("rounding emulation" in f for f in fails), (name, fails)


def assert_each_mutant_rejected_on_its_row(summary: dict, mutants: tuple[str, ...]) -> None:
    """A `--mutants-by-row` run: mutant i acted on row i alone at step 1 and the rounding
    emulation rejected it; the row no mutant touched (the last) stayed bit-equal."""
    controls = summary["mutant_controls"]
    assert controls["rows"] == [len(mutants)] and controls["failures"] == [], controls
    assert controls["steps"][0]["emulation"]["logits"] == 0.0
    for row, name in enumerate(mutants):
        mutant = summary["mutants"][name]
        assert mutant["row"] == row and [s["step"] for s in mutant["steps"]] == [1]
        assert any("rounding emulation" in f for f in mutant["failures"]), (name, mutant["failures"])


def assert_rows_step_like_alone(decode, init_cache, rows: list[list[int]],
                                next_tokens: list[int], context: int = 8) -> None:
    """A joint decode step of rows at different positions equals stepping each row alone.

    decode(cache, tokens, positions) -> (logits, cache); init_cache(batch, context) -> cache."""
    import jax.numpy as jnp
    import numpy as np

    def prefix(tokens: list[int]) -> dict:
        cache = init_cache(1, context)
        for t, tok in enumerate(tokens):
            _, cache = decode(cache, jnp.array([tok], jnp.int32), jnp.array([t], jnp.int32))
        return cache

    singles = [prefix(r) for r in rows]
    joint = {k: jnp.concatenate([c[k] for c in singles], axis=0) for k in singles[0]}
    logits, new_joint = decode(joint, jnp.array(next_tokens, jnp.int32),
                               jnp.array([len(r) for r in rows], jnp.int32))
    for b, (r, cache) in enumerate(zip(rows, singles)):
        alone, new_alone = decode(cache, jnp.array([next_tokens[b]], jnp.int32),
                                  jnp.array([len(r)], jnp.int32))
        # Batch 1 and batch 2 matmuls sum in another order in f32 (which order depends on the
        # host's kernels), which can flip a bf16 rounding of a few inputs by one ulp; a
        # recurrent state carries such a flip into a row of its outer product (seen on an Intel
        # host: 2 of 262,144 entries off by 2 %). A position or row mix-up instead moves the
        # logits at O(1) and most of a state's entries.
        np.testing.assert_allclose(logits[b], alone[0], rtol=2e-3, atol=2e-3)
        for k in new_alone:
            got = np.asarray(new_joint[k][b], np.float32)
            want = np.asarray(new_alone[k][0], np.float32)
            off = ~np.isclose(got, want, rtol=1e-2, atol=1e-3)
            assert off.mean() <= 1e-4, f"{k}: {off.sum()} of {off.size} entries differ"
            scale = float(np.abs(want).max())
            np.testing.assert_allclose(got, want, rtol=0, atol=scale * 2**-6, err_msg=k)
