"""The GPT-OSS ops (the layer library's with GPT-OSS's options, and its weights' gate|up packing)
against independent numpy derivations of upstream transformers' gpt_oss expressions
(modeling_gpt_oss.py, as the package docstring cites them): attention with sinks over a full
context and over a window's ring, past the window; the ring's visibility against a simulated
ring; the biased top-k router; the clamped SwiGLU on the kernel's de-interleaved, lane-padded
halves; the routed experts with their biases; YaRN RoPE. Tolerances are f32 rounding (1e-5
relative or tighter): a 1% error in any op fails, and each test shows a mutant (no sink, a
window one off, no bias, a symmetric gate clamp, a limit off by 1 %) is caught. Where a lowered
body (its BODIES, mkc.families.gpt_oss.lowering) does more than call one op (the routed experts, which cache
slots a row sees), the test calls the body itself on a stand-in layer
(tests_support.body_layer), with inputs where what it passes acts."""
from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from mkc.families.gpt_oss import lowering
from mkc.families.gpt_oss import reference as ref
from mkc.families.gpt_oss.graph import LAYERS, MOE
from mkc.layers import ops as layer_ops
from mkc.layers import rope
from mkc.layers.gqa import lowering as gqa_lowering
from mkc.layers.gqa import reference as gqa_ref
from mkc.layers.moe import lowering as moe_lowering
from mkc.layers.moe.weights import gate_up_halves
from mkc.model.config import CONFIG_DIR
from mkc.runtime import kv as kv_cache
from tests_support import body_layer, lowered_routed_experts

BIG = ref.load_config(CONFIG_DIR / "gpt_oss_120b.json")
MINI = ref.load_config(CONFIG_DIR / "gpt_oss_mini.json")
F32 = np.float32


def _close(got, want, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=rtol, atol=atol)


def _far(got, want, at_least: float = 0.01) -> None:
    """A mutant's result differs from the right one by at least 1% of its scale somewhere."""
    assert np.max(np.abs(np.asarray(got, np.float64) - want)) > at_least * np.max(np.abs(want))


# ---- attention with sinks ------------------------------------------------------------------------


def upstream_attention(q, keys, values, sinks, position, window=None):
    """eager_attention_forward for one token: q [Hq, D], keys and values [P+1, Hkv, D] by
    position (0..P), sinks [Hq]; the sliding mask admits p - W < j <= p. f64 numpy."""
    hq, d = q.shape
    hkv = keys.shape[1]
    j = np.arange(keys.shape[0])
    mask = (j <= position) & ((j > position - window) if window else True)
    out = np.zeros((hq, d))
    for h in range(hq):
        kv = h // (hq // hkv)                                  # repeat_kv
        scores = keys[:, kv] @ q[h] * d ** -0.5
        logits = np.concatenate([np.where(mask, scores, -np.inf), [sinks[h]]])
        probs = np.exp(logits - logits.max())
        probs = probs / probs.sum()
        out[h] = probs[:-1] @ values[:, kv]                    # the sink's column dropped
    return out


def kernel_attention(q, cache_k, cache_v, sinks, position, tile, visible):
    """The kernel's form (the library GQA's `attention` with sinks): per KV head group, the
    carry started from the group's sinks, the group's queries split in three bf16 parts,
    folded over tiles of ``tile`` cache slots with ``visible(slots)``, then finished."""
    hq, d = q.shape
    hkv = cache_k.shape[1]
    group = hq // hkv
    out = []
    for kv in range(hkv):
        heads = slice(kv * group, (kv + 1) * group)
        m, denom, acc = (jnp.asarray(sinks[heads], F32)[:, None], jnp.ones((group, 1), F32),
                         jnp.zeros((group, d), F32))
        q3 = layer_ops.split_bf16x3(jnp.asarray(q[heads], F32))
        for t in range(0, cache_k.shape[0], tile):
            slots = jnp.arange(t, t + tile)[None, :]
            m, denom, acc = layer_ops.attention_tile_bf16x3(
                q3, jnp.asarray(cache_k[t:t + tile, kv], jnp.bfloat16),
                jnp.asarray(cache_v[t:t + tile, kv], jnp.bfloat16), visible(slots, position),
                m, denom, acc, d ** -0.5)
        out.append(acc / denom)
    return np.concatenate([np.asarray(o) for o in out])


