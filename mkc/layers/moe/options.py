"""The options of `MoE` that change its math, as objects that declare it: a router (`Router`:
what the route op reads, the checkpoint tensors it loads, its scaling and renormalising), an
expert activation (`Activation`, `mkc.layers.activation`) and the experts' checkpoint layout
(`Checkpoint`); routed experts in a latent space (`Latent`: its tensors and where its norms
sit). A router's math is one entry, by its type, in a table of each jax module: its kernel
routing in `mkc.layers.moe.lowering.KERNEL_ROUTING`, its reference routing, selection and
scores in `mkc.layers.moe.reference.ROUTER_MATH`; a new router is one subclass here and one
entry in each. The kind's graph, bodies, reference and weights ask it and do not branch on
its name.

Declared without jax: checking a spec imports none of the modules that hold the math.
"""
from __future__ import annotations

import enum
import fnmatch
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from mkc.layers.activation import Activation  # noqa: F401  (an option of MoE and SwiGLU)
from mkc.layers.expert_formats import MX_BLOCK, NVFP4_BLOCK
from mkc.model.family import ConfigError
from mkc.model.graph import Tensor


@dataclass(frozen=True)
class Router:
    """How rows pick their experts from the router's logits and weight them. `scoring` is the
    name the reference's `route(logits, top_k, renormalize, scoring, ...)` takes (the harness
    calls it with the arguments `route_args` gives)."""

    scoring: ClassVar[str] = ""

    # the vectors the route op reads beside the logits
    reads: ClassVar[tuple[str, ...]] = ()

    def vectors(self, columns: int) -> dict[str, Tensor]:
        """Its vectors (graph tensors, by name) over the router's `columns` (its experts, and
        the zero columns that pad them where the router's columns are split)."""
        return {}

    def checkpoint_tensors(self, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
        """Its upstream tensors under the MoE's prefix (`mlp.`), beside the router's weight."""
        return {}

    def vector_tensor(self, name: str) -> str:
        """The upstream tensor (under the MoE's prefix) of its vector `name`."""
        raise KeyError(name)

    # the router's weight stored f32 upstream: held as the columns of two bf16 matrices side by
    # side, `[hi | lo]` (hi the weight rounded to bf16, lo the rest rounded), summed after one dot
    weight_pair: ClassVar[bool] = False
    # added to the picked scores' sum where they are renormalised
    eps: ClassVar[float] = 0.0

    def logit_scale(self, d: Any) -> float | None:
        """A factor on the router's logits before they are scored (None: none)."""
        return None

    def scaling(self, d: Any) -> float:
        """The factor on the picked experts' weights."""
        return 1.0

    def renormalise(self, d: Any) -> bool:
        return bool(d.norm_topk_prob)

    def route_args(self, p: Any, d: Any) -> tuple:
        """`route`'s arguments past the logits (`p`: the MoE's parameters, under its prefix)."""
        return d.top_k, self.renormalise(d), self.scoring


@dataclass(frozen=True)
class Softmax(Router):
    """Softmax over all E experts, the top k, divided by their sum when `norm_topk_prob`
    (Qwen3-MoE's)."""

    scoring: ClassVar[str] = "softmax"


@dataclass(frozen=True)
class TopKSoftmax(Router):
    """The k largest logits, their softmax over those k only (`GptOssTopKRouter`)."""

    scoring: ClassVar[str] = "top_k_softmax"

    def renormalise(self, d: Any) -> bool:
        return True


@dataclass(frozen=True)
class Sigmoid(Router):
    """DeepSeek-V3's (`DeepseekV3TopkRouter`): sigmoid scores, picked by `scores + bias` (the
    correction bias, vector `bias`: selection only) among the best groups, renormalised when
    `norm_topk_prob`, times `routed_scaling_factor`; Kimi K3's with one group. Logits wider
    than the experts (a split router's zero columns) are cut to them."""

    scoring: ClassVar[str] = "sigmoid"
    bias: str = "correction_bias"

    @property
    def reads(self) -> tuple[str, ...]:
        return (self.bias,)

    def vectors(self, columns: int) -> dict[str, Tensor]:
        # e_score_correction_bias [E]: added to the scores to pick, not to weight
        return {self.bias: Tensor(self.bias, "vector", (columns,), "f32")}

    def checkpoint_tensors(self, d: Any, prefix: str) -> dict[str, tuple[tuple[int, ...], str]]:
        return {prefix + "gate.e_score_correction_bias": ((d.experts,), "float32")}

    def vector_tensor(self, name: str) -> str:
        if name != self.bias:
            raise KeyError(name)
        return "gate.e_score_correction_bias"

    def scaling(self, d: Any) -> float:
        return d.routed_scaling_factor

    def route_args(self, p: Any, d: Any) -> tuple:
        return (d.top_k, self.renormalise(d), self.scoring, p["gate.e_score_correction_bias"],
                self.scaling(d), getattr(d, "n_group", 1), getattr(d, "topk_group", 1))


@dataclass(frozen=True)
class ScaledSigmoid(Sigmoid):
    """Muse Spark's (`MuseSparkTopkRouter`): the f32 weight (`weight_pair`), the logits times
    the model's `output_multiplier`, then the sigmoid router's math in one group, always
    renormalised, the sum plus 1e-15 (upstream's `norm_topk_prob_eps`: no change to an f32 sum
    above 2e-8; kept so the formula is upstream's), times `routed_scaling_factor`."""

    scoring: ClassVar[str] = "scaled_sigmoid"
    weight_pair: ClassVar[bool] = True
    eps: ClassVar[float] = 1e-15

    def logit_scale(self, d: Any) -> float | None:
        return d.output_multiplier

    def renormalise(self, d: Any) -> bool:
        return True


SOFTMAX, TOP_K_SOFTMAX, SIGMOID, SCALED_SIGMOID = Softmax(), TopKSoftmax(), Sigmoid(), ScaledSigmoid()
ROUTERS: dict[str, Router] = {r.scoring: r for r in (SOFTMAX, TOP_K_SOFTMAX, SIGMOID, SCALED_SIGMOID)}


@dataclass(frozen=True)
class Latent:
    """Routed experts in a latent space: `down` projects the MoE's input to the latent width
    (the dims field `width`), the experts run on it, `up` projects their weighted sum back.
    One RMS norm of the latent (`norm`, its weight `norm_weight`: "plain" `w` or
    "zero_centred" `1 + w`, eps `rms_norm_eps`) sits on the experts' weighted sum (`norm_at
    = "sum"`: Kimi K3's) or on the projected input before the experts (`"input"`: Muse
    Spark's); `expert_norm` names an input-scaled norm (``y * (1 + w)``, then RMS with eps
    `post_norm_eps`; one weight for every expert) of each expert's output before its routing
    weight (Muse Spark's `experts.post_expert_norm`; none: ""). Tensor names are upstream's,
    under the MoE's prefix."""

    width: str = "routed_expert_hidden_size"
    down: str = "routed_expert_down_proj.weight"
    up: str = "routed_expert_up_proj.weight"
    norm: str = "routed_expert_norm.weight"
    norm_at: str = "sum"
    norm_weight: str = "plain"
    expert_norm: str = ""

    def __post_init__(self) -> None:
        if self.norm_at not in ("sum", "input"):
            raise ValueError(f"Latent.norm_at is 'sum' or 'input', not {self.norm_at!r}")

    def tensors(self) -> dict[str, str]:
        """The graph's latent tensors and the upstream tensor each is cut from."""
        return {"latent_down": self.down, "latent_up": self.up, "latent_norm": self.norm,
                **({"expert_norm": self.expert_norm} if self.expert_norm else {})}


class Checkpoint(enum.Enum):
    """The routed experts' format in the upstream checkpoint."""

    BF16 = "bf16"               # fused `experts.{gate_up,down}_proj` [E, out, in]
    # GPT-OSS's `experts.{gate_up,down}_proj_{blocks,scales}`: e2m1 codes and E8M0 scales per
    # 32 inputs, moved to the kernel as they are (never decoded), each gate|up half lane padded
    MXFP4 = "mxfp4"
    # Kimi K3's compressed-tensors MXFP4, per expert (`experts.{e}.w{1,3,2}.weight_packed` and
    # `.weight_scale`), cut in width slices of whole MXFP4 blocks (no padding); also held as
    # FP4 under one scale per block of rows (`fp4 block N`)
    MXFP4_PACKED = "mxfp4_packed"
    # NVIDIA's NVFP4 (ModelOpt; Muse Spark's `-NVFP4`), fused: `experts.{gate_up,down}_proj`
    # e2m1 codes [E, out, in/2] (input 2j in the low nibble), `*_weight_scale` e4m3 [E, out,
    # in/16], `*_weight_scale_2` the f32 global scale of each expert matrix [E] and
    # `*_input_scale` f32 [E]; held as it is (`nvfp4`)
    NVFP4 = "nvfp4"

    @property
    def decoded_in_kernel(self) -> bool:
        """Its codes reach the kernel as stored: halves padded to whole lane tiles, pack groups
        that divide the rows (`MoE.expert_half`, `MoE.pack_groups`)."""
        return self is Checkpoint.MXFP4

    @property
    def formats(self) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The expert classes and the formats each takes, the checkpoint's first."""
        offered = {Checkpoint.BF16: ("bf16", "fp8", "int4"), Checkpoint.MXFP4: ("mxfp4", "fp8"),
                   Checkpoint.MXFP4_PACKED: ("mxfp4", "fp8", "fp4"), Checkpoint.NVFP4: ("nvfp4",)}[self]
        return (("expert.gate_up", offered), ("expert.down", offered))

    def expert_tensors(self, prefix: str, experts: int, inter: int, io: int, bias: bool = False
                       ) -> dict[str, tuple[tuple[int, ...], str]]:
        """The routed experts' upstream tensors under `prefix` (`...experts.`), holding
        `gate_up_proj` [E, 2 inter, io] and `down_proj` [E, io, inter] in values: fused bf16, or
        GPT-OSS's MXFP4 `*_blocks` and `*_scales`, or NVFP4's codes with their scales, each with
        a bias [E, out] after it where `bias`; or Kimi's per expert, `w1` (gate), `w3` (up) and
        `w2` (down) each codes [out, in/2] and E8M0 scales [out, in/32], expert by expert."""
        if self is Checkpoint.MXFP4_PACKED:
            return {prefix + f"{e}.{w}.{part}": ((rows, k // div), "uint8")
                    for e in range(experts)
                    for w, (rows, k) in (("w1", (inter, io)), ("w3", (inter, io)), ("w2", (io, inter)))
                    for part, div in (("weight_packed", 2), ("weight_scale", MX_BLOCK))}
        out: dict[str, tuple[tuple[int, ...], str]] = {}
        for name, (o, k) in (("gate_up_proj", (2 * inter, io)), ("down_proj", (io, inter))):
            if self is Checkpoint.MXFP4:
                out |= {prefix + f"{name}_blocks": ((experts, o, k // MX_BLOCK, MX_BLOCK // 2), "uint8"),
                        prefix + f"{name}_scales": ((experts, o, k // MX_BLOCK), "uint8")}
            elif self is Checkpoint.NVFP4:
                out |= {prefix + name: ((experts, o, k // 2), "uint8"),
                        prefix + f"{name}_weight_scale": ((experts, o, k // NVFP4_BLOCK), "float8_e4m3fn"),
                        prefix + f"{name}_weight_scale_2": ((experts,), "float32"),
                        prefix + f"{name}_input_scale": ((experts,), "float32")}
            else:
                out[prefix + name] = ((experts, o, k), "bfloat16")
            if bias:
                out[prefix + f"{name}_bias"] = ((experts, o), "bfloat16")
        return out


# Where a checkpoint's layers' experts sit (the names an exclusion pattern may match): decoder
# layers at the top, or a multimodal model's language model's (Muse Spark's).
_LAYER_ROOTS = ("model.layers.{i}", "model.language_model.layers.{i}", "language_model.model.layers.{i}")


def nvfp4_expert_fields(quantization: Mapping | None, layers: int, prefix: str = "mlp.") -> dict[str, Any]:
    """The dims fields of a model whose routed experts an NVFP4 checkpoint holds (`MoE.
    expert_checkpoint`, `MoE.bf16_expert_layers`), from its quantization (config.json's
    `quantization_config`, or hf_quant_config.json's `quantization`: ModelOpt's `quant_algo`
    "NVFP4", `group_size` 16, `exclude_modules` name patterns): {"expert_checkpoint": "nvfp4",
    "expert_checkpoint_bf16_layers": the layers whose experts a pattern excludes}; {} without
    one. A pattern (fnmatch, or a module name, excluding what it holds) excludes layer i's
    experts where it names them, one of them, their MoE (`prefix`) or the layer, under any of
    the usual roots. ConfigError for a quantization that is not NVFP4 in 16-input blocks."""
    if not quantization:
        return {}
    algo, group = quantization.get("quant_algo"), quantization.get("group_size", NVFP4_BLOCK)
    if algo != "NVFP4" or group != NVFP4_BLOCK:
        raise ConfigError(f"quantization {algo!r} in groups of {group} is not computed",
                          f"the MoE reads an NVFP4 checkpoint's experts (quant_algo \"NVFP4\", group_size "
                          f"{NVFP4_BLOCK}), or a bf16 checkpoint's (no quantization)")
    patterns = quantization.get("exclude_modules") or []
    listed = isinstance(patterns, list)
    bad = [p for p in patterns if not isinstance(p, str)] if listed else [patterns]
    if bad:
        raise ConfigError(f"quantization_config exclude_modules = {json.dumps(patterns)[:60]}: "
                          + (f"{json.dumps(bad[0])[:40]} is not a module name" if listed else "not a list"),
                          "list the module names (or fnmatch patterns) the quantization keeps bf16, "
                          "as ModelOpt writes them: [\"lm_head\", \"model.layers.0.mlp.experts\"]")

    def excluded(i: int) -> bool:
        # the layer, its MoE, its experts, an expert and a linear of one (not a fused tensor's
        # name: `*mlp.gate*` excludes the router, not `gate_up_proj`)
        names = [n for root in _LAYER_ROOTS for moe in [f"{root.format(i=i)}.{prefix.rstrip('.')}"]
                 for n in (root.format(i=i), moe, f"{moe}.experts", f"{moe}.experts.0",
                           f"{moe}.experts.0.down_proj")]
        return any(fnmatch.fnmatchcase(n, pat) for n in names for pat in patterns)

    return {"expert_checkpoint": Checkpoint.NVFP4.value,
            "expert_checkpoint_bf16_layers": tuple(i for i in range(layers) if excluded(i))}
