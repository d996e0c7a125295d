"""The layer library: the layer kinds families compose, each owning its graph ops and tensors,
compute bodies, reference math with the kernel's rounding emulation, and where its weights come
from in an upstream checkpoint.

* `sublayer`: a kind configured by its options (`Sublayer`), a family's layer kinds composed of
  them (`layer_kinds`), and the bodies table keyed by (layer kind, op) (`body_table`).
* Kinds, one package each (`__init__`: options, ops and tensors, importing no jax; `lowering`,
  `reference`, `weights`): `gqa` (grouped-query attention and its variants), `swiglu` (a dense
  SwiGLU MLP), `gated_delta_net` (Qwen3.5's linear attention; `gated_delta_net.config` reads
  a hybrid of it and gated attention), `kda` (Kimi Delta Attention, Kimi Linear's and K3's
  linear attention: a delta rule with a decay per key channel), `mla` (multi-head latent
  attention, weight-absorbed over a latent cache: DeepSeek's with RoPE, K3's gated NoPE one),
  `moe` (a sparse mixture of experts: softmax top-k router, routed SwiGLU experts in bf16 or
  FP8 blocks, an optional gated shared expert).
* Shared pieces: `ops` (kernel math), `reference` (reference math), `rope` (config reading, the
  host's table), `decoder` (the vocabulary-split globals; `decoder.lowering`: the prologue
  and final norm around the layer loop), `config` (config reading: defaults, refusals,
  attention heads, `layer_types`), `weights` (`DecoderWeights`),
  `decode` (`DecoderReference`: a composed family's reference decode step), `expert_formats`
  (how routed experts are stored and multiplied: bf16, MXFP4, FP8 and FP4 codes under E8M0
  block scales; their rules, slot tensors, kernel decode, packers and emulation operands),
  `dense_formats` (the other streamed classes as 8-bit codes with a scale per output column:
  rules, classes, packing).
"""
