import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
K3_SPEC = ROOT / "schedules" / "kimi_k3.sched"


def run_example(script: str, *args: str, timeout: int) -> dict:
    """Run an interpret-mode example script with --json in a fresh process; its summary."""
    from conftest import run_python
    r = run_python([script, "--json", *args], timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("JSON "))
    return json.loads(line[5:])


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
        # Batch 1 and batch 2 matmuls round differently in f32, which can flip a bf16 cache entry
        # by one ulp; a position or row mix-up would instead move the logits at O(1).
        np.testing.assert_allclose(logits[b], alone[0], rtol=2e-3, atol=2e-3)
        for k in new_alone:
            np.testing.assert_allclose(np.asarray(new_joint[k][b], np.float32),
                                       np.asarray(new_alone[k][0], np.float32), rtol=1e-2, atol=1e-3)
