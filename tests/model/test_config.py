"""Model configs: strict JSON of bounded size, every dimension in range, every constant finite."""
import json

import pytest

from mkc.diagnostics import MkcError
from mkc.model.config import CONFIG_DIR, MAX_CONFIG_BYTES, load_dims

QWEN = json.loads((CONFIG_DIR / "qwen3_8_mini.json").read_text())
K3 = json.loads((CONFIG_DIR / "kimi_k3_mini.json").read_text())
MUSE = json.loads((CONFIG_DIR / "muse_spark_mini_nvfp4.json").read_text())


def _load(tmp_path, text: str):
    path = tmp_path / "config.json"
    path.write_text(text)
    return load_dims(path)


def _rejects(tmp_path, text: str, words: str) -> None:
    with pytest.raises(MkcError) as e:
        _load(tmp_path, text)
    (d,) = e.value.diagnostics
    assert d.code == "E-MODEL" and words in d.message and d.hint, d


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_constants_are_rejected(tmp_path, value):
    text = json.dumps(QWEN).replace('"rms_norm_eps": 1e-06', f'"rms_norm_eps": {value}')
    assert value in text
    _rejects(tmp_path, text, f"{value} is not a number")


@pytest.mark.parametrize("config,key,value,words", [
    (QWEN, "rms_norm_eps", 0.0, "rms_norm_eps = 0.0 is out of range"),
    (QWEN, "rms_norm_eps", 1e400, "rms_norm_eps = inf"),           # overflows to inf in Python
    (QWEN, "hidden_size", -256, "hidden_size = -256"),
    (QWEN, "hidden_size", 10**30, "hidden_size"),
    (QWEN, "num_hidden_layers", 10**9, "num_hidden_layers = 1000000000 is out of range"),
    (QWEN, "num_hidden_layers", True, "num_hidden_layers = true is out of range"),
    (K3, "num_experts_per_token", 64, "top-k 64 exceeds the 32 experts"),
    (K3, "activation_situ_beta", -1.0, "situ_beta = -1.0"),
    # finite, but the model's math overflows (they loaded): an epsilon from 1 up, a constant
    # past 2**64
    (QWEN, "rms_norm_eps", 1e308, "rms_norm_eps = 1e+308 is out of range"),
    (QWEN, "rms_norm_eps", 1.0, "rms_norm_eps = 1.0 is out of range"),
    (MUSE, "post_norm_eps", 2.0, "post_norm_eps = 2.0 is out of range"),
    (MUSE, "final_logit_softcapping", 1e308, "final_logit_softcapping = 1e+308 is out of range"),
    (MUSE, "qk_scale_factor", 1e308, "qk_scale_factor = 1e+308 is out of range"),
])
def test_out_of_range_values_are_rejected(tmp_path, config, key, value, words):
    text = json.dumps(config | {key: value}) if value != 1e400 else (
        json.dumps(config).replace('"rms_norm_eps": 1e-06', '"rms_norm_eps": 1e400'))
    _rejects(tmp_path, text, words)


MOE = json.loads((CONFIG_DIR / "qwen3_5_moe_mini.json").read_text())


@pytest.mark.parametrize("config,change,words", [
    (K3, {"num_experts": 10**6}, "experts = 1000000 is out of range"),
    # each factor in range, their product (the weight table's expert tensors) not
    (MOE, {"num_experts": 16384, "num_hidden_layers": 20, "layer_types": MOE["layer_types"] * 5},
     "20 layers of 16384 routed experts are 327680 expert-layers"),
])
def test_expert_counts_are_bounded_before_any_table_is_built(tmp_path, config, change, words):
    _rejects(tmp_path, json.dumps(config | change), words)


def test_the_bounds_say_why(tmp_path):
    with pytest.raises(MkcError) as e:
        _load(tmp_path, json.dumps(QWEN | {"rms_norm_eps": 1.0}))
    assert "must lie between 0 and 1" in e.value.diagnostics[0].hint
    with pytest.raises(MkcError) as e:
        _load(tmp_path, json.dumps(MUSE | {"final_logit_softcapping": 1e20}))
    assert "at most 2**64 (1.845e+19): past it, its products with f32 values overflow" in \
        e.value.diagnostics[0].hint
    # a constant of any sign is bounded too
    floor = K3["linear_attn_config"] | {"gate_lower_bound": -1e300}
    _rejects(tmp_path, json.dumps(K3 | {"linear_attn_config": floor}),
             "gate_lower_bound = -1e+300 is out of range")


