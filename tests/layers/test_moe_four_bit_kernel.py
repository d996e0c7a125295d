"""The int4 and NVFP4 expert formats through the library MoE: the toy family of Muse Spark's
MoE options (`test_moe_muse_spark_kernel`: every rank a width slice of every expert) with its
experts `int4 block 64 rounded` requantized from its bf16 checkpoint, or held as an NVFP4
checkpoint holds them (a dims field `expert_checkpoint` "nvfp4": its config says so, as Muse
Spark's `-NVFP4`). Its experts' width is 512 (64 rows a rank: a block, a pack group). Quick:
compiled, the slots' tensors in the format; compiled from a checkpoint directory, what packing
does reported (int4 rounded, NVFP4 exact); an NVFP4 checkpoint with a bf16 layer refused
unless `nvfp4 rounded`. Extended: the kernel in TPU interpret mode bit-equal to the rounding
emulation, a 1 % mutant of each decode (the kernel's, not the emulation's) rejected by the
same run; the bf16 layer requantized to NVFP4 likewise bit-equal."""
from __future__ import annotations

from pathlib import Path

import pytest

from mkc import compiler
from mkc.diagnostics import MkcError
from test_moe_muse_spark_kernel import FAMILY, MOE_DIMS
from toy_family import registered, run_mini, write_family

# The toy's dims with the expert checkpoint's fields (`MoE.expert_checkpoint`,
# `MoE.bf16_expert_layers`), its formats asked of the model (`model_formats`).
INIT = FAMILY["__init__.py"].replace(
    '''EXTRA = ("moe_hidden_size", "post_norm_eps", "output_multiplier", "routed_scaling_factor")''',
    '''EXTRA = ("moe_hidden_size", "post_norm_eps", "output_multiplier", "routed_scaling_factor")
        from toy_msmoe.graph import MOE''').replace(
    '''            routed_scaling_factor: float
''', '''            routed_scaling_factor: float
            expert_checkpoint: str = ""
            expert_checkpoint_bf16_layers: tuple[int, ...] = ()
''').replace(
    '''            return ToyDims(**fields | {"family": "toy_msmoe"} | extra)''',
    '''            bf16 = tuple(raw.get("expert_checkpoint_bf16_layers", ()))
            return ToyDims(**fields | {"family": "toy_msmoe"} | extra, expert_checkpoint_bf16_layers=bf16,
                           expert_checkpoint=str(raw.get("expert_checkpoint", "")))''').replace(
    "weight_formats=WEIGHT_FORMATS,", "weight_formats=WEIGHT_FORMATS, model_formats=MOE.weight_formats,")
assert INIT.count("MOE") == 2 and INIT.count("expert_checkpoint_bf16_layers") == 3
FOUR_BIT_FAMILY = FAMILY | {"__init__.py": INIT}
WIDTH = {"moe_intermediate_size": 512}

# The kernel's decodes a run's mutants scale by 1.01 (`run_mini`'s `patch`): the emulation
# multiplies by numpy's scales and the kernel's own dots at one or two rows, so each changes
# the kernel alone.
MUTANTS = {
    "int4.scales": "from mkc.layers.expert_formats import ops\n_real = ops.bf16_block_scales\n"
                   "ops.bf16_block_scales = lambda s: _real(s) * 1.01\n",
    "int4.dot": "from mkc.layers.expert_formats import ops\n_real = ops.int4_dot\n"
                "ops.int4_dot = lambda x, c: _real(x, c) * 1.01\n",
    "nvfp4.global_scale": "from mkc.layers.expert_formats import ops\n_real = ops.nvfp4_global_scale\n"
                          "ops.nvfp4_global_scale = lambda s: _real(s) * 1.01\n",
    # past two rows the kernel decodes the values (the emulation: numpy's decode)
    "nvfp4.values": "from mkc.layers.expert_formats import ops\n_real = ops.nvfp4_values\n"
                    "ops.nvfp4_values = lambda c, s: _real(c, s) * 1.01\n",
}