def _bf16(a: np.ndarray) -> np.ndarray:
    """Values a bf16 cache holds exactly, so the kernel's bf16 tiles and numpy see the same."""
    return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32), np.float64)


def _qkv(rng, positions: int, hq: int = 4, hkv: int = 2, d: int = 64):
    q = rng.normal(0, 1, (hq, d)).astype(F32)
    keys = _bf16(rng.normal(0, 1, (positions, hkv, d)))
    values = _bf16(rng.normal(0, 1, (positions, hkv, d)))
    return q, keys, values


WINDOW = 8


def kernel_visible(kind: str, window: int = WINDOW, slots: int = 0):
    """``visible(slots, position)`` as the lowered attention masks a KV tile of a ``kind``
    layer (the library GQA's ``_visible``): its cache slots' positions from the core (``mkc.runtime.kv``:
    a window's ring of ``slots`` slots, or the context's), upstream's causal mask, and on a
    sliding layer the MINI's window cut to ``window``."""
    tiles = kv_cache.KvTiles(tokens=16, slots=2, ahead=1, ring=slots)
    c = body_layer(dataclasses.replace(MINI, sliding_window=window), kind=kind,
                   kv_positions=lambda tokens, position: kv_cache.held(tiles, tokens, position))
    return lambda tokens, position: gqa_lowering._visible(LAYERS[kind][0], c, tokens, position)


@pytest.mark.parametrize("position", [0, 3, WINDOW - 1, WINDOW, WINDOW + 1, 2 * WINDOW + 5, 37])
@pytest.mark.parametrize("extra", [0, 3])
def test_sliding_attention_over_the_ring_is_upstreams_window(position, extra):
    """A ring of W (or W + 3, a verify step's) slots, slot p % slots holding position p, written
    for positions 0..p: the kernel's tiles, masked as the lowered attention masks them, give
    upstream's sliding window,
    also once positions have wrapped the ring (past the window)."""
    rng = np.random.default_rng(position * 7 + extra)
    slots = WINDOW + extra
    q, keys, values = _qkv(rng, position + 1)
    sinks = rng.normal(0, 1, 4)
    ring_k, ring_v = np.zeros((slots, 2, 64)), np.zeros((slots, 2, 64))
    for p in range(position + 1):                          # the ring after writing 0..position
        ring_k[p % slots], ring_v[p % slots] = keys[p], values[p]
    want = upstream_attention(q, keys, values, sinks, position, WINDOW)
    tile = 4 if slots % 4 == 0 else slots
    got = kernel_attention(q, ring_k, ring_v, sinks, position, tile,
                           kernel_visible("swa", WINDOW, slots))
    _close(got, want)
    if position >= WINDOW:         # a window one too short or too long is caught
        for wrong in (WINDOW - 1, WINDOW + 1) if extra else (WINDOW - 1,):
            _far(kernel_attention(q, ring_k, ring_v, sinks, position, tile,
                                  kernel_visible("swa", wrong, slots)), want)


def test_full_attention_and_the_sink_that_changes_it():
    """Full layer: slot t holds position t, tiles past the position masked. The sinks are
    drawn large enough to take a real share of each head's softmax: dropping them (a sink of
    -1e30) is caught, as is adding exp(sink) to the numerator."""
    rng = np.random.default_rng(1)
    position, context = 13, 16
    q, keys, values = _qkv(rng, context)
    sinks = np.array([2.0, -1.0, 3.0, 0.5])
    want = upstream_attention(q, keys, values, sinks, position)

    def run(s):
        return kernel_attention(q, keys, values, s, position, 8, kernel_visible("gqa"))

    _close(run(sinks), want)
    _far(run(np.full(4, -1e30)), want)
    # the sink's share of each head's softmax is what shrinks the output
    no_sink = upstream_attention(q, keys, values, np.full(4, -np.inf), position)
    assert np.all(np.linalg.norm(want, axis=1) < np.linalg.norm(no_sink, axis=1))