def test_a_key_the_reader_needs_is_named_when_missing(tmp_path):
    """A Kimi config without hidden_size answered with Python's text ("unusable config
    ('hidden_size')" from the checkpoint loader)."""
    from mkc.checkpoint import CheckpointError, _read_config
    config = {k: v for k, v in K3.items() if k != "hidden_size"}
    _rejects(tmp_path, json.dumps(config), "hidden_size is missing")
    with pytest.raises(CheckpointError, match=r"unusable config \(hidden_size is missing\)") as e:
        _read_config(tmp_path)
    assert e.value.hint.startswith('write "hidden_size" as the model\'s upstream config.json does')


@pytest.mark.parametrize("exclude, words", [
    ([5], "quantization_config exclude_modules = [5]: 5 is not a module name"),
    (["lm_head", None], 'exclude_modules = ["lm_head", null]: null is not a module name'),
    ("lm_head", 'exclude_modules = "lm_head": not a list'),
])
def test_nvfp4_exclusions_must_be_module_names(tmp_path, exclude, words):
    """`[5]` answered "object of type 'int' has no len()"; a string was read letter by letter."""
    quant = MUSE["quantization_config"] | {"exclude_modules": exclude}
    _rejects(tmp_path, json.dumps(MUSE | {"quantization_config": quant}), words)


def test_k3_gate_floor_may_be_negative(tmp_path):
    assert _load(tmp_path, json.dumps(K3)).gate_lower_bound == -5.0


@pytest.mark.parametrize("text,words", [
    ("[1, 2]", "not a JSON object"),
    ("[" * 100000 + "]" * 100000, "cannot read"),
    ('{"model_type": "qwen3_5_text"', "cannot read"),
    (" " * (MAX_CONFIG_BYTES + 1), "larger than"),
])
def test_malformed_files_are_rejected(tmp_path, text, words):
    _rejects(tmp_path, text, words)


def test_devices_and_directories_are_not_configs(tmp_path):
    from pathlib import Path
    for path in (Path("/dev/zero"), tmp_path):
        with pytest.raises(MkcError) as e:
            load_dims(path)
        assert "not a regular file" in e.value.diagnostics[0].message


@pytest.mark.parametrize("mla_layers,words", [([], "has no mla layer"), ([1, 2, 3, 4, 5, 6, 7],
                                              "has no kda layer"), ([0, 4], "1-based")])
def test_k3_needs_both_attention_kinds_at_real_layers(tmp_path, mla_layers, words):
    config = json.loads(json.dumps(K3))
    config["linear_attn_config"]["full_attn_layers"] = mla_layers
    _rejects(tmp_path, json.dumps(config), words)


def test_overflowing_integer_is_rejected(tmp_path):
    text = json.dumps(QWEN).replace('"intermediate_size": 1024', '"intermediate_size": -1e400')
    _rejects(tmp_path, text, "intermediate_size = -Infinity is not a whole number")


MINIS = ["qwen3_8_mini", "qwen3_5_moe_mini", "gpt_oss_mini", "kimi_k3_mini"]


def _numeric_keys(config: dict) -> list[tuple[str, ...]]:
    """Paths of the config's numbers (not booleans), at the top level and one object deep."""
    paths = []
    for key, value in config.items():
        if isinstance(value, dict):
            paths += [(key, k) for k, v in value.items() if type(v) in (int, float)]
        elif type(value) in (int, float):
            paths.append((key,))
    return paths


@pytest.mark.parametrize("name", MINIS)
@pytest.mark.parametrize("value", [True, False, "4096"])
def test_a_number_key_never_reads_a_boolean_or_text_as_a_number(tmp_path, name, value):
    """JSON `true` is an int to Python (int(True) == 1) and int() reads "4096": a key mkc reads
    as a number refuses both, naming the key; a key it does not read changes nothing."""
    config = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    plain = _load(tmp_path, json.dumps(config))
    for path in _numeric_keys(config):
        changed = json.loads(json.dumps(config))
        parent = changed if len(path) == 1 else changed[path[0]]
        parent[path[-1]] = value
        try:
            dims = _load(tmp_path, json.dumps(changed))
        except MkcError as e:
            (d,) = e.diagnostics
            assert d.code == "E-MODEL" and path[-1] in d.message and d.hint, (path, d)
        else:
            assert dims == plain, f"{'.'.join(path)} = {value!r} was read as a number"


