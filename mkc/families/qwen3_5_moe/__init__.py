"""Qwen3.5 MoE text (`qwen3_5_moe_text`, e.g. Qwen3.5-35B-A3B): Qwen3.5's gated delta net and
gated attention layers, each followed by a sparse MoE block (softmax router, top-k experts,
sigmoid-gated shared expert).

Not a registered family yet: this package holds the config reader (`config.py`) and the pure-JAX
reference (`reference.py`); it declares no `FAMILY` until its graph, weight layout, ops and module
template exist, and the registry (`mkc.families`) skips packages without one.
"""