def test_a_sink_far_above_every_score_does_not_overflow():
    """Starting the carry from the sink keeps exp() <= 1: a sink of 200 leaves an output of
    about exp(score - 200) scale, finite, as upstream's max-subtracted softmax gives."""
    rng = np.random.default_rng(2)
    q, keys, values = _qkv(rng, 4)
    sinks = np.full(4, 200.0)
    got = kernel_attention(q, keys, values, sinks, 3, 4, kernel_visible("gqa"))
    assert np.all(np.isfinite(got))
    _close(got, upstream_attention(q, keys, values, sinks, 3), rtol=1e-5, atol=1e-40)


def test_the_kernel_attention_agrees_with_the_reference_attend():
    """The same ring through the reference's own attend and cache_slots (its oracle)."""
    rng = np.random.default_rng(3)
    position, slots = 21, WINDOW
    q, keys, values = _qkv(rng, position + 1)
    sinks = rng.normal(0, 1, 4)
    ring_k, ring_v = np.zeros((slots, 2, 64)), np.zeros((slots, 2, 64))
    for p in range(position + 1):
        ring_k[p % slots], ring_v[p % slots] = keys[p], values[p]
    slot, visible = gqa_ref.cache_slots(True, slots, jnp.array([position]), WINDOW)
    want = gqa_ref.attend(jnp.asarray(q)[None], jnp.asarray(ring_k.transpose(1, 0, 2), F32)[None],
                          jnp.asarray(ring_v.transpose(1, 0, 2), F32)[None], visible,
                          jnp.asarray(sinks, F32))[0]
    got = kernel_attention(q, ring_k, ring_v, sinks, position, 4, kernel_visible("swa", WINDOW, slots))
    _close(got, np.asarray(want, np.float64))
    assert int(slot[0]) == position % slots


@pytest.mark.parametrize("window,slots", [(8, 8), (8, 11), (1, 1), (4, 6)])
def test_ring_visibility_is_a_simulated_rings(window, slots):
    """Every slot at every position: visible exactly when the ring, written position by
    position, holds there a position in (p - W, p]."""
    held = np.full(slots, -1)
    slot = jnp.arange(slots)[None, :]
    for p in range(3 * slots + 2):
        held[p % slots] = p
        want = (held >= 0) & (held > p - window) & (held <= p)
        got = np.asarray(kernel_visible("swa", window, slots)(slot, jnp.int32(p)))[0]
        np.testing.assert_array_equal(got, want, err_msg=f"position {p}")


# ---- the router ------------------------------------------------------------------------------------


def upstream_route(x, weight, bias, top_k):
    """GptOssTopKRouter: logits = x W^T + b, topk, softmax over the k values, scattered."""
    logits = x @ weight.T + bias
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :top_k]
    top = np.take_along_axis(logits, ids, axis=-1)
    p = np.exp(top - top.max(axis=-1, keepdims=True))
    scores = np.zeros_like(logits)
    np.put_along_axis(scores, ids, p / p.sum(axis=-1, keepdims=True), axis=-1)
    return scores, ids


