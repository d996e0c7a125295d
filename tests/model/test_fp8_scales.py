"""FP8 block scales handed to packing as arrays (a module's `place_weights(hf)` of a dict, not a
checkpoint the loader read): checked where packing reads them, as the loader checks stored ones."""
import ml_dtypes
import numpy as np
import pytest

from mkc.families.deepseek_v3 import reference as ref
from mkc.ir import WeightFormat
from mkc.layers.expert_formats.weights import fp8_checkpoint_blocks
from mkc.layers.moe.weights import expert_slice
from mkc.model import fp8_blocks
from mkc.model.config import CONFIG_DIR

MINI = ref.load_config(CONFIG_DIR / "deepseek_v3_mini_fp8.json")
BLOCKS = WeightFormat("fp8", 128, cols=128)


@pytest.fixture(scope="module")
def hf():
    return ref.init_params(MINI, seed=0)


@pytest.mark.parametrize("value", [3e38, -1.0, 0.0, 1e-45, np.nan])
def test_a_bad_scale_is_refused_where_packing_reads_it(hf, value):
    """A dense FP8 weight read through `Dequantized` and an expert's packed into its slot:
    a scale out of the format's range is a ValueError naming the index (a 3e38 scale packed
    16,235 infinities)."""
    dense = "model.layers.0.self_attn.q_a_proj.weight"
    scales = hf[dense + "_scale_inv"].copy()
    scales[0, 1] = value
    view = fp8_blocks.Dequantized({dense: hf[dense], dense + "_scale_inv": scales}, MINI.weight_block_size)
    with pytest.raises(ValueError, match=r"1 block scale\(s\) outside .* at index \[0, 1\]"):
        np.asarray(view[dense])
    stored = "model.layers.1.mlp.experts.down_proj"
    bad = hf[stored + "_scale_inv"][3].copy()
    bad[0, 0] = value
    out_index, in_index, width = expert_slice(MINI, "down", 0, 8)
    with pytest.raises(ValueError, match=r"an FP8 expert matrix: 1 block scale\(s\) outside"):
        fp8_checkpoint_blocks(hf[stored][3], bad, out_index, in_index, BLOCKS, width)


def test_a_scale_that_is_not_f32_is_refused_where_packing_reads_it(hf):
    dense = "model.layers.0.self_attn.o_proj.weight"
    scales = hf[dense + "_scale_inv"].astype(ml_dtypes.bfloat16)
    view = fp8_blocks.Dequantized({dense: hf[dense], dense + "_scale_inv": scales}, MINI.weight_block_size)
    with pytest.raises(ValueError, match="block scales of dtype bfloat16, expected float32"):
        np.asarray(view[dense])
    assert np.isfinite(np.asarray(fp8_blocks.Dequantized(hf, MINI.weight_block_size)[dense],
                                  np.float32)).all()
