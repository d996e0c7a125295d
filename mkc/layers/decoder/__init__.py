"""What every decoder around its layers has: the vocabulary-split embedding, final norm and
lm_head (`vocab_globals`); what the kernel runs around the layer loop is `lowering`'s."""
from __future__ import annotations

from typing import Any

from mkc.model.graph import Tensor, split


def vocab_globals(d: Any, ways: int) -> tuple[dict[str, Tensor], int]:
    """Embedding, final norm and the lm_head split `ways` ways over the vocabulary."""
    v_local = split(d.vocab_size, ways, "vocab_size", "vocab")
    H = d.hidden_size
    glob = {
        "embed": Tensor("embed", "table", (v_local, H), "bf16"),
        "final_norm": Tensor("final_norm", "vector", (H,), "f32"),
        "lm_head": Tensor("lm_head", "matrix", (H, v_local), "bf16", format_class="lm_head"),
    }
    return glob, v_local