def test_route_is_upstreams_biased_top_k_softmax():
    rng = np.random.default_rng(4)
    b, h, e, k = 5, 64, 32, 4
    x = rng.normal(0, 1, (b, h))
    weight = rng.normal(0, 0.3, (e, h))
    bias = rng.normal(0, 1.0, e)
    want, want_ids = upstream_route(x, weight, bias, k)
    logits = jnp.asarray(x @ weight.T + bias, F32)          # the router op's product and bias
    got, ids = moe_lowering.top_k_softmax_weights(logits, k)
    np.testing.assert_array_equal(np.asarray(ids), want_ids)
    _close(got, want)
    assert np.allclose(np.asarray(got).sum(axis=-1), 1.0, atol=1e-6)
    # the bias decides picks: without it some row picks other experts
    _, unbiased = moe_lowering.top_k_softmax_weights(jnp.asarray(x @ weight.T, F32), k)
    assert not np.array_equal(np.asarray(unbiased), want_ids)
    # softmax over the k picks, not over all E (the Qwen / Mixtral order) then renormalised
    full = np.exp(np.asarray(logits, np.float64))
    full = full / full.sum(axis=-1, keepdims=True)
    _far(np.take_along_axis(full, want_ids, -1), np.take_along_axis(want, want_ids, -1))


# ---- clamped SwiGLU and one expert ----------------------------------------------------------------


def upstream_swiglu(gate_up, alpha=1.702, limit=7.0):
    """GptOssExperts on an interleaved gate|up product [..., 2I]."""
    gate, up = gate_up[..., ::2], gate_up[..., 1::2]
    gate = np.minimum(gate, limit)
    up = np.clip(up, -limit, limit)
    glu = gate / (1 + np.exp(-alpha * gate))
    return (up + 1) * glu


def test_the_clamped_swiglu_on_the_kernels_halves():
    """Interleaved products with values well past +-limit, de-interleaved into lane-padded
    halves (96 wide -> 128), activated: upstream's values, and zero in the padding."""
    rng = np.random.default_rng(5)
    gate_up = rng.uniform(-12, 12, (6, 2 * 96))
    assert (gate_up[:, ::2] < -7).any() and (gate_up[:, ::2] > 7).any()
    assert (np.abs(gate_up[:, 1::2]) > 7).any()
    want = upstream_swiglu(gate_up)
    halves = gate_up_halves(MOE, gate_up.T, 128).T                 # [6, 256]
    got = np.asarray(layer_ops.clamped_swiglu_halves(jnp.asarray(halves, F32), 128, 1.702, 7.0))
    _close(got[:, :96], want)
    assert np.all(got[:, 96:] == 0)
    # an alpha of 1, or no +1 on up: caught at the output's scale
    gate, up = halves[:, :96], halves[:, 128:224]
    for mutant in (layer_ops.clamped_swiglu(gate, up, 1.0, 7.0),
                   layer_ops.clamped_swiglu(gate, up - 1.0, 1.702, 7.0)):
        _far(mutant, want)
    # a gate clamped from below too: tiny values (sigmoid(-1.702 * 7) < 1e-5), but each one
    # where gate < -8 is off by more than half of itself (glu(-7) / glu(-8) > 4)
    mutant = np.asarray(layer_ops.clamped_swiglu(jnp.clip(gate, -7, 7), up, 1.702, 7.0))
    below = gate < -8
    assert below.sum() > 10
    assert np.all(np.abs(mutant[below] - want[below]) > 0.5 * np.abs(want[below]))
    _close(mutant[gate >= -7], want[gate >= -7])


