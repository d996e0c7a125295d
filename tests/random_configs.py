"""Seeded draws of model configs unlike the shipped MINIs, per family, for the randomized
exactness tests (`tests/test_random_configs.py`): each draw is a family's MINI config.json with
its dims drawn within what the family's shipped spec compiles for (its mesh, its shardings, its
ring tiles): widths that are not powers of two, head counts and head dims, KV heads fewer than
the ranks the heads are sharded over (replicated KV heads), expert counts, top-k, routing
renormalisation on and off, MLP widths. `draw(family, seed)` is the same dict on every run.

A draw that no longer compiles is a test failure (`tests/test_random_configs.py` checks every
seed the tests run), not a silent skip.
"""
from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "mkc" / "model" / "configs"


@dataclass(frozen=True)
class Family:
    spec: Path          # the shipped spec the draws compile against
    mini: str           # the MINI config the draws start from
    draw: Callable[[random.Random, dict], dict]    # the drawn keys, from the MINI's


def _heads(r: random.Random, ranks: int, head_dims: tuple[int, ...]) -> dict:
    """Query heads a multiple of the ranks they are sharded over; KV heads a divisor of them,
    often fewer than the ranks (each KV head then replicated over several)."""
    heads = ranks * r.choice((1, 2))
    kv = r.choice([k for k in (1, 2, 4, 8) if heads % k == 0 and k <= heads])
    return {"num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": r.choice(head_dims)}


def _qwen3_moe(r: random.Random, mini: dict) -> dict:
    experts = r.choice((8, 16, 32))
    return {"hidden_size": r.choice((256, 384, 512)), **_heads(r, 8, (32, 64, 128)),
            "num_experts": experts, "num_experts_per_tok": r.randint(1, min(8, experts)),
            "norm_topk_prob": r.choice((True, False)), "moe_intermediate_size": r.choice((64, 128, 192)),
            "num_hidden_layers": r.choice((2, 3, 4))}


def _llama(r: random.Random, mini: dict) -> dict:
    return {"hidden_size": r.choice((256, 384, 512)), **_heads(r, 2, (64, 128)),
            "intermediate_size": r.choice((256, 512, 768)), "num_hidden_layers": r.choice((2, 3, 4))}


def _gpt_oss(r: random.Random, mini: dict) -> dict:
    experts = r.choice((4, 8, 16))
    top_k = r.randint(1, min(4, experts))
    return {"hidden_size": r.choice((256, 384)), **_heads(r, 2, (64,)), "num_local_experts": experts,
            "num_experts_per_tok": top_k, "experts_per_token": top_k,
            "intermediate_size": r.choice((128, 256))}


def _qwen3_5_moe(r: random.Random, mini: dict) -> dict:
    experts = r.choice((8, 16, 32))
    return {"hidden_size": r.choice((256, 384)), **_heads(r, 8, (128,)), "num_experts": experts,
            "num_experts_per_tok": r.randint(1, min(8, experts)),
            "moe_intermediate_size": r.choice((128, 256)),
            "shared_expert_intermediate_size": r.choice((128, 256))}


def _deepseek_v3(r: random.Random, mini: dict) -> dict:
    groups = r.choice((1, 2, 4))
    heads = r.choice((16, 32))         # MLA: as many KV heads as query heads
    return {"hidden_size": r.choice((256, 384)), "num_attention_heads": heads, "num_key_value_heads": heads,
            "n_group": groups, "topk_group": r.randint(1, groups),
            "num_experts_per_tok": r.randint(1, 6), "norm_topk_prob": r.choice((True, False)),
            "routed_scaling_factor": r.choice((1.0, 2.5)), "moe_intermediate_size": r.choice((128, 256))}


FAMILIES: dict[str, Family] = {
    "qwen3_moe": Family(ROOT / "schedules" / "qwen3_30b_a3b.sched", "qwen3_moe_mini", _qwen3_moe),
    "llama": Family(ROOT / "schedules" / "llama_3_1_8b.sched", "llama_mini", _llama),
    "gpt_oss": Family(ROOT / "schedules" / "gpt_oss_20b.sched", "gpt_oss_mini", _gpt_oss),
    "qwen3_5_moe": Family(ROOT / "schedules" / "qwen3_5_35b_a3b.sched", "qwen3_5_moe_mini", _qwen3_5_moe),
    "deepseek_v3": Family(ROOT / "schedules" / "deepseek_v3.sched", "deepseek_v3_mini_fp8", _deepseek_v3),
}


def draw(family: str, seed: int) -> dict:
    """Family `family`'s config drawn from `seed`: its MINI config.json with the drawn keys."""
    f = FAMILIES[family]
    mini = json.loads((CONFIGS / f"{f.mini}.json").read_text())
    drawn = f.draw(random.Random(f"{family}:{seed}"), mini)
    config = {**mini, **drawn}
    if isinstance(config.get("layer_types"), list):     # one a layer, the MINI's pattern repeated
        pattern = mini["layer_types"]
        config["layer_types"] = [pattern[i % len(pattern)] for i in range(config["num_hidden_layers"])]
    return config
