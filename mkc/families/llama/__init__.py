"""Llama 3.x (`llama`: meta-llama/Llama-3.1-8B and -70B), composed from the layer library:
one layer kind, `gqa` = `GQA()` then `SwiGLU()` (`graph.LAYERS`). Its own code is its config
reader (`config.py`) and that composition; bodies, reference, weights and rope are the
library's. It also reads `mistral` configs, each type by its own config class's defaults
(`config.CONFIG_CLASSES`): a Mistral without a sliding window is these layers.

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

Mistral (transformers 5.x `models/mistral/`: `configuration_mistral.py`, `modeling_mistral.py`):
the same blocks (RMS norm with a plain weight, rotate-half RoPE, GQA, `MistralMLP` a bias-free
SwiGLU, untied `lm_head`), its projections built without biases whatever the config says; a
causal mask over the whole context when `sliding_window` is null, a sliding-window mask when it
is set. `MistralConfig`'s defaults differ from Llama's: intermediate 14336, 8 KV heads (an
explicit null: the query heads' count), `sliding_window` 4096 when omitted.
"""
from mkc.families.llama.config import FAMILY_NAME, MODEL_TYPES, read_dims
from mkc.families.llama.graph import LAYERS, SHARD_CLASSES, build
from mkc.layers.rope import rope_input
from mkc.model.family import Family

FAMILY = Family(
    name=FAMILY_NAME, model_types=MODEL_TYPES, read_dims=read_dims,
    shard_classes=SHARD_CLASSES, build=build, package=__name__,
    dims_import=("mkc.families.llama.config", "LlamaDims"), vmem_inputs=rope_input, layers=LAYERS,
    dense_classes=("attention", "mlp", "lm_head"),
)
