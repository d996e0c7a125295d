"""What a quantized format's scales may be (`ScaleRange`): the one check of a scale's range,
run where scales enter mkc, the checkpoint loader's `StoredTensor` (located: file, tensor,
index) and the packers (`checked`). Each format's range lives with its facts:
`fp8_blocks.SCALES`, `nvfp4.BLOCK_SCALES` and `nvfp4.GLOBAL_SCALES`, and int4's
(`mkc.layers.expert_formats.weights.INT4_SCALES`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class ScaleRange:
    """Scales (`noun`: what a message calls them) must lie from `low` to `high`, both finite
    and positive: NaN, 0, a negative value and one under `low` (a subnormal) are outside, and so
    is one past `high`, under which the format's largest code leaves the kernel's dtype. `why`
    says where the bounds come from."""

    noun: str
    low: float
    high: float
    why: str

    @property
    def text(self) -> str:
        """`noun` and the range, as a refusal names them."""
        return f"{self.noun} outside {self.low:.4g} to {self.high:.4g} ({self.why})"

    def outside(self, scales: Any) -> np.ndarray:
        """Where `scales` (any float dtype, e4m3 included) leave the range (NaN included)."""
        v = np.asarray(scales).astype(np.float64)
        return ~((v >= self.low) & (v <= self.high))

    def checked(self, scales: Any, what: str) -> np.ndarray:
        """`scales` as a packer takes them (arrays handed to a module's `place_weights`, not only
        a checkpoint the loader read), else ValueError naming `what` and the first bad index."""
        a = np.asarray(scales)
        bad = self.outside(a)
        if bad.any():
            first = tuple(int(i) for i in np.argwhere(bad)[0])
            raise ValueError(f"{what}: {int(bad.sum())} {self.text}, the first ({a[first]}) at "
                             f"index {list(first)}")
        return a
