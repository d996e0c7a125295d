"""The expert formats in the reference's rounding emulation: how the kernel's dots take an
expert matrix (`mkc.reference.rounding.Rounding.linear`'s operands)."""
from __future__ import annotations

from mkc.layers.expert_formats import feeds_codes
from mkc.reference.rounding import Rounding


def expert_operands(rounding: Rounding, matrix: str) -> str | None:
    """How the kernel's dots take expert matrix `matrix` (`gate_up`, `down`) in the spec's
    format: FP8 codes fed as they are (`feeds_codes`) or FP4 codes (always fed as they are) in
    a mixed dot, else bf16 values. FP8 requantized from bf16 and FP4's values are the
    requantized ones: the caller passes the checkpoint as the kernel holds it (the generated
    module's `requantized_weights`)."""
    fmt = rounding.weight_format(f"expert.{matrix}")
    if fmt is not None and fmt.name == "fp4":
        return "mixed_fp4"
    return "mixed_fp8" if fmt is not None and feeds_codes(fmt) else None
