"""`mkc serve`'s refusals before it serves: a diagnostic and exit status 1 (or argparse's usage
error, 2), never a traceback; each in a fresh process, as the server sets JAX's device count
before JAX starts."""
from __future__ import annotations

import json
import socket

import pytest
from conftest import SPEC, run_python

JOIN = ["--coordinator", "127.0.0.1:1", "--num-processes", "2", "--process-id", "1"]


@pytest.mark.parametrize("args, status, message", [
    (["missing.sched", "--model", "qwen3_8_mini"], 1, "missing.sched"),
    ([str(SPEC), "--model", "no_such_model"], 1, "no_such_model"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--batch", "9"], 1,
     "error[E-SERVE]: --batch 9: the spec builds its kernel for batches 1 to 8"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--port", "70000"], 2, "expected an integer from 0 to 65535"),
    ([str(SPEC)], 2, "the following arguments are required: --model"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--tokenizer", "words"], 2, "invalid choice: 'words'"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--max-body-bytes", "0"], 2,
     "--max-body-bytes: expected an integer of at least 1"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--max-body-bytes", "100", "--max-buffered-bytes", "99"], 1,
     "error[E-SERVE]: --max-buffered-bytes 99 is less than --max-body-bytes 100"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--max-connections", "0"], 2,
     "--max-connections: expected an integer of at least 1"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--served-model-name", " "], 2,
     "--served-model-name: expected a name, got nothing"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--draft-model", "qwen3_8_mini"], 1,
     "error[E-SERVE]: --draft-model drafts only with --speculative draft-model"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--speculative", "draft-model", "--draft-model",
      "qwen3_5_moe_mini"], 1, "--draft-model qwen3_5_moe_mini has a vocabulary of 1024 tokens, "
     "the served model 2048"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--speculative", "draft-model", "--draft-model",
      "no_such_draft"], 1, "--draft-model no_such_draft:"),
    # several processes (docs/serving.md#several-hosts)
    ([str(SPEC), "--model", "qwen3_8_mini", *JOIN[:4]], 1,
     "error[E-SERVE]: --coordinator, --num-processes without --process-id: the three go together"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--coordinator", "10.0.0.2", *JOIN[2:]], 1,
     "error[E-SERVE]: --coordinator '10.0.0.2': expected HOST:PORT"),
    ([str(SPEC), "--model", "qwen3_8_mini", *JOIN[:2], "--num-processes", "1", "--process-id", "0"], 1,
     "error[E-SERVE]: --num-processes 1: one process needs no coordinator"),
    ([str(SPEC), "--model", "qwen3_8_mini", *JOIN[:4], "--process-id", "2"], 1,
     "error[E-SERVE]: --process-id 2 with --num-processes 2: the ids run from 0 to 1"),
    ([str(SPEC), "--model", "qwen3_8_mini", *JOIN, "--host", "0.0.0.0", "--port", "8001"], 1,
     "error[E-SERVE]: --host and --port given to process 1: only process 0 serves HTTP"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--lockstep-timeout", "5"], 1,
     "error[E-SERVE]: --lockstep-timeout applies to several processes only"),
    ([str(SPEC), "--model", "qwen3_8_mini", "--distributed"], 1,
     "error[E-SERVE]: jax.distributed could not start: coordinator_address should be defined"),
])
def test_serve_refuses_before_serving(args, status, message):
    r = run_python(["-m", "mkc", "serve", *args], timeout=120)
    assert r.returncode == status, r.stderr
    assert message in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("args, message", [
    (["--port", "{busy}"], "--port:1:1: error[E-SERVE]: cannot listen on 127.0.0.1:{busy}: "
                           "Address already in use"),
    (["--host", "no-such-host.invalid"], "--host:1:1: error[E-SERVE]: cannot listen on "
                                         "no-such-host.invalid:8000:"),
])
def test_an_address_it_cannot_listen_on_is_refused_before_the_model_loads(args, message):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        r = run_python(["-m", "mkc", "serve", str(SPEC), "--model", "qwen3_8_mini",
                        *[a.format(busy=port) for a in args]], timeout=120)
    assert r.returncode == 1, r.stderr
    assert message.format(busy=port) in r.stderr
    assert "compiling the step" not in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("eos, message", [
    (["a"], 'eos_token_id ["a"]: "a" is not a token id of its vocabulary (0 to 2047)'),
    ([5, 99999], "eos_token_id [5, 99999]: 99999 is not a token id"),
    (True, "eos_token_id true: true is not a token id"),
])
def test_an_eos_token_outside_the_vocabulary_is_refused(tmp_path, eos, message):
    from mkc.model.config import CONFIG_DIR
    config = json.loads((CONFIG_DIR / "qwen3_8_mini.json").read_text()) | {"eos_token_id": eos}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = run_python(["-m", "mkc", "serve", str(SPEC), "--model", str(path)], timeout=120)
    assert r.returncode == 1, r.stderr
    # refused where the spec is compiled for the model, as `mkc check` refuses it
    assert f"error[E-MODEL]: model config {path}: {message}" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_context_past_the_model_s_positions_is_refused(tmp_path):
    from mkc.model.config import CONFIG_DIR
    config = json.loads((CONFIG_DIR / "qwen3_8_mini.json").read_text()) | {"max_position_embeddings": 2048}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    r = run_python(["-m", "mkc", "serve", str(SPEC), "--model", str(path)], timeout=120)
    assert r.returncode == 1, r.stderr
    assert (f"--model:1:1: error[E-SERVE]: the spec's context of 4096 tokens runs past {path}'s "
            "max_position_embeddings (2048)") in r.stderr and "Traceback" not in r.stderr


def test_reference_prefill_is_refused_beside_a_kernel_on_an_accelerator():
    # no accelerator here: the child takes JAX's backend for one, after the devices are set
    code = ("import sys, jax; jax.default_backend = lambda: 'tpu'; from mkc.cli import main; "
            f"sys.exit(main(['serve', {str(SPEC)!r}, '--model', 'qwen3_8_mini', '--prefill', 'reference']))")
    r = run_python(["-c", code], timeout=300)
    assert r.returncode == 1, r.stderr
    assert "error[E-SERVE]: --prefill reference runs the family's reference on one tpu device" in r.stderr
    assert "hint: serve with --prefill verify or decode" in r.stderr
    assert "Traceback" not in r.stderr


def test_a_checkpoint_value_the_loader_refuses_is_a_located_refusal(tmp_path):
    """An NVFP4 global scale of 0: `mkc serve` refused it with a bare ValueError out of its
    warm-up (its experts packed); the loader refuses it now, a diagnostic at `--model` before
    any weight is packed."""
    from mkc.checkpoint import save_checkpoint
    from mkc.families.muse_spark import reference as muse
    from mkc.model.config import CONFIG_DIR
    config = json.loads((CONFIG_DIR / "muse_spark_mini_nvfp4.json").read_text())
    params = muse.init_params(muse.load_config(config), seed=0)
    name = "model.layers.1.mlp.experts.down_proj_weight_scale_2"
    params[name][3] = 0.0
    save_checkpoint(tmp_path, config, params)
    r = run_python(["-m", "mkc", "serve", "schedules/muse_spark.sched", "--model", str(tmp_path),
                    "--backend", "emulation", "--port", "0"], timeout=120)
    assert r.returncode == 1, r.stderr
    assert (f"--model:1:1: error[E-CHECKPOINT]: {tmp_path}/model.safetensors: tensor {name} holds 1 "
            "global scale(s) outside") in r.stderr
    assert "compiling the step" not in r.stderr and "Traceback" not in r.stderr