# `test_moe_muse_spark_kernel`'s spec edits: every rank a width slice of every expert, the
# latent projections split and gathered
SPEC_EDITS = (
    ("shard experts over tp\n", "shard experts over tp / 8\n  shard expert_mlp over 8\n"
     "  shard latent_down over tp\n  shard latent_up over tp\n"),
    ("    moe: router\n", "    moe: router, latent_down, latent_up\n"),
    ("    allreduce routed_experts direct wire bf16\n",
     "    allgather latent_down over tp\n    allreduce routed_experts direct wire bf16\n"
     "    allgather latent_up over tp\n"))
BF16 = "  format expert.gate_up bf16\n  format expert.down bf16\n"


def _spec(tmp_path: Path, changes: dict, fmt: str) -> Path:
    """The toy family's MINI spec with experts 512 wide and `format expert.* FMT`."""
    lines = f"  format expert.gate_up {fmt}\n  format expert.down {fmt}\n"
    return write_family(tmp_path, "toy_msmoe", FOUR_BIT_FAMILY, "qwen3_moe_mini", "qwen3_30b_a3b",
                        MOE_DIMS | WIDTH | changes, (*SPEC_EDITS, (BF16, lines)), scratch_of="qwen3_moe")


@pytest.fixture
def int4_toy(tmp_path, monkeypatch) -> Path:
    yield from registered(monkeypatch, tmp_path, "toy_msmoe", _spec(tmp_path, {}, "int4 block 64 rounded"))


@pytest.fixture
def nvfp4_toy(tmp_path, monkeypatch) -> Path:
    spec = _spec(tmp_path, {"expert_checkpoint": "nvfp4"}, "nvfp4")
    yield from registered(monkeypatch, tmp_path, "toy_msmoe", spec)


def test_int4_experts_compile(int4_toy):
    c = compiler.compile_spec(int4_toy)
    formats = c.ir.weight_formats
    assert formats["expert.gate_up"].spelled == formats["expert.down"].spelled == "int4 block 64 rounded"
    # a rank's slice: gate|up 128 latent rows x 2 x 64 columns, down 64 rows x 128; two rows a
    # byte, a bf16 scale (two byte rows) per 64 rows
    assert c.ir.experts == {"gate_up_codes": ((64, 128), "u8"), "gate_up_scales": ((4, 128), "u8"),
                            "down_codes": ((32, 128), "u8"), "down_scales": ((2, 128), "u8")}


def test_nvfp4_experts_compile(nvfp4_toy):
    c = compiler.compile_spec(nvfp4_toy)
    assert {cls: f.spelled for cls, f in c.ir.weight_formats.items()} == {
        "expert.gate_up": "nvfp4 block 16", "expert.down": "nvfp4 block 16"}
    # an e4m3 scale row per 16 rows, then the four byte rows of each column's global scale
    assert c.ir.experts == {"gate_up_codes": ((64, 128), "u8"), "gate_up_scales": ((8 + 4, 128), "u8"),
                            "down_codes": ((32, 128), "u8"), "down_scales": ((4 + 4, 128), "u8")}


def test_an_nvfp4_checkpoints_bf16_layers_take_nvfp4_only_rounded(tmp_path, monkeypatch):
    """Layer 0's experts bf16 in the NVFP4 checkpoint (its quantization excludes them): `nvfp4`
    is refused naming the layer and the way on; `nvfp4 rounded` compiles."""
    changes = {"expert_checkpoint": "nvfp4", "expert_checkpoint_bf16_layers": [0]}
    refused = _spec(tmp_path / "exact", changes, "nvfp4")
    rounded = _spec(tmp_path / "rounded", changes, "nvfp4 rounded")
    for _ in registered(monkeypatch, tmp_path / "exact", "toy_msmoe", None):
        with pytest.raises(MkcError) as e:
            compiler.compile_spec(refused)
        assert "layer 0, which its quantization keeps bf16" in str(e.value)
        assert "write `format expert.gate_up nvfp4 rounded`" in e.value.diagnostics[0].hint
    for _ in registered(monkeypatch, tmp_path / "rounded", "toy_msmoe", None):
        formats = compiler.compile_spec(rounded).ir.weight_formats
        assert formats["expert.down"].spelled == "nvfp4 block 16 rounded"


