"""DeepSeek-V3 (`deepseek_v3`, `DeepseekV3ForCausalLM`: deepseek-ai/DeepSeek-V3), composed from
the layer library: two loop layers a model layer, `mla` = `MLA(rope=True)`, then `dense` =
`SwiGLU()` or `moe` = `MoE(routing=SIGMOID, ...)` (`graph.LAYERS`). Its own code is its config
reader (`config.py`) and that composition; bodies, reference, weights and rope are the library's.

Facts (transformers 5.25 `models/deepseek_v3/`: `configuration_deepseek_v3.py`,
`modeling_deepseek_v3.py`, `modeling_rope_utils.py`): pre-norm residual blocks,
`DeepseekV3RMSNorm` a plain weight; `DeepseekV3Attention` (MLA): q = q_b_proj(rms(q_a_proj(x)))
per head [nope 128 | rope 64], [c 512 | k_rope 64] = kv_a_proj_with_mqa(x), c normed;
kv_b_proj(c) per head [k_nope | v 128]; the rope parts rotated with `rope_interleave` (pairs
(2i, 2i + 1), output evens first) by YaRN cos and sin over qk_rope_head_dim (`head_dim` =
qk_rope_head_dim); scores times `yarn_apply_mscale`: 192^-0.5 * mscale(40, mscale_all_dim)^2;
the cache holds [c | rotated k_rope]. Layers below `first_k_dense_replace` a `DeepseekV3MLP`
(SwiGLU, intermediate_size); then `DeepseekV3MoE`: `DeepseekV3TopkRouter` (sigmoid scores of an
f32 router, `e_score_correction_bias` added to pick only, groups scored by their top-2 sum,
topk_group of n_group kept, top num_experts_per_tok, renormalised with norm_topk_prob, times
routed_scaling_factor), `DeepseekV3Experts` (fused `gate_up_proj [E, 2I, H]`, `down_proj
[E, H, I]`), plus `shared_experts`, a SwiGLU of n_shared_experts x moe_intermediate_size,
ungated; final `model.norm`, untied `lm_head`. The published config (`deepseek-ai/DeepSeek-V3`
config.json): hidden 7168, 61 layers (3 dense, intermediate 18432), 128 heads, q_lora_rank 1536,
kv_lora_rank 512, qk 128 + 64, v 128, 256 experts of width 2048, top 8, 8 groups top 4, one
shared expert, scaling 2.5, vocab 129280, eps 1e-6, rope_theta 10000 with YaRN factor 40 over
4096 (beta 32 / 1, mscale and mscale_all_dim 1), max_position_embeddings 163840, one MTP layer
(`num_nextn_predict_layers`, which decode does not run: the checkpoint holds it as
`model.layers.61.*`, one past the decoder's, and loading skips it). Its checkpoint is FP8 e4m3
with an f32 scale per 128 x 128 block (`quantization_config`, read by `mkc.model.fp8_blocks`;
the shipped config is that file): the routed experts are held as they are (`format expert.* fp8 block 128 x
128`, the default of such a checkpoint), the other linear weights as the bf16 DeepSeek's
`fp8_cast_bf16.py` writes; a bf16 checkpoint (the config without `quantization_config`) keeps
its bf16 experts.
"""
from mkc.families.deepseek_v3.config import FAMILY_NAME, read_dims
from mkc.families.deepseek_v3.graph import LAYERS, MOE, SHARD_CLASSES, build
from mkc.layers.moe import EXPERT_LAYOUTS, ROUNDING_FORMATS
from mkc.layers.rope import rope_input
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=(FAMILY_NAME,), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.deepseek_v3.config", "DeepseekV3Dims"), vmem_inputs=rope_input,
    layers=LAYERS, weight_formats=MOE.weight_formats(), model_formats=MOE.weight_formats,
    rounding_formats=ROUNDING_FORMATS,
    expert_layouts=EXPERT_LAYOUTS, skips_layers_past_config=True,
)
