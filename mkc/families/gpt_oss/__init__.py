"""GPT-OSS (`gpt_oss`: openai/gpt-oss-120b and gpt-oss-20b): GQA attention alternating layer by
layer between a sliding window and the full context, with a learned sink logit per head and
biased projections, then a biased top-k MoE of MXFP4 experts with a clamped SwiGLU.

The family: its config reader (`config.py`) and its composition (`graph.py`: the layer
library's GQA with biases and sinks, sliding or full, then the library's MoE with GPT-OSS's
options); its compute bodies (`lowering.py`), reference with the kernel's rounding emulation
(`reference.py`) and weights packer (`weights.py`: the published checkpoint cut per rank) are
the library's, as the composition says; its configs
(`mkc/model/configs/gpt_oss_{mini,20b,120b}.json`) and specs
(`schedules/gpt_oss_{20b,120b}.sched`). The MINI runs on the 20b spec in interpret mode,
bit-equal to the emulation at every step (`tests/families/gpt_oss/test_gpt_oss_interpret.py`).

The sliding window's KV cache is a core mechanism the spec declares, not family code: `kv ring
N slots` in the swa phase (`mkc/lang/statements/kv_ring.py`, `mkc/resolve/kv_ring.py`,
`mkc/checks/kv_ring.py`, `mkc.runtime.kv`) keeps a sliding layer's cache in HBM as a ring of N
token slots (position p in slot p % N, HBM sized by N, not the context), streams the ring's
tiles (all of them once it has wrapped) and hands the compute body the position each slot holds
(`Layer.kv_positions`), which the library GQA masks to the window (`p - W < q <= p`). The
swa kind declares its window (`LayerKind.window`) and a `ContextLimit` of it (`mkc.layers.gqa.
window_limit`): without the ring its cache is the per-token cache of the context, exact only
within the window, and resolve refuses a longer context at the spec's `context` line
(E-CONTEXT); with it, the checks prove the ring holds every row's window (N >= W + R - 1 for a
verify step of R rows a sequence; E-KV-RING). The shipped specs: context 4096, a ring of 256
slots (128 + 7 needed at verify 8) in two 128-token tiles; the full layers read the context.
The core additions the family needed: `ContextLimit` and `LayerKind.window` (`mkc.model.graph`).

Facts, and where they were read (transformers `main` as stored in the huggingface/transformers
index; "upstream" below is that file):

* Decoder (`models/gpt_oss/modeling_gpt_oss.py`, `GptOssDecoderLayer`): pre-norm residual
  blocks, attention then MoE; `GptOssRMSNorm` is `weight * x * rsqrt(mean x^2 + eps)` in f32
  (plain weight, not zero-centred), eps `rms_norm_eps` = 1e-5; final `model.norm`, then an
  untied bias-free `lm_head` (`tie_word_embeddings` false).
* Layer pattern (`configuration_gpt_oss.py`, `__post_init__`; the published configs spell it
  out): `layer_types[i]` is `sliding_attention` for even i, `full_attention` for odd i.
  `GptOssAttention.sliding_window` is the config's `sliding_window` (128) on sliding layers;
  the mask (`masking_utils.py`, `sliding_window_overlay` and `causal_mask_function`) lets query
  position p see key positions j with `p - W < j <= p`.
* Attention (`GptOssAttention`, `eager_attention_forward`): 64 query heads, 8 KV heads,
  head_dim 64 (so 4096 query columns from a 2880 residual); `attention_bias` true: q, k, v and
  o projections all have biases; `repeat_kv` (query head h reads KV head `h // 8`); scores
  `q.k * head_dim^-0.5` plus the mask; `sinks [num_attention_heads]` is concatenated to each
  head's score row, the softmax taken over both (after subtracting the row max), the sink's
  column dropped: a sink only grows the denominator.
* RoPE (`_apply_rotary_emb`): whole heads, pairs `(i, i + D/2)`: `x1 cos - x2 sin`,
  `x2 cos + x1 sin`. YaRN (`modeling_rope_utils.py`, `_compute_yarn_parameters`; the stored
  transformers copy predates its `truncate` key, which third-party copies of the current file
  carry: `find_correction_range` floors / ceils only when `truncate`, default true):
  `rope_theta` 150000, `factor` 32, `beta_fast` 32, `beta_slow` 1,
  `original_max_position_embeddings` 4096, `truncate` false; ramp bounds `D ln(L / (2 pi
  beta)) / (2 ln theta)` (8.09 and 17.40 at D 64), clamped to [0, D - 1]; `inv_freq =
  inv_interp * ramp + inv_orig * (1 - ramp)`, `inv_interp = inv_orig / factor`; cos and sin
  are multiplied by `attention_factor = 0.1 ln(factor) + 1` (1.3466 at factor 32; a ratio of
  `mscale`s when both `mscale` and `mscale_all_dim` are given).
* Router (`GptOssTopKRouter`): `logits = x W^T + b` (weight `[E, H]`, bias `[E]`), `topk` of
  the logits, softmax over those k values only; no renormalisation beyond that.
* Experts (`GptOssExperts`): `gate_up = x @ gate_up_proj[e] + gate_up_proj_bias[e]`, gate =
  `gate_up[..., ::2]`, up = `gate_up[..., 1::2]` (interleaved, in the fused parameter
  `[E, H, 2I]` and in the checkpoint's `[E, 2I, H/32, 16]` blocks alike); `gate =
  gate.clamp(max=limit)`, `up = up.clamp(-limit, limit)`, `glu = gate * sigmoid(alpha *
  gate)`, `(up + 1) * glu @ down_proj[e] + down_proj_bias[e]`, weighted by the routing weight
  and summed. alpha 1.702 (the modeling file's constant; `GptOssConfig.swiglu_alpha` in the
  current config class), limit 7.0 (`swiglu_limit`; the bf16 `GptOssExperts` of the stored
  modeling file hard-codes 7.0, the MXFP4 one reads the config). `intermediate_size` 2880,
  `num_experts_per_tok` 4, `num_local_experts` 128 (120b) / 32 (20b); no shared expert.
* MXFP4 (`integrations/mxfp4.py`, `Mxfp4GptOssExperts` and `convert_moe_packed_tensors`):
  `*_blocks` uint8 `[E, out, in/32, 16]`, `*_scales` uint8 `[E, out, in/32]` with out, in =
  2I, H for gate_up and H, I for down (the checkpoint holds `[out, in]`; the loader transposes
  to the fused `[E, in, out]`); byte b of a block holds element 2b in its low nibble and 2b+1
  in its high nibble; e2m1 lookup `0, .5, 1, 1.5, 2, 3, 4, 6` with the sign in bit 3; value =
  `e2m1 * 2^(scale - 127)` (`ldexp`). This is `mkc.model.mxfp4`'s layout with the 16 bytes of
  each block kept as their own axis. Biases of the experts are not quantized.
* Checkpoint names (`GptOssForCausalLM` parameter names with the MXFP4 suffixes; the
  published `model.safetensors.index.json` per a third-party test that lists layer 0's 19
  tensors): `model.embed_tokens.weight`, per layer `self_attn.{q,k,v,o}_proj.{weight,bias}`,
  `self_attn.sinks`, `mlp.router.{weight,bias}`, `mlp.experts.{gate_up,down}_proj_{blocks,
  scales,bias}`, `{input,post_attention}_layernorm.weight`; `model.norm.weight`,
  `lm_head.weight`. `quantization_config.modules_to_not_convert` keeps attention, router,
  embedding and lm_head unquantized; third-party inspections of the safetensors say those
  tensors are bf16 and the blocks / scales U8.
* Published configs (`openai/gpt-oss-120b` and `-20b` `config.json`, as reproduced verbatim
  in two third-party test fixtures; the Hub files themselves were not read):
  hidden 2880, vocab 201088, 36 / 24 layers, `max_position_embeddings` 131072,
  `initial_context_length` 4096, `experts_per_token` 4 (a legacy key upstream ignores),
  `router_aux_loss_coef` 0.9, `quant_method` mxfp4, `rope_scaling` as above with top-level
  `rope_theta` 150000. Shipped as `gpt_oss_120b.json` and `gpt_oss_20b.json`.

Refused (ConfigError, at a spec's `model` line): a `hidden_act` other than silu (upstream
applies the clamped SwiGLU whatever it says), `attention_bias` false, tied embeddings, a null
`sliding_window`, a layer type other than the two, a rope type other than yarn, a partial
rotary factor, a checkpoint not quantized as mxfp4, hidden / intermediate sizes not a multiple
of the MXFP4 block.
"""
from mkc.families.gpt_oss.config import FAMILY_NAME, read_dims
from mkc.families.gpt_oss.graph import LAYERS, SHARD_CLASSES, WEIGHT_FORMATS, build
from mkc.layers.rope import rope_input
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=(FAMILY_NAME,), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.gpt_oss.config", "GptOssDims"),
    vmem_inputs=rope_input, layers=LAYERS,
    weight_formats=WEIGHT_FORMATS, e8m0_suffixes=("_scales",),
)
