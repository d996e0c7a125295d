"""A sparse mixture-of-experts MLP (`MoE`): pre-norm; a bias-free router `[H, E]`, softmax
over all E experts in f32, the top `top_k` picked, their probabilities divided by their sum
when the model's `norm_topk_prob` says so; each picked expert a SwiGLU of width
`moe_intermediate_size` (`[gate | up]` in one matmul, then down), weighted by its probability;
optionally a shared SwiGLU expert of width `shared_expert_intermediate_size` gated by
`sigmoid(h . shared_expert_gate)` (or ungated: `shared_gate=False`); the residual add.

`routing=SIGMOID` is DeepSeek-V3's router (`DeepseekV3TopkRouter`): scores `sigmoid(logits)`;
the experts picked by `scores + e_score_correction_bias` (the vector `correction_bias`, for
selection only), group-limited when the model's `n_group` exceeds 1: the experts split into
`n_group` consecutive groups, a group's score the sum of its two largest biased scores, only
the `topk_group` best groups' experts eligible; the picked experts' unbiased scores divided by
their sum when `norm_topk_prob` (upstream adds 1e-20 to the sum: no change to an f32 sum of
scores above 1e-13), times `routed_scaling_factor`. Kimi K3's router is this with one group
(its family calls the same kernel and reference functions).

Variants are options of the one kind: Qwen3.5-MoE's block is `MoE(norm="zero_centred",
shared_expert=True)` (its config reader fixes `norm_topk_prob` true), Qwen3-MoE's `MoE()`,
GPT-OSS's `MoE(router_bias=True, routing=TOP_K_SOFTMAX, activation=Activation.CLAMPED,
expert_bias=True, checkpoint=Checkpoint.MXFP4, router_prefix="router.", gate_up_interleaved=True)`: a
biased router (`mlp.router.{weight,bias}`), the softmax over the k picked logits only
(`GptOssTopKRouter`), biased experts and the clamped SwiGLU `(clip(up, -limit, limit) + 1) * g
* sigmoid(alpha * g)`, `g = min(gate, limit)` (the model's `swiglu_alpha`, `swiglu_limit`), on
MXFP4 experts (`experts.{gate_up,down}_proj_{blocks,scales,bias}`, gate and up rows
interleaved) whose gate and up halves the slot pads to whole 128-lane tiles (`expert_half`);
DeepSeek-V3's `MoE(routing=SIGMOID, shared_expert=True, shared_gate=False,
shared_prefix="shared_experts.")`. Routed experts in a latent space are the option `latent` (a
`Latent`): Kimi K3's `Latent()`, the experts' sum normed; Muse Spark's block is
`MoE(routing=SCALED_SIGMOID, latent=Latent(width="moe_hidden_size",
down="pre_expert_proj.weight", up="post_expert_proj.weight", norm="pre_expert_norm.weight",
norm_at="input", norm_weight="zero_centred", expert_norm="experts.post_expert_norm.weight"))`:
the projected input normed before the experts, each expert's output normed before its weight,
its f32 router held as a bf16 pair, the logits times `output_multiplier`. The dims a model
gives it: hidden_size, rms_norm_eps, experts, top_k, moe_intermediate_size, norm_topk_prob
(softmax and sigmoid routing), n_group, topk_group and routed_scaling_factor (sigmoid),
swiglu_alpha and swiglu_limit (clamped), with a shared expert
shared_expert_intermediate_size, with a latent its width (the `Latent`'s field) and with its
expert norm post_norm_eps, with the scaled sigmoid router output_multiplier. Its bodies, graph,
reference and weights cover every option: a bf16 checkpoint's experts, its FP8 version with f32
block scales, or MXFP4 ones (whole experts on every core).

Sharding: routed experts expert-parallel over every core (each core holds whole experts,
`experts / ranks` of them, fetched into a pool's expert slots as routing picks them; shard
class `experts`), the shared expert's width over `mlp`. The router is replicated: every core
scores every expert, so all route alike.

Routed experts are stored as the spec's `format expert.gate_up|expert.down` says
(`mkc.layers.expert_formats`): the checkpoint's (bf16 or MXFP4), or FP8 e4m3 codes under one
E8M0 scale per block (from bf16: of whole pack groups, `fp8 block N rounded`, fed to the MXU as
they are, one mixed bf16 x fp8 dot a pack group, the block's scale multiplying the group's
partial product; requantizing bf16 rounds, 3 mantissa bits, not 7, so the spec must say
`rounded`; from MXFP4 exact at its 32-row scales). A bf16 model whose config says its
checkpoint is FP8 with f32 block scales (the dims' `weight_block_size`: DeepSeek-V3's) stores
its experts as that checkpoint does, `fp8 block 128 x 128` (`stored`), exact. A bf16
checkpoint's experts may be `int4 block N rounded` (requantized); a model whose dims say
`expert_checkpoint` "nvfp4" (Muse Spark's `-NVFP4`) holds its NVFP4 experts as they are,
`nvfp4` (`expert_checkpoint`; its bf16 layers: `expert_formats`).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from mkc.ir import WeightFormat
from mkc.layers import expert_formats as expert_formats_lib
from mkc.layers.moe.options import SOFTMAX, Activation, Checkpoint, Latent, Router
from mkc.layers.sublayer import Part, Sublayer
from mkc.model.family import ExpertLayout, FormatError
from mkc.model.graph import Op, ShardingError, Tensor, lane_pad, split

# A routed expert's matrix classes and the formats they take (`format CLASS NAME block N
# rounded`), the checkpoint's first (`Checkpoint.formats`); the formats whose packing rounds a
# bf16 checkpoint's values (nvfp4: an NVFP4 checkpoint's bf16 layers, `MoE.expert_formats`). A
# family whose model's experts may come from an NVFP4 checkpoint (the dims' `expert_checkpoint`)
# asks the model: `model_formats=MoE.weight_formats`.
WEIGHT_FORMATS = Checkpoint.BF16.formats
# an FP8 checkpoint with f32 block scales (`weight_block_size`): held as it is
FP8_CHECKPOINT_FORMATS = (("expert.gate_up", ("fp8",)), ("expert.down", ("fp8",)))
ROUNDING_FORMATS = ("fp8", "int4", "nvfp4")
# Routed experts load fused, as transformers 5 declares them (`mlp.experts.gate_up_proj [E, 2I,
# H]`, gate rows first; `mlp.experts.down_proj [E, H, I]`), or per expert, the Qwen2/3-MoE
# checkpoints' layout that transformers' `qwen2_moe` conversion mapping fuses on load
# (`MergeModulelist(dim=0)`, then `Concatenate(dim=1)` of gate and up) and writes back on save.
# An FP8 checkpoint's block scales likewise (`mkc.model.fp8_blocks`: DeepSeek-V3's published
# checkpoint stores them per expert, `mlp.experts.{e}.gate_proj.weight_scale_inv`; fused, gate
# block rows first).
# A requantized checkpoint's bf16 block scales (`format expert.* fp8 block N rounded scale bf16`:
# `weights.requantization`), f32 `[E, out, in/block]` beside the fused tensor, which then holds
# the e4m3 codes' values: not a checkpoint's, what the kernel holds.
BLOCK_SCALE = "_block_scale"
EXPERT_LAYOUTS = (
    ExpertLayout("mlp.experts.gate_up_proj",
                 ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight")),
    ExpertLayout("mlp.experts.down_proj", ("mlp.experts.{e}.down_proj.weight",)),
    ExpertLayout("mlp.experts.gate_up_proj_scale_inv", ("mlp.experts.{e}.gate_proj.weight_scale_inv",
                                                        "mlp.experts.{e}.up_proj.weight_scale_inv")),
    ExpertLayout("mlp.experts.down_proj_scale_inv", ("mlp.experts.{e}.down_proj.weight_scale_inv",)),
)


def packed_expert_layouts(prefix: str) -> tuple[ExpertLayout, ...]:
    """Kimi's per-expert MXFP4 (`experts.{e}.w{1,3,2}.weight_packed / .weight_scale`: gate, up,
    down; Inferact/tpu-megakernels kimi/load.py), or fused as transformers fuses a Kimi
    Linear's experts (a `DeepseekV3Experts`, by `MergeModulelist(dim=0)`, `Concatenate(dim=1)`
    in its conversion_mapping.py), each of a pair alike (compressed-tensors' fused naming):
    the codes pack along the input axis, so stacking rows moves whole bytes, exactly. No
    published checkpoint with fused experts was seen; this is the form a fusing exporter writes."""
    return tuple(ExpertLayout(f"{prefix}experts.{fused}.{kind}",
                              tuple(f"{prefix}experts.{{e}}.{w}.{kind}" for w in parts))
                 for fused, parts in (("gate_up_proj", ("w1", "w3")), ("down_proj", ("w2",)))
                 for kind in ("weight_packed", "weight_scale"))


@dataclass(frozen=True)
class MoE(Sublayer):
    package = "mkc.layers.moe"

    norm: str = "plain"            # the post-attention norm's weight: plain `w` or `1 + w`
    shared_expert: bool = False    # a SwiGLU expert every row runs, times a sigmoid gate
    prefix: str = "mlp."
    router_bias: bool = False      # a bias on the router's logits (vector `router_bias`, [E])
    # SOFTMAX: over all E experts, then the top k; TOP_K_SOFTMAX: the top k logits, their
    # softmax over those k only; SIGMOID: DeepSeek-V3's (module docstring; `options`)
    routing: Router = SOFTMAX
    activation: Activation = Activation.SILU    # or CLAMPED (GPT-OSS's, module docstring)
    expert_bias: bool = False      # bias rows on each expert's gate|up and down products
    checkpoint: Checkpoint = Checkpoint.BF16    # the experts' stored format upstream
    shared_gate: bool = True       # the shared expert times sigmoid(h . shared_expert_gate)
    shared_prefix: str = "shared_expert."   # the shared expert's parameters under `prefix`
    router_prefix: str = "gate."   # the router's parameters under `prefix` (GPT-OSS: `router.`)
    gate_up_interleaved: bool = False   # the checkpoint's gate|up rows alternate gate, up

    # Routed experts in a latent space (`Latent`): `latent_down` projects the normed input to
    # the latent width (its columns over shard class `latent_down`, all-gathered), the experts
    # run on it, `latent_norm` RMS-norms their sum (Kimi K3's) or the gathered latent before
    # them (Muse Spark's), `latent_up` projects the sum back (columns over `latent_up`,
    # gathered). With the latent's `expert_norm` the experts write each row's picks' outputs
    # side by side (`expert_outs`, [B, top_k * latent], a partial over the ranks sharing an
    # expert), and `expert_norm` norms each and sums them by their routing weights.
    latent: Latent | None = None
    # the router's expert columns split over shard class `router` (the siblings exchange
    # their shares), each share lane padded with zero columns
    router_split: bool = False
    residual: bool = True          # its own pre-norm and residual add (else the family's)
    # The layer kind of the layers an NVFP4 checkpoint keeps bf16 (`bf16_expert_layers`), whose
    # experts it then holds bf16 as stored (`graph_fields`); "": those layers' experts are
    # requantized to NVFP4 (`nvfp4 rounded`), the kernel holding one expert format.
    bf16_kind: str = ""

    def op_names(self) -> tuple[str, ...]:
        shared = ("shared_gate_up", "shared_down") if self.shared_expert else ()
        latent_in, latent_out = ((), ())
        if self.latent:
            normed_in = self.latent.norm_at == "input"
            latent_in = ("latent_down", "latent_norm") if normed_in else ("latent_down",)
            latent_out = (*(("expert_norm",) if self.latent.expert_norm else ()),
                          *(() if normed_in else ("latent_norm",)), "latent_up")
        return (*(("post_norm",) if self.residual else ()), "router", "route", *latent_in, *shared,
                "routed_experts", *latent_out, *(("mlp_residual",) if self.residual else ()))

    def _router_copies(self) -> int:
        """2 where the router's matrix is a bf16 pair `[hi | lo]` of an f32 weight
        (`Router.weight_pair`; a whole router: its columns are not split), else 1."""
        if self.routing.weight_pair and self.router_split:
            raise ValueError("a router held as a bf16 pair (an f32 weight) is not split: router_split=False")
        return 2 if self.routing.weight_pair else 1

    def router_cols(self, d: Any, ways: Mapping[str, int]) -> int:
        """A rank's router columns: every expert, or its lane-padded share of a split router."""
        return lane_pad(-(-d.experts // ways["router"])) if self.router_split else d.experts

    def latent_cols(self, d: Any, ways: Mapping[str, int]) -> tuple[int, int]:
        """A rank's columns of latent_down and of latent_up: lane-padded shares of the latent
        and of the hidden size."""
        return (lane_pad(-(-self.expert_io(d) // ways["latent_down"])),
                lane_pad(-(-d.hidden_size // ways["latent_up"])))

    def part(self, d: Any, ways: Mapping[str, int]) -> Part:
        """`ways["expert_mlp"]` (1 if absent): ranks sharing each routed expert's width."""
        H, E, tp = d.hidden_size, d.experts, ways.get("expert_mlp", 1)
        local = split(E, ways["experts"], "num_experts", "experts")
        width = split(d.moe_intermediate_size, tp, "moe_intermediate_size", "expert_mlp")
        per_rank = {"local_experts": local, "expert_width": width, "expert_tp": tp}
        shared_ops, shared_tensors, shared_rank = self._shared(d, ways)
        latent_ops, latent_tensors, latent_rank = self._latent(d, ways)
        routed = "mlp_out" if self.latent else "routed_out"     # projected back from the latent
        residual_reads = (routed, "x")
        if self.shared_expert:
            gate = ("h", "shared_gate") if self.shared_gate else ()
            residual_reads = ("shared_out", routed, *gate, "x")
        router_cols = self.router_cols(d, ways)
        split_ways = ways["router"] if self.router_split else 1
        ops = (
            *((Op("post_norm", reads=("x", "post_norm"), writes=("h",)),) if self.residual else ()),
            Op("router", reads=("h", "router_bias") if self.router_bias else ("h",),
               writes=("router_logits",), matmul="router"),
            Op("route", reads=("router_logits", *self.routing.reads), writes=("expert_ids", "expert_weights"),
               picks_experts=True),
            *latent_ops[:self._latent_ops_before()],
            *shared_ops,
            Op("routed_experts", reads=("latent_in" if self.latent else "h", "expert_ids", "expert_weights"),
               writes=("expert_outs" if self._per_pick() else "routed_out",),
               partial=("experts", "expert_mlp") if tp > 1 else ("experts",),
               width=self.expert_io(d) * (d.top_k if self._per_pick() else 1), runs_experts=True),
            *latent_ops[self._latent_ops_before():],
            *((Op("mlp_residual", reads=residual_reads, writes=("x",)),) if self.residual else ()),
        )
        tensors = {
            **({"post_norm": Tensor("post_norm", "vector", (H,), "f32")} if self.residual else {}),
            # shared_expert_gate [1, H]
            **({"shared_gate": Tensor("shared_gate", "vector", (H,), "f32")}
               if self.shared_expert and self.shared_gate else {}),
            "router": Tensor("router", "matrix", (H, router_cols * self._router_copies()), "bf16",
                             split_out="router" if self.router_split else None),
            **({"router_bias": Tensor("router_bias", "vector", (E,), "f32")} if self.router_bias else {}),
            **self.routing.vectors(router_cols * split_ways),
            **{n: t for n, t in latent_tensors.items() if n == "latent_down"},
            **shared_tensors,
            **{n: t for n, t in latent_tensors.items() if n != "latent_down"},
        }
        groups = self.pack_groups(d, tp)
        per_rank = shared_rank | per_rank | latent_rank | {
            "gate_up_group": groups["gate_up"], "down_group": groups["down"]}
        if self.router_split:
            per_rank |= {"router_cols": router_cols, "router_split": split_ways}
        if self.checkpoint.decoded_in_kernel:
            per_rank["expert_half"] = self.expert_half(d, tp)
        return Part(ops, tensors, per_rank)

    def _shared(self, d: Any, ways: Mapping[str, int]
                ) -> tuple[tuple[Op, ...], dict[str, Tensor], dict[str, int]]:
        """The shared expert's ops, matrices and width per rank (none without one)."""
        if not self.shared_expert:
            return (), {}, {}
        H = d.hidden_size
        shared = split(d.shared_expert_intermediate_size, ways["mlp"], "shared_expert_intermediate_size",
                       "mlp")
        ops = (
            Op("shared_gate_up", reads=("h",), writes=("shared_act",), matmul="shared_gate_up"),
            Op("shared_down", reads=("shared_act",), writes=("shared_out",), matmul="shared_down"),
        )
        tensors = {
            "shared_gate_up": Tensor("shared_gate_up", "matrix", (H, 2 * shared), "bf16",
                                     format_class="shared_expert"),
            "shared_down": Tensor("shared_down", "matrix", (shared, H), "bf16", partial_out=("mlp",),
                                  format_class="shared_expert"),
        }
        return ops, tensors, {"shared": shared}

    def _per_pick(self) -> bool:
        """The routed experts write each pick's output apart (a norm of each: `Latent.expert_norm`)."""
        return bool(self.latent and self.latent.expert_norm)

    def _latent_ops_before(self) -> int:
        """How many of the latent ops run before the routed experts (down; and the norm)."""
        return 2 if self.latent and self.latent.norm_at == "input" else 1

    def _latent(self, d: Any, ways: Mapping[str, int]
                ) -> tuple[tuple[Op, ...], dict[str, Tensor], dict[str, int]]:
        """The latent projections' ops (down; norm, up), tensors and per-rank widths (none
        without `latent`). A split that does not fill the last ranks is zero padded."""
        if not self.latent:
            return (), {}, {}
        H, latent = d.hidden_size, self.expert_io(d)
        split(H, ways["latent_up"], "hidden size (latent_up columns)", "latent_up")
        cols, up_cols = self.latent_cols(d, ways)
        normed = "latent_in" if self.latent.norm_at == "input" else "routed_out"
        ops = (
            Op("latent_down", reads=("h",), writes=("latent_in",), matmul="latent_down"),
            Op("latent_norm", reads=(normed, "latent_norm"), writes=(normed,)),
            *((Op("expert_norm", reads=("expert_outs", "expert_ids", "expert_weights", "expert_norm"),
                  writes=("routed_out",)),) if self.latent.expert_norm else ()),
            Op("latent_up", reads=("routed_out",), writes=("mlp_out",), matmul="latent_up"),
        )
        tensors = {
            "latent_down": Tensor("latent_down", "matrix", (H, cols), "bf16", split_out="latent_down",
                                  format_class="latent"),
            "latent_up": Tensor("latent_up", "matrix", (latent, up_cols), "bf16", split_out="latent_up",
                                format_class="latent"),
            "latent_norm": Tensor("latent_norm", "vector", (latent,), "f32"),
            **({"expert_norm": Tensor("expert_norm", "vector", (latent,), "f32")}
               if self.latent.expert_norm else {}),
        }
        return ops, tensors, {"latent_cols": cols, "latent_gathered": cols * ways["latent_down"],
                              "up_cols": up_cols}

    def fp8_checkpoint(self, d: Any = None) -> bool:
        """A bf16 model whose config says its checkpoint is FP8 with f32 block scales (the dims'
        `weight_block_size`, [out, in]: DeepSeek-V3's published checkpoint)."""
        return self.checkpoint is Checkpoint.BF16 and bool(getattr(d, "weight_block_size", ()))

    def expert_checkpoint(self, d: Any = None) -> Checkpoint:
        """The routed experts' format in the model `d`'s checkpoint: NVFP4 where the dims'
        `expert_checkpoint` says "nvfp4" (Muse Spark's `-NVFP4`, its bf16 model's experts
        published quantized), else the option's `checkpoint`."""
        named = getattr(d, "expert_checkpoint", "") or self.checkpoint.value
        if named == self.checkpoint.value:
            return self.checkpoint
        if named != Checkpoint.NVFP4.value or self.checkpoint is not Checkpoint.BF16:
            raise ValueError(f"the dims' expert_checkpoint {named!r}: a bf16 MoE's experts may come "
                             f"from an NVFP4 checkpoint ('nvfp4'); this MoE's are {self.checkpoint.value}")
        return Checkpoint.NVFP4

    def bf16_expert_layers(self, d: Any = None) -> tuple[int, ...]:
        """The model layers whose routed experts an NVFP4 checkpoint keeps bf16 (the dims'
        `expert_checkpoint_bf16_layers`, its quantization's excluded modules: Muse Spark's
        layers 0 and 61); () for any other checkpoint. The kernel holds one expert format, so
        `nvfp4` takes them only requantized (`expert_formats`)."""
        if self.expert_checkpoint(d) is not Checkpoint.NVFP4:
            return ()
        return tuple(sorted(getattr(d, "expert_checkpoint_bf16_layers", ()) or ()))

    def layer_checkpoint(self, d: Any, prefix: str) -> Checkpoint:
        """The experts' checkpoint format of the layer under `prefix` (`model.layers.{i}.`):
        bf16 where an NVFP4 checkpoint excludes the layer (`bf16_expert_layers`)."""
        layer = prefix.removeprefix("model.layers.").split(".")[0]
        if layer.isdigit() and int(layer) in self.bf16_expert_layers(d):
            return Checkpoint.BF16
        return self.expert_checkpoint(d)

    def weight_formats(self, d: Any = None) -> tuple[tuple[str, tuple[str, ...]], ...]:
        """The expert classes and the formats each takes, the checkpoint's first (of the model
        `d`'s checkpoint, when given: an FP8 or NVFP4 one is held as it is)."""
        return FP8_CHECKPOINT_FORMATS if self.fp8_checkpoint(d) else self.expert_checkpoint(d).formats

    def checkpoint_blocks(self, d: Any) -> tuple[int, int] | None:
        """An FP8 checkpoint's (input rows, output columns) under one scale, or None."""
        out, inp = getattr(d, "weight_block_size", ()) or (0, 0)
        return (inp, out) if self.fp8_checkpoint(d) else None

    def expert_half(self, d: Any, tp: int = 1) -> int:
        """Columns of the gate half (and of the up half) of a rank's gate|up expert matrix (its
        width slice of `tp`): MXFP4 codes are moved as the checkpoint holds them, never decoded,
        so each half is padded with zero columns to whole 128-lane tiles (down's input rows
        likewise)."""
        width = d.moe_intermediate_size // tp
        return lane_pad(width) if self.checkpoint.decoded_in_kernel else width

    def expert_io(self, d: Any) -> int:
        """The routed experts' input and output width: the hidden size, or the latent's."""
        return getattr(d, self.latent.width) if self.latent else d.hidden_size

    def activations(self, d: Any) -> dict[str, tuple[tuple[int, ...], str]]:
        """The VMEM activations its bodies keep (`FamilyGraph.activations`): with a latent's
        `expert_norm`, every pick's output apart, `[B, top_k * expert_io]` f32 (`picks`)."""
        if self.latent and self.latent.expert_norm:
            return {"picks": ((-1, d.top_k * self.expert_io(d)), "f32")}
        return {}

    def expert_rows(self, d: Any, tp: int = 1) -> dict[str, int]:
        """Input rows of each routed expert matrix a rank holds (its width slice of `tp`)."""
        return {"gate_up": self.expert_io(d), "down": self.expert_half(d, tp)}

    def pack_groups(self, d: Any, tp: int = 1) -> dict[str, int]:
        """Input rows an expert matrix is multiplied in at a time; MXFP4 rows that the caps
        do not tile (GPT-OSS's 2880) take the groups that divide them."""
        rows = self.expert_rows(d, tp)
        if self.checkpoint.decoded_in_kernel:
            return expert_formats_lib.dividing_pack_groups(rows)
        return expert_formats_lib.pack_groups(rows)

    def expert_formats(self, d: Any, formats: Mapping[str, WeightFormat] | None = None, tp: int = 1
                       ) -> dict[str, WeightFormat]:
        """Each routed expert class's format, its block resolved to input rows
        (`mkc.layers.expert_formats.resolve`). An NVFP4 checkpoint that keeps some layers'
        experts bf16 (`bf16_expert_layers`): where those layers run as a kind of their own
        (`bf16_kind`), `nvfp4` holds every other layer's as they are and those layers keep
        bf16 experts (`bf16_layer_formats`), unless it says `rounded`; else the kernel holds one
        expert format, so `nvfp4` must say `rounded`. `rounded` requantizes those layers'
        experts to NVFP4 as the quantizer would have
        (`mkc.layers.expert_formats.weights.nvfp4_from_bf16`; `weights.requantization` reports
        the error), every other layer's held as it is; FormatError without it."""
        asked = dict(formats or {})
        rounded = self._bf16_layers_rounded(d, asked, bool(self.bf16_kind))
        asked |= {cls: dataclasses.replace(asked[cls], rounded=False) for cls in rounded}
        out = self._resolve(d, tp, self.weight_formats(d), asked)
        return out | {cls: dataclasses.replace(out[cls], rounded=True) for cls in rounded}

    def bf16_layer_formats(self, d: Any, tp: int = 1) -> dict[str, WeightFormat]:
        """The expert classes' formats in the layers an NVFP4 checkpoint keeps bf16, held in a
        kind of their own: bf16, as stored."""
        return self._resolve(d, tp, Checkpoint.BF16.formats, {})

    def _resolve(self, d: Any, tp: int, offered: tuple, asked: Mapping[str, WeightFormat]
                 ) -> dict[str, WeightFormat]:
        return expert_formats_lib.resolve(offered, self.expert_rows(d, tp), self.pack_groups(d, tp),
                                          asked, self.checkpoint_blocks(d),
                                          {"gate_up": self.expert_half(d, tp), "down": self.expert_io(d)})

    def _bf16_layers_rounded(self, d: Any, formats: Mapping[str, WeightFormat], own_kind: bool = False
                             ) -> tuple[str, ...]:
        """The `nvfp4 rounded` classes of a checkpoint with bf16 layers (`expert_formats`).
        FormatError for a format the model's checkpoint does not offer (a family that does not
        ask the model, `model_formats`), or, with bf16 layers not in a kind of their own
        (`own_kind`), an `nvfp4` class that does not say `rounded`."""
        offered = dict(self.weight_formats(d))
        for cls, fmt in formats.items():
            if cls in offered and fmt.name not in offered[cls]:
                raise FormatError(cls, f"the model's checkpoint holds {cls} as {offered[cls][0]}, "
                                  f"which the kernel takes as {', '.join(offered[cls])}, not "
                                  f"{fmt.name}", f"write `format {cls} {offered[cls][0]}` (its family "
                                  "asks the model: `model_formats=MoE.weight_formats`)")
        layers = self.bf16_expert_layers(d)
        named = ", ".join(map(str, layers))
        those = "those layers'" if len(layers) > 1 else "that layer's"
        for cls, fmt in formats.items() if layers and not own_kind else ():
            if fmt.name == "nvfp4" and not fmt.rounded:
                raise FormatError(
                    cls, f"the checkpoint's routed experts are NVFP4 but for layer{'s' * (len(layers) > 1)} "
                    f"{named}, which its quantization keeps bf16, and the kernel holds one expert "
                    f"format: `nvfp4` would requantize {those} "
                    "experts", f"write `format {cls} nvfp4 rounded` (layers {named}' experts "
                    "requantized to NVFP4, the error reported per matrix class; the others held as "
                    f"they are), or serve the model's bf16 checkpoint (`format {cls} int4 block "
                    f"{expert_formats_lib.INT4_BLOCK} rounded`)")
        return tuple(cls for cls, fmt in formats.items() if layers and fmt.name == "nvfp4" and fmt.rounded)

    def expert_tensors(self, d: Any, formats: Mapping[str, WeightFormat], tp: int = 1) -> dict[str, Tensor]:
        """One routed expert's width slice as its slot holds it, K-major ([in, out]), each
        matrix in its format, with its bias rows (bf16, the checkpoint's dtype) after the
        matrix."""
        H, half = self.expert_io(d), self.expert_half(d, tp)
        out: dict[str, Tensor] = {}
        for name, rows, cols, width in (("gate_up", H, 2 * half, half), ("down", half, H, H)):
            out |= expert_formats_lib.tensors(name, rows, cols, formats[f"expert.{name}"], width)
            if self.expert_bias:
                out[f"{name}_bias"] = Tensor(f"{name}_bias", "matrix", (1, cols), "bf16")
        return out

    def graph_fields(self, d: Any, formats: Mapping[str, WeightFormat] | None, tp: int = 1
                     ) -> dict[str, Any]:
        """The `FamilyGraph` fields of a family with this kind: one routed expert's tensors (a
        rank's width slice of `tp`), the model's experts and picks, the expert classes'
        resolved formats; where the layers an NVFP4 checkpoint keeps bf16 run as `bf16_kind`
        and no `rounded` format requantizes them, that kind's experts bf16 as stored
        (`FamilyGraph.kind_experts`)."""
        resolved = self.expert_formats(d, formats, tp)
        out = dict(experts=self.expert_tensors(d, resolved, tp), experts_total=d.experts, top_k=d.top_k,
                   formats=resolved)
        if self.holds_bf16_layers(d, resolved):
            own = self.bf16_layer_formats(d, tp)
            out |= dict(kind_experts={self.bf16_kind: self.expert_tensors(d, own, tp)},
                        kind_formats={self.bf16_kind: own})
        return out

    def holds_bf16_layers(self, d: Any, resolved: Mapping[str, WeightFormat]) -> bool:
        """Whether the layers an NVFP4 checkpoint keeps bf16 hold their experts so (in
        `bf16_kind`): no `rounded` expert format requantizes them."""
        return bool(self.bf16_kind and self.bf16_expert_layers(d)
                    and not any(f.rounded for c, f in resolved.items() if c.startswith("expert.")))

    def layer_formats(self, d: Any, prefix: str, formats: Mapping[str, WeightFormat] | None,
                      tp: int = 1) -> dict[str, WeightFormat]:
        """The expert classes' formats in the layer under `prefix`: bf16 where it is one an
        NVFP4 checkpoint keeps bf16 and holds so (`holds_bf16_layers`), else `expert_formats`."""
        resolved = self.expert_formats(d, formats, tp)
        if self.layer_checkpoint(d, prefix) is Checkpoint.BF16 and self.holds_bf16_layers(d, resolved):
            return self.bf16_layer_formats(d, tp)
        return resolved


def expert_split(rules: Mapping[str, tuple[int, int]], ranks: int, family: str) -> dict[str, int]:
    """The ways routed experts split, {"experts": EP, "expert_mlp": TP}: experts over groups
    of TP consecutive ranks (`shard experts over tp / TP`), each expert's width over a group
    (`shard expert_mlp over TP`), tiling the ranks; ShardingError otherwise."""
    (ep, ep_stride), (tp, tp_stride) = rules["experts"], rules.get("expert_mlp", (1, ranks))
    if ep * tp != ranks or ep_stride != tp or (tp > 1 and tp_stride != 1):
        raise ShardingError(
            f"the {family} lowering splits routed experts over groups and each expert's width "
            f"within a group, tiling the {ranks} ranks: write `shard experts over tp` (whole "
            "experts on every core) or `shard experts over tp / N` with `shard expert_mlp over N`",
            "experts")
    return {"experts": ep, "expert_mlp": tp}


def expert_ways(rules: Mapping[str, tuple[int, int]], ranks: int, family: str) -> int:
    """The ways routed experts split: every core, the one sharding the lowering computes;
    ShardingError otherwise."""
    if tuple(rules["experts"]) != (ranks, 1):
        raise ShardingError(f"the {family} lowering splits experts over every core: write "
                            "`shard experts over tp`", "experts")
    return ranks
