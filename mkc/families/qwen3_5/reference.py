"""Qwen3.5's reference decode step (transformers' `Qwen3_5ForCausalLM`): the layer library's
(`mkc.layers.decode`), as `graph.LAYERS` composes it: gated delta net (`gdn`,
`mkc.layers.gated_delta_net.reference`) and gated attention (`gqa`: q_proj rows per head
``[query | gate]``, zero-centred q/k norms, partial rotate-half RoPE, output times
``sigmoid(gate)``; M-RoPE sections are plain RoPE for text, whose three position axes are
equal) layers, each with a SwiGLU MLP; every RMS norm but the delta net's gated one is
zero-centred, ``(1 + w)``, the final norm too; untied lm_head. The f32 oracle, or with a
`Rounding` the kernel's rounding emulation (`mkc.reference.rounding`)."""
from mkc.families.qwen3_5.config import read_dims
from mkc.families.qwen3_5.graph import LAYERS
from mkc.layers.decode import DecoderReference, norms_last

_REFERENCE = DecoderReference(LAYERS, read_dims, ("qwen3_5_text",), final_norm="zero_centred",
                              draw_rank=norms_last)
load_config, param_shapes = _REFERENCE.load_config, _REFERENCE.param_shapes
init_params, init_cache, decode_step = _REFERENCE.init_params, _REFERENCE.init_cache, _REFERENCE.decode_step
