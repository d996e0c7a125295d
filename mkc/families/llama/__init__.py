"""Llama 3.x (`llama`: meta-llama/Llama-3.1-8B and -70B), composed from the layer library:
one layer kind, `gqa` = `GQA()` then `SwiGLU()` (`graph.LAYERS`). Its own code is its config
reader (`config.py`) and that composition; bodies, reference, weights and rope are the
library's.

Facts (transformers 5.x `models/llama/`: `configuration_llama.py`, `modeling_llama.py`):
pre-norm residual blocks; `LlamaRMSNorm` is `w * x * rsqrt(mean x^2 + eps)` (plain weight);
q/k/v/o projections without biases (`attention_bias` false), GQA with `repeat_kv` (query head
h reads KV head `h // (heads / kv_heads)`), scores `q.k / sqrt(head_dim)`, causal softmax;
rotate-half RoPE on whole heads, `head_dim` = hidden / heads unless given; the llama3 scaling
(`modeling_rope_utils._compute_llama3_parameters`, attention factor 1); `LlamaMLP` is
`down(silu(gate(x)) * up(x))` without biases; final `model.norm`, untied `lm_head`.
Published configs (Llama-3.1-8B / -70B `config.json`, as third-party copies reproduce them):
hidden 4096 / 8192, 32 / 80 layers, 32 / 64 heads, 8 KV heads, intermediate 14336 / 28672,
vocab 128256, eps 1e-5, `rope_theta` 500000, llama3 scaling factor 8, low 1, high 4,
original 8192, `max_position_embeddings` 131072.
"""
from mkc.families.llama.config import FAMILY_NAME, read_dims
from mkc.families.llama.graph import LAYERS, SHARD_CLASSES, build
from mkc.layers.rope import rope_input
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=(FAMILY_NAME,), read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.llama.config", "LlamaDims"), vmem_inputs=rope_input, layers=LAYERS,
    dense_classes=("attention", "mlp", "lm_head"),
)
