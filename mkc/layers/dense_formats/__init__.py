"""How a streamed (ring) matrix class is stored when the spec says `format CLASS FORMAT channel
rounded`: the one home of the dense formats, the classes of bf16 matrices other than routed
experts (attention projections, dense MLPs, shared experts, latent projections, the lm_head).

A matrix of such a class streams through the weight ring as 8-bit codes with one scale per
output column (the column's values are its codes times the scale, so the scale multiplies the
column's f32 sum after the dot: an exact factorisation):

* `fp8`: e4m3 codes, fed to the MXU as they are where it takes FP8 operands (a mixed
  bf16 x fp8 dot; `mkc.target.Generation.fp8_operand`), else converted to bf16 first;
* `int8`: int8 codes in a mixed bf16 x int8 dot (libtpu converts them; measured:
  benchmarks/format_probe.py --dense).

Each output column's scale is the bf16 value nearest its largest magnitude over the code's
largest (448 for e4m3, 127 for int8), taken over the whole checkpoint row (every rank's inputs:
a row-parallel matrix's ranks share it), so the largest code is always that largest: the values
`codes x scale` (exact in f32) give back their scale and codes, which is how the references'
rounding emulation reads them (`mkc.reference.rounding.channel_codes`). Codes round to nearest
(ties to even); FP8 below 2**-6 of the scale is subnormal. A checkpoint's bf16 values (8
significant bits) do not fit 4 (e4m3) or 7 (int8), so the formats always round: the spec must
say `rounded`, and the error is reported per class (`mkc.model.channel_codes.requantization`).

In the ring a slot holds two rows of codes a bf16 element (`mkc.ir.ring_tile_shape`); the last
row tile of each column block carries the block's scales in `mkc.ir.SCALE_ROWS` more slot rows
(one bf16 row of them used), so they arrive with the codes and no other mechanism moves them.
Here, importing no jax: the classes and formats offered and their rules (`resolve`); the
kernel's dot is `mkc.runtime.ring.matmul`, the packing `mkc.model.channel_codes` (numpy,
below the runtime that packs with it), the emulation
`mkc.reference.rounding`.
"""
from __future__ import annotations

import dataclasses

from mkc.ir import MatrixFacts, WeightFormat
from mkc.model.family import FormatError

# The classes a family may offer (`Family.dense_classes`), each matrix's class declared by the
# tensor (`mkc.model.graph.Tensor.format_class`); what each holds, for diagnostics and docs.
CLASSES = {
    "attention": "attention projections (query, key, value, gates and output)",
    "mlp": "a dense MLP's gate|up and down",
    "shared_expert": "shared experts' gate|up and down",
    "latent": "a latent MoE's down and up projections",
    "lm_head": "the vocabulary projection",
}
# The formats every class takes, the checkpoint's first.
FORMATS = ("bf16", "fp8", "int8")
# Codes count one value a byte; their scales are not multiplied (`mkc.perf.sim` prices reads).
FACTS = MatrixFacts(values_per_byte=1.0)


def resolve(cls: str, fmt: WeightFormat) -> WeightFormat:
    """The format of dense class `cls` as the spec writes it, checked: bf16 (no scale, no
    rounding) or FP8 / int8 codes with one scale per output column, which always round the
    checkpoint's bf16 values. FormatError (message, hint) otherwise."""
    if fmt.name == "bf16":
        if fmt.channel or fmt.rounded:
            word = "channel" if fmt.channel else "rounded"
            raise FormatError(cls, f"bf16 stores {cls} as the checkpoint's values: `{word}` "
                              "means nothing for it", f"remove `{word}`, or store {cls} as "
                              f"codes: `format {cls} int8 channel rounded`")
        return fmt
    if fmt.block:
        raise FormatError(cls, f"{cls} takes one scale per output column, not per block of "
                          f"{fmt.block} input rows", f"write `format {cls} {fmt.name} channel "
                          "rounded`")
    if not fmt.channel:
        raise FormatError(cls, f"{fmt.name.upper()} codes of {cls} take one scale per output "
                          "column: say so with `channel`", f"write `format {cls} {fmt.name} "
                          "channel rounded`")
    if not fmt.rounded:
        bits = {"fp8": "e4m3 keeps 4", "int8": "int8 keeps 7"}[fmt.name]
        raise FormatError(cls, f"the checkpoint's {cls} is bf16 (8 significant bits) and {bits}: "
                          f"requantizing it to {fmt.name.upper()} rounds almost every value, so "
                          "the spec must accept the rounding", f"write `format {cls} {fmt.name} "
                          "channel rounded` (the error is reported per matrix class), or keep "
                          "it bf16 (drop the `format` line)")
    return fmt


def codes(fmt: WeightFormat | None) -> str:
    """How a matrix of a class stored in `fmt` sits in the ring: "bf16", "fp8" or "int8"."""
    return "bf16" if fmt is None or fmt.name == "bf16" else fmt.name


def apply(tensors: dict, formats: dict[str, WeightFormat]) -> dict:
    """A kind's tensors with each matrix of a class stored as codes retyped to its codes (and
    priced as such: `FACTS`); the rest as they are."""
    out = {}
    for name, t in tensors.items():
        fmt = formats.get(t.format_class) if t.role == "matrix" and t.format_class else None
        out[name] = t if codes(fmt) == "bf16" else dataclasses.replace(t, dtype=codes(fmt),
                                                                       mxu=FACTS)
    return out
