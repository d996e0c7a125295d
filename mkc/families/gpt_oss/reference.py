"""GPT-OSS's reference decode step (transformers' ``GptOssForCausalLM``, gpt-oss-120b / -20b):
the layer library's (``mkc.layers.decode``) for the family's composition, two loop layers a
model layer, random weights drawn with each layer's norms last. In f32, every dot at
``Precision.HIGHEST``, bf16 weights upcast and MXFP4 experts decoded exactly; the package
docstring lists the facts and where they were read. Per layer, on the residual ``x [B, H]``:

* ``h = rms_norm(x) * input_layernorm.weight`` (plain weight, not zero-centred), then attention
  (the layer library's GQA with biases and sinks, sliding on sliding layers:
  `mkc.layers.gqa.reference.block`): q, k, v projections with biases; RoPE with YaRN
  frequencies on whole heads in the halves convention (pair ``(i, i + D/2)``), cos and sin
  multiplied by the YaRN attention factor; scores ``q.k * D^-0.5`` over the visible positions,
  query head h reading KV head ``h // (Hq/Hkv)``; the head's sink logit joins the softmax's
  denominator only; ``o_proj`` with its bias;
* a ``sliding_attention`` layer sees positions ``p - W < j <= p`` (``W = sliding_window``), a
  ``full_attention`` layer ``j <= p``;
* ``x += attention``; ``h = rms_norm(x) * post_attention_layernorm.weight``; the MoE: router
  logits ``h @ router.weight^T + router.bias``, the ``top_k`` largest logits, softmax over those
  k only; each picked expert e: ``gate_up = W_gu[e] h + b_gu[e]`` with gate and up interleaved
  (gate = even rows, up = odd rows), ``gate = min(gate, limit)``, ``up = clip(up, -limit,
  limit)``, ``act = (up + 1) * gate * sigmoid(alpha * gate)``, ``out = W_d[e] act + b_d[e]``;
  ``x += sum_k weight_k * out_k``;
* after the last layer ``rms_norm(x) * model.norm.weight`` and ``lm_head`` (no bias, untied).

Decode state (``init_cache``; B batch, T context, W window), bf16 like upstream's cache:
``layers.{i}.key_cache`` / ``value_cache`` ``[B, Hkv, T, D]`` on full layers (slot t holds
position t) and ``[B, Hkv, W, D]`` on sliding layers, a ring of the last W positions (slot
``p % W`` holds position p; the slots a new row has not yet written are masked). A sliding
cache of N > W slots (a kernel's `kv ring N slots`, gathered by ``weights.reference_states``)
is the same ring with slot ``p % N``, each slot masked by the position it holds. Keys are stored
after RoPE. The new token's k and v are written first and read back, so a token sees the same
bf16 values whether it is the current one or a past one. Positions must be < T.

Kernel rounding emulation (``rounding``, ``mkc.reference.rounding.Rounding`` from a compiled
schedule): the step rounds and sums where the generated kernel (``mkc.families.gpt_oss.lowering``)
does, each piece in the kernel's expression and shapes (``mkc.layers.gqa.reference``,
``mkc.layers.moe.reference``):

* the embedding's exact vocab all-reduce; norms as ``x * rsqrt(mean(x^2) + eps) * w``;
* every matmul's activation rounded to bf16 and multiplied by the bf16 dot the kernel issues
  (``Rounding.linear``); q, k, v, the router and the experts' biases added to the f32 product;
* RoPE from the host's f32 table (`mkc.layers.rope.rope_table`: the YaRN angles' cos and sin
  times the attention factor) head by head as ``x cos + (x R) sin`` with the rotate-half matrix R;
* keys and values stored in the KV cache's dtype; attention per row and group of a rank's query
  heads sharing a KV head as an online softmax over the schedule's KV tiles, the queries and
  probabilities split in three bf16 parts (the layer library's ``tiled_attention``), whose
  carry starts from the heads' sinks (max = sink, denominator 1, accumulator 0); a sliding layer's
  cache as the kernel's ring (its slots, up to all of them once wrapped), each slot masked by
  the position it holds (written, causal, within the window);
* ``o_proj`` as per-rank partial sums over the heads all-reduced as the schedule says, then
  its bias added to the reduced sum, which is added to x;
* the router's top k of the biased logits, the weights ``exp(logit - max)`` of the picks
  divided by their sum over all E lanes; the routed experts per rank (``local_experts`` whole
  experts each, in id order), gate|up de-interleaved into the kernel's padded ``[gate | up]``
  halves, each matrix pack group by pack group (``graph.pack_groups``), bias, clamped SwiGLU,
  down and its bias, each expert added as one fused ``acc + weight * out``
  (`mkc.layers.moe.reference.expert_parallel_sum`); the partial sums all-reduced, then added
  to x.
"""
from mkc.families.gpt_oss import FAMILY
from mkc.layers.decode import DecoderReference, norms_last
from mkc.layers.moe.reference import route, selection_scores  # noqa: F401
from mkc.layers.sublayer import paired

load_config, param_shapes, init_params, init_cache, decode_step = DecoderReference.of(
    FAMILY, model_layer=paired, draw_rank=norms_last).functions()
