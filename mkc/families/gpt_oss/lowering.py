"""The compute body of every GPT-OSS decode op, as the generic module calls it
(`mkc.families.qwen3_5.lowering` has the convention).

A model layer runs as two sublayers of the layer loop: attention (`swa` on sliding layers,
`gqa` on full ones), then the MoE (`moe`), every body the layer library's (`graph.LAYERS`,
`BODIES`): GQA with q/k/v and o_proj biases, sinks (the online softmax starts from each head's
sink logit) and on sliding layers the window's mask; the MoE with its router's bias, the top-k
softmax over the picked logits, each expert's biases and the clamped SwiGLU on its
de-interleaved `[gate | up]` halves, the expert matmul on MXFP4 or FP8 codes
(`mkc.layers.expert_formats`); around the layers the plain final norm
(`mkc.layers.decoder.lowering`) and the host's YaRN rotary table (`mkc.layers.rope.host_inputs`).
"""
from __future__ import annotations

from mkc.families.gpt_oss.graph import LAYERS
from mkc.layers.decoder.lowering import final_hidden, prologue  # noqa: F401
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table

BODIES = body_table(LAYERS)
