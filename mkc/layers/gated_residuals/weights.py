"""Where the gated residuals' vectors come from in an upstream checkpoint (Muse Spark's names,
under a layer's prefix): each place's pre-norm weight, its residual gate (f32, served as it is:
the kernel forms alpha and beta) and the post-MLP norm's weight, whole on every rank."""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mkc.layers.gated_residuals import (GATE_PARAMS, GATES, POST_NORM_WEIGHTS, POST_NORMS, PRE_NORM_WEIGHTS,
                                        PRE_NORMS, GatedAdd, GatedPre)
from mkc.layers.sublayer import Sublayer
from mkc.layers.weights import tensor
from mkc.layers.weights import no_kernel_states as kernel_states  # noqa: F401  (no state)
from mkc.layers.weights import no_reference_states as reference_states  # noqa: F401
from mkc.model.sharding import ShardTable

UPSTREAM = ({PRE_NORMS[p]: w for p, w in PRE_NORM_WEIGHTS.items()}
            | {GATES[p]: g for p, g in GATE_PARAMS.items()}
            | {POST_NORMS[p]: w for p, w in POST_NORM_WEIGHTS.items()})


def tensor_names(s: Sublayer, d: Any) -> tuple[str, ...]:
    if isinstance(s, GatedPre):
        return (PRE_NORMS[s.place],)
    return s.vectors if isinstance(s, GatedAdd) else ()


def vector(s: Sublayer, hf: Mapping, d: Any, prefix: str, name: str, rank: int, shards: ShardTable
           ) -> np.ndarray:
    return tensor(hf, prefix + UPSTREAM[name]).reshape(1, -1)
