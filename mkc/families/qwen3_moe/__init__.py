"""Qwen3-MoE (`qwen3_moe`: Qwen/Qwen3-30B-A3B and Qwen3-235B-A22B), composed from the layer
library: two loop layers a model layer, `gqa` = `GQA(qk_norm="plain")` then `moe` = `MoE()`
(no shared expert; `graph.LAYERS`). Its own code is its config reader (`config.py`) and that
composition; bodies, reference, weights and rope are the library's.

Facts (huggingface/transformers 5.x, `models/qwen3_moe/configuration_qwen3_moe.py` at commit
008e574391258935f3ecc3035c882e73bbcac419 and `modular_qwen3_moe.py` at
00eb1166685205e8b2c75ab33eee83dc77b18fca, with the `qwen2_moe` and `qwen3` classes they
inherit): pre-norm residual blocks,
`Qwen3MoeRMSNorm` = `LlamaRMSNorm` (`w * x * rsqrt(mean x^2 + eps)`, plain weight);
`Qwen3Attention`: q/k/v/o without biases, q and k RMS-normed per head (`q_norm`, `k_norm`
over head_dim, plain weights) BEFORE rotate-half RoPE on whole heads (default rope,
`rope_theta`), GQA by `repeat_kv`, scores scaled by `head_dim^-0.5`; `head_dim` from the
config, else hidden / heads. `Qwen3MoeSparseMoeBlock` in every layer (`mlp_only_layers` empty,
`decoder_sparse_step` 1): router `Qwen2MoeTopKRouter` (`mlp.gate.weight [E, H]`, no bias):
softmax over all experts in f32, top `num_experts_per_tok`, divided by their sum iff
`norm_topk_prob` (class default false; the published configs set it true), cast to the
activations' dtype; experts `Qwen2MoeExperts` (Mixtral's: fused `gate_up_proj [E, 2I, H]`,
gate rows first, `down_proj [E, H, I]`, `down(silu(gate) * up)` weighted by the router's
weight); no shared expert; final `model.norm`, untied `lm_head`.
Published configs (Qwen3-30B-A3B / -235B-A22B `config.json`, as third-party copies reproduce
them): hidden 2048 / 4096, 48 / 94 layers, 32 / 64 heads, 4 KV heads, head_dim 128, 128
experts, top 8, moe_intermediate_size 768 / 1536, vocab 151936, eps 1e-6, rope_theta 1e6,
norm_topk_prob true, max_position_embeddings 40960.
"""
from mkc.families.qwen3_moe.config import FAMILY_NAME, read_dims
from mkc.families.qwen3_moe.graph import LAYERS, SHARD_CLASSES, build
from mkc.layers.moe import EXPERT_LAYOUTS, ROUNDING_FORMATS, WEIGHT_FORMATS
from mkc.layers.rope import rope_input
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=(FAMILY_NAME,), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.qwen3_moe.config", "Qwen3MoeDims"), vmem_inputs=rope_input, layers=LAYERS,
    weight_formats=WEIGHT_FORMATS, rounding_formats=ROUNDING_FORMATS, expert_layouts=EXPERT_LAYOUTS,
)