def test_hidden_size_true_is_refused_by_name(tmp_path):
    _rejects(tmp_path, json.dumps(QWEN | {"hidden_size": True}), "hidden_size = true is not a whole number")
    _rejects(tmp_path, json.dumps(QWEN | {"hidden_size": 256.5}), "hidden_size = 256.5 is not a whole number")
    _rejects(tmp_path, json.dumps(QWEN | {"rms_norm_eps": "1e-6"}), 'rms_norm_eps = "1e-6" is not a number')


def test_a_zero_in_a_config_formula_is_a_diagnostic_not_a_traceback(tmp_path):
    """GPT-OSS's YaRN divides by log(rope_theta); Qwen3.5's layer pattern by the interval."""
    gpt = json.loads((CONFIG_DIR / "gpt_oss_mini.json").read_text())
    _rejects(tmp_path, json.dumps(gpt | {"rope_theta": 1}), "rope_theta = 1.0 is out of range for YaRN")
    pattern_only = {k: v for k, v in QWEN.items() if k != "layer_types"}
    _rejects(tmp_path, json.dumps(pattern_only | {"full_attention_interval": 0}),
             "full_attention_interval = 0 must be at least 1")


def _reference(name: str):
    from mkc.checkpoint import family_of
    config = json.loads((CONFIG_DIR / f"{name}.json").read_text())
    return config, family_of(config).module("reference")


@pytest.mark.parametrize("name", ["deepseek_v3_mini", "qwen3_8_mini", "kimi_k3_mini", "gpt_oss_mini"])
def test_a_billion_layers_is_refused_before_anything_is_built_on_every_path(tmp_path, name):
    """`num_hidden_layers: 10**9` was a MemoryError through a reference's load_config (so
    load_checkpoint and `mkc serve --draft-model`), DeepSeek-V3 first growing to 5.5 GB; the
    bound is the config reader's, so `mkc check`, the references and the loader refuse it
    alike, a composite config's text_config too."""
    import resource

    from mkc.checkpoint import CheckpointError, load_checkpoint
    from mkc.model.family import ConfigError
    config, ref = _reference(name)
    start = resource.getrusage(resource.RUSAGE_SELF).ru_utime
    for bad in (config | {"num_hidden_layers": 10**9},
                {"model_type": "wrapper", "text_config": config | {"num_hidden_layers": 10**9}}):
        with pytest.raises(ConfigError, match=r"num_hidden_layers = 1000000000 is out of range"):
            ref.load_config(bad)
    _rejects(tmp_path, json.dumps(config | {"num_hidden_layers": 10**9}), "num_hidden_layers = 1000000000")
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config | {"num_hidden_layers": 10**9}))
    with pytest.raises(CheckpointError, match=r"num_hidden_layers = 1000000000 is out of range"):
        load_checkpoint(tmp_path / "ckpt")
    assert resource.getrusage(resource.RUSAGE_SELF).ru_utime - start < 5   # CPU seconds, not a build


@pytest.mark.parametrize("change, words", [
    ({"n_group": 0}, "n_group 0"),
    ({"n_group": -2}, "n_group -2"),
    ({"topk_group": 0}, "topk_group 0"),
])
def test_a_zero_divisor_of_deepseek_v3_is_a_config_error_on_every_path(tmp_path, change, words):
    """`n_group: 0` was a ZeroDivisionError traceback through load_checkpoint and a draft model."""
    from mkc.checkpoint import CheckpointError, load_checkpoint
    from mkc.model.family import ConfigError
    config, ref = _reference("deepseek_v3_mini")
    with pytest.raises(ConfigError, match=words):
        ref.load_config(config | change)
    _rejects(tmp_path, json.dumps(config | change), words)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(config | change))
    with pytest.raises(CheckpointError, match=words):
        load_checkpoint(tmp_path / "ckpt")


