"""Where the block attention residuals' vectors come from in an upstream checkpoint (Kimi
K3's names): each place's mixture query (`self_attention_res_*`, `mlp_res_*`) and the norm
after it (`input_layernorm`, `post_attention_layernorm`) under a layer's prefix, and the output
mixture's query beside the final norm (`head_vectors`)."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mkc.layers.block_residuals import NORMS, BlockMix, mix_vectors
from mkc.layers.sublayer import Sublayer
from mkc.layers.weights import tensor
from mkc.layers.weights import no_kernel_states as kernel_states  # noqa: F401  (no state)
from mkc.layers.weights import no_reference_states as reference_states  # noqa: F401
from mkc.model.sharding import ShardTable

UPSTREAM = {"attn_res_norm": "self_attention_res_norm.weight",
            "attn_res_proj": "self_attention_res_proj.weight",
            "mlp_res_norm": "mlp_res_norm.weight", "mlp_res_proj": "mlp_res_proj.weight",
            "input_norm": "input_layernorm.weight", "post_norm": "post_attention_layernorm.weight"}
HEAD = ("model.output_attn_res_norm.weight", "model.output_attn_res_proj.weight")


def tensor_names(s: Sublayer, d: Any) -> tuple[str, ...]:
    if not isinstance(s, BlockMix):
        return ()
    return (*mix_vectors(d.hidden_size, s.place), NORMS[s.place])


def vector(s: Sublayer, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    return tensor(hf, prefix + UPSTREAM[name]).reshape(1, -1)


def head_vectors(hf: Mapping) -> np.ndarray:
    """The output mixture's norm and projection, the rows after the final norm's."""
    return np.concatenate([tensor(hf, name).reshape(1, -1) for name in HEAD])