@pytest.mark.extended
def test_int4_kernel_equals_its_emulation_and_rejects_decode_mutants(int4_toy):
    run_mini(int4_toy, "toy_msmoe", "--steps", "2", "--batch", "2", timeout=3000)
    for name in ("int4.scales", "int4.dot"):
        run_mini(int4_toy, "toy_msmoe", "--steps", "1", "--batch", "2", patch=MUTANTS[name], rejected=True,
                 timeout=3000)


@pytest.mark.extended
@pytest.mark.parametrize("batch, mutant", [("2", "nvfp4.global_scale"), ("4", "nvfp4.values")])
def test_nvfp4_kernel_equals_its_emulation_and_rejects_decode_mutants(nvfp4_toy, batch, mutant):
    """At two rows the kernel feeds the codes to the MXU, at four it decodes them."""
    run_mini(nvfp4_toy, "toy_msmoe", "--steps", "2", "--batch", batch, timeout=3000)
    run_mini(nvfp4_toy, "toy_msmoe", "--steps", "1", "--batch", batch, patch=MUTANTS[mutant], rejected=True,
             timeout=3000)


@pytest.mark.extended
def test_an_nvfp4_checkpoint_with_a_bf16_layer_runs_requantized(tmp_path, monkeypatch):
    """Layer 0's experts bf16 (drawn so: its param shapes), `nvfp4 rounded`: packing and the
    references hold them requantized to NVFP4 alike, the error reported; the kernel bit-equal
    to the emulation."""
    changes = {"expert_checkpoint": "nvfp4", "expert_checkpoint_bf16_layers": [0]}
    spec = _spec(tmp_path, changes, "nvfp4 rounded")
    for _ in registered(monkeypatch, tmp_path, "toy_msmoe", None):
        summary = run_mini(spec, "toy_msmoe", "--steps", "2", "--batch", "2", timeout=3000)
    report = summary["requantization"]["expert.gate_up"]
    assert report["format"] == "nvfp4 block 16 rounded" and 0 < report["changed"] <= report["values"]


@pytest.mark.parametrize("changes, fmt, exact", [({}, "int4 block 64 rounded", False),
                                                 ({"expert_checkpoint": "nvfp4"}, "nvfp4 block 16", True)])
def test_compiling_from_a_checkpoint_reports_what_packing_does(tmp_path, monkeypatch, changes, fmt,
                                                               exact):
    """`mkc compile --model CHECKPOINT_DIR` (`mkc.requantize.report`): int4 measured against the
    checkpoint's values, rounded; NVFP4 held as it is, no class requantized."""
    import json

    from mkc.checkpoint import save_checkpoint
    from mkc.requantize import report
    spec = _spec(tmp_path, changes, fmt)
    for _ in registered(monkeypatch, tmp_path, "toy_msmoe", None):
        import toy_msmoe.reference as reference
        config = json.loads((tmp_path / "toy_mini.json").read_text())
        params = reference.init_params(reference.load_config(config), 0)
        save_checkpoint(tmp_path / "checkpoint", config, params)
        c = compiler.compile_spec(spec, str(tmp_path / "checkpoint"))
        measured = report(c.ir, c.schedule)
    for cls in ("expert.gate_up", "expert.down"):
        if exact:
            assert cls not in measured
        else:
            assert measured[cls]["measured"] and not measured[cls]["exact"]
            assert measured[cls]["format"] == fmt and measured[cls]["changed"] > 0