def test_an_arithmetic_failure_in_a_config_reader_is_a_config_error():
    """The net under every family's own checks: a reader that divides by a zero it did not
    check names the failure as a config problem, not a traceback."""
    from mkc.model.config import read_checked_dims
    from mkc.model.family import ConfigError
    with pytest.raises(ConfigError, match="cannot be computed"):
        read_checked_dims(lambda raw, name: 1 // raw["n"], {"n": 0}, "m")


@pytest.mark.parametrize("name, key, alias", [
    ("qwen3_moe_mini", "num_experts", "num_local_experts"),
    ("deepseek_v3_mini", "n_routed_experts", "num_local_experts"),
    ("gpt_oss_mini", "num_local_experts", "num_experts"),
    ("kimi_k3_mini", "num_experts", "num_local_experts"),
    ("kimi_k3_mini", "num_experts_per_token", "num_experts_per_tok"),
])
def test_a_key_transformers_writes_under_its_attribute_map_name_is_read(tmp_path, name, key, alias):
    """transformers' save_pretrained writes a config class's `attribute_map` names: a Qwen3-MoE
    config.json names its expert count `num_local_experts`, which mkc did not read (it took the
    default 128 and failed later on tensor shapes). Either name reads the same dims; both,
    disagreeing, are refused."""
    config, ref = _reference(name)
    renamed = {k: v for k, v in config.items() if k != key} | {alias: config[key]}
    want = _load(tmp_path, json.dumps(config))
    assert _load(tmp_path, json.dumps(renamed)) == want
    assert ref.load_config(renamed) == ref.load_config(config)
    _rejects(tmp_path, json.dumps(config | {alias: config[key] * 2}),
             f"{alias} = {config[key] * 2} and {key}")


def test_an_eos_token_outside_the_vocabulary_is_refused_by_check_and_run_mini(tmp_path, capsys):
    """`mkc serve` refused a config whose eos_token_id is no token of its vocabulary (it would
    never end a generation), but `mkc check` and examples/run_mini.py took it: the config
    reader refuses it now, at the spec's `model` line, for all three."""
    from mkc.cli import main
    from conftest import run_python
    from tests_support import ROOT, SPEC
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(QWEN | {"eos_token_id": [5, 99999]}))
    says = "eos_token_id [5, 99999]: 99999 is not a token id of its vocabulary (0 to 2047)"
    _rejects(tmp_path, json.dumps(QWEN | {"eos_token_id": True}), "eos_token_id true: true is not a token id")
    assert main(["check", str(SPEC), "--model", str(ckpt)]) == 1
    line = next(i for i, t in enumerate(SPEC.read_text().splitlines(), 1) if t.strip().startswith("model"))
    err = capsys.readouterr().err
    assert f"{SPEC}:{line}:" in err and "error[E-MODEL]" in err and says in err, err
    r = run_python([str(ROOT / "examples" / "run_mini.py"), "--checkpoint", str(ckpt)], timeout=300)
    assert r.returncode == 1 and says in r.stderr and "error[E-MODEL]" in r.stderr, r.stderr[-2000:]
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("change, words", [({"num_hidden_layers": 10**9}, "num_hidden_layers = 1000000000"),
                                           ({"n_group": 0}, "n_group 0")])
def test_a_draft_model_s_config_is_bounded_before_it_is_built(tmp_path, change, words):
    """`mkc serve --draft-model` reads its model through a reference's load_config (a config
    name or file) or load_checkpoint (a directory): both refuse, with the ValueError the
    server turns (with CheckpointError) into its E-SERVE diagnostic (was: MemoryError, ZeroDivisionError)."""
    from mkc.checkpoint import CheckpointError
    from mkc.serve.drafting import DraftModel
    config, _ = _reference("deepseek_v3_mini")
    (tmp_path / "config.json").write_text(json.dumps(config | change))
    for model in (tmp_path / "config.json", tmp_path):
        with pytest.raises((ValueError, CheckpointError), match=words):   # what the server catches
            DraftModel.load(str(model), seed=0, context=64, keep=2)


def test_a_model_type_no_family_reads_points_at_the_doc_on_adding_one(tmp_path):
    """E-MODEL for an unsupported `model_type` lists the types read and names the section of
    docs/extending.md on a new family (which says when a type is an existing family's alias)."""
    from tests_support import ROOT
    config = json.loads((CONFIG_DIR / "llama_mini.json").read_text()) | {"model_type": "phi3"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    with pytest.raises(MkcError) as e:
        load_dims(path)
    d = e.value.diagnostics[0]
    assert d.code == "E-MODEL" and "'phi3' is not supported" in d.message
    assert "llama" in d.hint and "docs/extending.md, 'A new model family'" in d.hint
    doc = (ROOT / "docs" / "extending.md").read_text()
    assert "\n## A new model family\n" in doc and "registry alias" in doc
