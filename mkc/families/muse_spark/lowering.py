"""Muse Spark's compute bodies: the layer library's, composed as `graph.LAYERS` says (GQA with
the weightless q/k norm and the normed, gated output, rotary on the sliding layers only; the
latent MoE with its scaled sigmoid router), each between the gated residuals' pre-norm and
update (`mkc.layers.gated_residuals`); around the layer loop the embedding's weightless norm
(the gated residuals' `prologue`), the plain final norm, the soft-capped logits with the
unused vocabulary masked (`softcapped_logits`) and the host's rotary table.
"""
from __future__ import annotations

from mkc.families.muse_spark.graph import LAYERS
from mkc.layers.decoder.lowering import final_hidden  # noqa: F401
from mkc.layers.decoder.lowering import softcapped_logits as final_logits  # noqa: F401
from mkc.layers.gated_residuals.lowering import prologue  # noqa: F401
from mkc.layers.rope import host_inputs  # noqa: F401
from mkc.layers.sublayer import body_table

BODIES = body_table(LAYERS)