def test_the_lowered_experts_clamp_at_the_configs_limit_with_their_biases():
    """Upstream's experts (checkpoint-form weights: gate_up [2I, H] interleaved rows, down
    [H, I], f64) weighted by their routing weights, against the lowered routed_experts body on
    the packed layout ([H, 2 * half], [half, H], width 96 padded to 128) with the MINI's alpha
    and limit: equal, on products a tenth of whose gates lie past 1.01 times the limit and as
    many ups past either side of it, so a limit off by 1 % is caught; dropping either bias is
    too, and the padding changes nothing."""
    rng = np.random.default_rng(6)
    b, h, i, half, experts = 3, MINI.hidden_size, 96, 128, 2
    limit, alpha = MINI.swiglu_limit, MINI.swiglu_alpha
    x = rng.normal(0, 1, (b, h))
    w_gu = rng.normal(0, 0.5, (experts, 2 * i, h))
    b_gu = rng.normal(0, 0.5, (experts, 2 * i))
    w_d = rng.normal(0, 0.1, (experts, h, i))
    b_d = rng.normal(0, 0.5, (experts, h))
    weights = rng.uniform(0.2, 0.8, (b, experts))
    products = np.einsum("bh,eoh->ebo", x, w_gu) + b_gu[:, None]
    assert np.mean(products[..., ::2] > 1.01 * limit) > 0.1
    assert np.mean(np.abs(products[..., 1::2]) > 1.01 * limit) > 0.2

    def upstream(limit=limit, gate_up_bias=1.0, down_bias=1.0):
        act = [upstream_swiglu(x @ w_gu[e].T + gate_up_bias * b_gu[e], alpha, limit) for e in range(experts)]
        return sum(weights[:, e:e + 1] * (act[e] @ w_d[e].T + down_bias * b_d[e]) for e in range(experts))

    packed = [{n: jnp.asarray(a, F32) for n, a in
               dict(gate_up=gate_up_halves(MOE, w_gu[e], half).T,
                    gate_up_bias=gate_up_halves(MOE, b_gu[e], half)[None],
                    down=np.pad(w_d[e].T, ((0, half - i), (0, 0))), down_bias=b_d[e][None]).items()}
              for e in range(experts)]
    want = upstream()
    got = lowered_routed_experts(lowering, MINI, {"expert_half": half, "gate_up_group": 0, "down_group": 0},
                                 packed, jnp.asarray(x, F32), jnp.asarray(weights, F32))
    _close(got, want, rtol=2e-5, atol=2e-5)
    for mutant in (upstream(limit=1.01 * limit), upstream(gate_up_bias=0.0), upstream(down_bias=0.0)):
        _far(mutant, want)
    with pytest.raises(ValueError, match="two halves"):
        gate_up_halves(MOE, w_gu[0], 64)


# ---- YaRN RoPE ---------------------------------------------------------------------------------------


def upstream_yarn(theta=150000.0, d=64, factor=32.0, original=4096, beta_fast=32.0, beta_slow=1.0):
    """_compute_yarn_parameters for gpt-oss's published rope_scaling (truncate false), f64."""
    def correction_dim(rotations):
        return d * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))
    low, high = max(correction_dim(beta_fast), 0), min(correction_dim(beta_slow), d - 1)
    pos_freqs = theta ** (np.arange(0, d, 2) / d)
    ramp = np.clip((np.arange(d // 2) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp                                  # inv_freq_extrapolation_factor
    inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolation) + (1 / pos_freqs) * extrapolation
    return inv_freq, 0.1 * math.log(factor) + 1.0


def test_yarn_rope_rotates_whole_heads_as_upstream():
    inv_freq, scale = upstream_yarn()
    _close(rope.yarn_inv_freq(BIG), inv_freq, rtol=1e-7)
    positions = np.array([0, 1, 127, 128, 4095, 70000])
    table = np.asarray(rope.rope_table(BIG, jnp.asarray(positions, jnp.int32)))
    angles = positions[:, None].astype(F32) * inv_freq.astype(F32)      # f32 product, as both
    cos, sin = np.cos(angles.astype(np.float64)) * scale, np.sin(angles.astype(np.float64)) * scale
    rng = np.random.default_rng(7)
    x = rng.normal(0, 1, (len(positions), 2 * 64))
    first, second = x[:, :32], x[:, 32:64]                   # _apply_rotary_emb, head 0
    want0 = np.concatenate([first * cos - second * sin, second * cos + first * sin], axis=1)
    rot = layer_ops.rotate_half_matrix(64, 64)
    got = [layer_ops.apply_rope(jnp.asarray(x[:, j * 64:(j + 1) * 64], F32), jnp.asarray(table[0]),
                                jnp.asarray(table[1]), rot) for j in range(2)]
    assert len(got) == 2
    _close(got[0], want0, rtol=1e-5, atol=2e-5)
    # no attention factor (plain RoPE scale) is caught
    _far(np.asarray(got[0]) / scale, want0)
