"""The GPT-OSS config reader (mkc.families.gpt_oss.config, through the reference's
load_config): the published facts of the shipped configs, the MINI's layer pattern, the settings
it refuses, and `mkc check` refusing a context past the window without the KV ring."""
from __future__ import annotations

import json
import math
import re

import pytest

from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from mkc.families.gpt_oss import reference as ref
from mkc.model.config import CONFIG_DIR
from tests_support import ROOT

MINI_RAW = json.loads((CONFIG_DIR / "gpt_oss_mini.json").read_text())
MINI = ref.load_config(MINI_RAW)


# ---- the shipped configs ------------------------------------------------------------------------


@pytest.mark.parametrize("name,layers,experts,total,active", [
    ("gpt_oss_120b", 36, 128, 116.83e9, 5.13e9), ("gpt_oss_20b", 24, 32, 20.91e9, 3.61e9)])
def test_shipped_configs_hold_the_published_facts(name, layers, experts, total, active):
    """The published config.json values, and the parameter counts of the gpt-oss model card
    (total; active: the routed experts a token picks, the lm_head, not the embedding), counted
    from the weights table with two values a MXFP4 byte."""
    c = ref.load_config(CONFIG_DIR / f"{name}.json")
    assert (c.num_hidden_layers, c.experts, c.top_k) == (layers, experts, 4)
    assert (c.hidden_size, c.intermediate_size, c.vocab_size) == (2880, 2880, 201088)
    assert (c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (64, 8, 64)
    assert (c.sliding_window, c.rms_norm_eps, c.swiglu_alpha, c.swiglu_limit) == (128, 1e-5, 1.702, 7.0)
    assert c.attention_types == ("sliding_attention", "full_attention") * (layers // 2)
    assert (c.rope_theta, c.yarn_factor) == (150000.0, 32.0)
    # ramp bounds D ln(4096 / (2 pi beta)) / (2 ln theta) for beta 32 and 1, not truncated
    assert c.yarn_low == pytest.approx(8.0928, abs=1e-4) and c.yarn_high == pytest.approx(17.3980, abs=1e-4)
    assert c.yarn_attention_factor == pytest.approx(1 + 0.1 * math.log(32))
    counts = {"total": 0, "active": 0}
    for tensor, (shape, _) in ref.param_shapes(c).items():
        n = math.prod(shape) * (2 if tensor.endswith("_blocks") else 0 if tensor.endswith("_scales") else 1)
        counts["total"] += n
        counts["active"] += (n // experts * 4 if ".experts." in tensor
                             else 0 if tensor == "model.embed_tokens.weight" else n)
    assert counts["total"] == pytest.approx(total, abs=0.005e9)     # as the card rounds
    assert counts["active"] == pytest.approx(active, abs=0.005e9)


def test_mini_has_both_layer_types_and_both_transitions():
    assert MINI.attention_types == ("sliding_attention", "full_attention") * 2
    assert MINI.layer_kinds == ("swa", "moe", "gqa", "moe") * 2
    # the window of the 20b and 120b (128): the shipped specs' context of 128 runs the MINI
    # within it, the longest a sliding layer computes until its KV ring is built
    assert MINI.sliding_window == 128 and (MINI.experts, MINI.top_k) == (8, 2)


@pytest.mark.parametrize("edit,words", [
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, "chunked_attention"),
    ({"layer_types": ["sliding_attention"] * 3}, "3 entries"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_type"),
    ({"attention_bias": False}, "attention_bias"),
    ({"sliding_window": None}, "sliding_window"),
    ({"quantization_config": None}, "MXFP4"),
    ({"intermediate_size": 100}, "multiple of 32"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
])
def test_unsupported_settings_are_refused(edit, words):
    with pytest.raises(ValueError, match=words):
        ref.load_config(MINI_RAW | edit)


def test_truncate_floors_and_ceils_the_ramp_bounds():
    rope = MINI_RAW["rope_scaling"] | {"truncate": True}
    c = ref.load_config(MINI_RAW | {"rope_scaling": rope})
    assert (c.yarn_low, c.yarn_high) == (8.0, 18.0)


def test_mkc_check_refuses_a_context_past_the_window_without_the_ring_at_its_context_line(tmp_path):
    """Without its KV ring a sliding layer's cache is the per-token cache of the context, which
    computes upstream's window only while the context is within it: a spec with a longer
    context and no `kv ring` is refused at its `context` line, the hint naming the ring; the
    shipped spec (context 4096, its swa phase's ring declared) checks, for its model and the
    MINI, and so does a context of the window without the ring."""
    shipped = ROOT / "schedules" / "gpt_oss_20b.sched"
    for model in (None, "gpt_oss_mini"):
        check_spec(shipped, model)
    text = shipped.read_text()
    assert text.count("    kv ring 256 slots\n") == 1
    no_ring = text.replace("    kv ring 256 slots\n", "")
    spec = tmp_path / "gpt_oss_no_ring.sched"
    spec.write_text(no_ring)
    with pytest.raises(MkcError) as e:
        check_spec(spec)
    (d,) = e.value.diagnostics
    line = no_ring[:no_ring.index("context 4096")].count("\n") + 1
    assert (d.code, d.span.file, d.span.line) == ("E-CONTEXT", str(spec), line)
    assert "swa" in d.message and "128" in d.message
    assert "kv ring" in d.hint
    within, n = re.subn(r"^(\s*context\s+)4096\b", r"\g<1>128", no_ring, count=1, flags=re.M)
    # one 128-token tile is the whole context: none starts ahead of it
    within, tiles = re.subn(r"(kv tiles \d+ slots of 128 tokens) ahead 2", r"\1 ahead 1", within)
    assert n == 1 and tiles == 2
    spec.write_text(within)
    check_spec(spec)
