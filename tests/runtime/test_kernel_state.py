"""`kernel_state`, the inverse of `reference_states`, for every family's MINI module: random
states in the reference's layouts written in the kernel's per-rank layout and gathered back
are unchanged, every rank holding its parts (replicas alike, padding zero). From the kernel's
own states after real steps, the runners' `--kernel-state` checks the other direction (the
interpret tests pass it)."""
from __future__ import annotations

import functools
import sys
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest

from mkc import compiler
from mkc.serve.model import import_generated

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
from generated_module import k3_mini_spec  # noqa: E402

CASES = [("qwen3_8_27b", "qwen3_8_mini"), ("llama_3_1_70b", "llama_mini"),
         ("qwen3_30b_a3b", "qwen3_moe_mini"), ("qwen3_5_35b_a3b", "qwen3_5_moe_mini"),
         ("gpt_oss_20b", "gpt_oss_mini"), ("kimi_k3", "kimi_k3_mini"), ("kimi_k3_64", "kimi_k3_mini")]


@functools.cache
def module(spec: str, model: str):
    path = ROOT / "schedules" / f"{spec}.sched"
    if model == "kimi_k3_mini":
        path = k3_mini_spec(path)          # moved to 16 cores
    c = compiler.compile_spec(path, model)
    return import_generated(c.module_source, compiler.module_name(c))


def random_reference_states(gen, S: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Random states of S sequences in the reference's layouts, as values every state dtype
    holds (bf16's)."""
    rng = np.random.default_rng(seed)
    return {n: rng.normal(0, 1, np.shape(a)).astype(ml_dtypes.bfloat16).astype(np.float32)
            for n, a in gen.reference_states(gen.init_state(S)).items()}


@pytest.mark.parametrize("spec, model", CASES)
def test_kernel_state_is_gathered_back_unchanged(spec, model):
    gen = module(spec, model)
    S = 2
    ref = random_reference_states(gen, S)
    state = gen.HOST.kernel_state(ref, S)
    assert {n: (a.shape, a.dtype) for n, a in state.items()} == {
        n: ((gen.RANKS, *shape), np.dtype(dtype)) for n, (shape, dtype) in gen.state_shapes(S).items()}
    back = gen.reference_states(state)
    assert back.keys() == ref.keys()
    for n, a in ref.items():
        np.testing.assert_array_equal(back[n], a, err_msg=n)
    # every holder of a part holds the same values as the one reference_states reads
    again = gen.HOST.kernel_state(back, S)
    for n, a in state.items():
        np.testing.assert_array_equal(again[n], a, err_msg=n)
    assert all(np.any(a[r] != 0) for a in state.values() for r in range(gen.RANKS))


def test_replicated_parts_are_written_to_every_holder():
    # kimi_k3_64 on 16 cores: heads over 8 parts, each held by two ranks (r and r + 8);
    # llama_3_1_70b's MINI: 2 KV heads over 8 heads parts, each KV head on four ranks
    k3 = module("kimi_k3_64", "kimi_k3_mini")
    state = k3.HOST.kernel_state(random_reference_states(k3, 1), 1)
    for n in ("kda__conv", "kda__recurrent"):
        np.testing.assert_array_equal(state[n][:8], state[n][8:])
        assert not np.array_equal(state[n][0], state[n][1])
    latent = state["mla__latent"]
    assert all(np.array_equal(latent[r], latent[0]) for r in range(16))
    row = k3.DIMS.kv_lora_rank + k3.DIMS.qk_rope_head_dim
    assert latent.shape[-1] > row and not latent[..., row:].any()      # the row's padding
    llama = module("llama_3_1_70b", "llama_mini")
    key = llama.HOST.kernel_state(random_reference_states(llama, 1), 1)["gqa__key"]
    ways, hkv = llama.SHARDS.ways("heads"), llama.DIMS.num_key_value_heads
    assert ways > hkv
    for r in range(ways):
        np.testing.assert_array_equal(key[r], key[r // (ways // hkv) * (ways // hkv)])


def test_a_family_without_kernel_states_is_refused(monkeypatch):
    gen = module("qwen3_8_27b", "qwen3_8_mini")
    monkeypatch.delattr(gen.HOST.hf_layout, "kernel_states")
    with pytest.raises(ValueError, match="has no kernel_states"):
        gen.HOST.kernel_state(random_reference_states(gen, 1), 1)
