"""A checkpoint's own tokenizer behind `mkc serve`, without transformers: a tokenizer.json
trained here with `tokenizers` (a byte-level BPE whose vocabulary is padded with plain added
tokens to MINI Llama's 2048 ids, so every generated id has text) and a tokenizer_config.json
whose chat template mkc renders with jinja2 as transformers does (mkc.serve.model.ChatTemplate).

Quick tier: the template's rendering (trim_blocks, lstrip_blocks, raise_exception, tojson,
loop controls, `{% generation %}`), where it comes from (a string, named templates,
chat_template.jinja), a refusal as a 400 and a template that does not parse as a refusal at
start. Slow tier: the real server on a MINI Llama checkpoint saved with that tokenizer: /tokenize
and /detokenize round-trip, and a text and a chat completion equal the reference's greedy
decoding of the tokenized prompt and of the rendered template."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import run_python
from fastapi.testclient import TestClient
from serve_fakes import EOS, fake_mesh, fake_module
from tests_support import ROOT

from mkc.serve.api import create_app
from mkc.serve.engine import Engine
from mkc.serve.model import ChatTemplate, Served, Tokenizer, TokenizerError

LLAMA_SPEC = ROOT / "schedules" / "llama_3_1_8b.sched"
LLAMA = "llama_mini"            # vocabulary 2048, bos 1, eos 2
SPECIAL = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]   # ids 0 to 5
SENTENCES = ["the cat sat on the mat", "a dog ran to the park and back", "be brief and kind",
             "what is two plus two", "the answer is four"]
# Block tags on lines of their own: trim_blocks and lstrip_blocks leave no whitespace behind them
TEMPLATE = """{{ bos_token }}
{%- for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}
    {{ raise_exception('roles are system, user and assistant, not ' + m['role']) }}
  {% endif %}
<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}
{% endfor %}
{% if add_generation_prompt %}<|assistant|>{% endif %}"""
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "the cat sat"}]
RENDERED = "<s><|system|>be brief</s>\n<|user|>the cat sat</s>\n<|assistant|>"
TOKENS = {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True}}


def write_tokenizer(directory: Path, chat_template=TEMPLATE, vocab: int = 2048) -> None:
    """tokenizer.json (byte-level BPE trained on SENTENCES, then plain added tokens up to
    `vocab` ids) and tokenizer_config.json with `chat_template` and the special tokens."""
    from tokenizers import Tokenizer as Raw
    from tokenizers import decoders, models, pre_tokenizers, trainers
    raw = Raw(models.BPE(unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(SENTENCES, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    raw.add_tokens([f"<w{i}>" for i in range(vocab - raw.get_vocab_size())])
    assert raw.get_vocab_size() == vocab
    directory.mkdir(parents=True, exist_ok=True)
    raw.save(str(directory / "tokenizer.json"))
    config = {**TOKENS, "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (directory / "tokenizer_config.json").write_text(json.dumps(config))


def raw_tokenizer(directory: Path):
    from tokenizers import Tokenizer as Raw
    return Raw.from_file(str(directory / "tokenizer.json"))


def test_the_template_renders_as_transformers_does():
    t = ChatTemplate(TEMPLATE, {"bos_token": "<s>", "eos_token": "</s>"}, "test")
    assert t.render(MESSAGES) == RENDERED
    assert t.render(MESSAGES, add_generation_prompt=False) == RENDERED.removesuffix("<|assistant|>")
    # content as OpenAI's parts reaches the template as its text
    parts = [{"type": "text", "text": "the cat"}, {"type": "text", "text": " sat"}]
    assert t.render([MESSAGES[0], {"role": "user", "content": parts}]) == RENDERED
    with pytest.raises(TokenizerError, match="refused the messages: roles are system, user and "
                                             "assistant, not tool"):
        t.render([{"role": "tool", "content": "x"}])
    extras = ChatTemplate("{{ messages | tojson }}|{{ {'b': 1, 'a': [2]} | tojson(sort_keys=true) }}|"
                          "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}"
                          "{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}|"
                          "{{ strftime_now('%Y') | length }}|{{ tools }}", {}, "test")
    assert extras.render([{"role": "user", "content": "<é&>"}, {"role": "user", "content": "no"}]) == \
        '[{"role": "user", "content": "<é&>"}, {"role": "user", "content": "no"}]|{"a": [2], "b": 1}|' \
        "<é&>|4|None"
    for source, problem in (("{{ nothing.there }}", "'nothing' is undefined"),
                            ("{{ messages[0].content + 1 }}", "TypeError"),
                            ("{% set x = messages.append(1) %}", "'append' of 'list' object is unsafe")):
        with pytest.raises(TokenizerError, match="refused the messages:.*" + problem):
            ChatTemplate(source, {}, "test").render(MESSAGES)
    with pytest.raises(TokenizerError, match=r"cfg: the chat template does not parse \(line 2: "):
        ChatTemplate("ok\n{% for %}", {}, "cfg")


def test_where_the_template_comes_from(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": TEMPLATE}]
    write_tokenizer(tmp_path / "named", named)
    tok = Tokenizer.load(tmp_path / "named")
    rendered = raw_tokenizer(tmp_path / "named").encode(RENDERED, add_special_tokens=False).ids
    assert tok.chat(MESSAGES) == rendered
    assert tok.decode(tok.chat(MESSAGES)) == "be brief\nthe cat sat\n"      # special tokens skipped
    write_tokenizer(tmp_path / "nameless", named[:1])
    with pytest.raises(TokenizerError, match=r"lists the templates \['tool_use'\] and none is named "
                                             "'default'"):
        Tokenizer.load(tmp_path / "nameless")
    write_tokenizer(tmp_path / "none", None)
    assert Tokenizer.load(tmp_path / "none").chat is None
    (tmp_path / "none" / "chat_template.jinja").write_text("{{ eos_token }}{{ messages[0].content }}")
    tok = Tokenizer.load(tmp_path / "none")
    assert tok.template.render(MESSAGES) == "</s>be brief"     # the file, with the config's tokens
    (tmp_path / "none" / "chat_template.jinja").write_text("{% if %}")
    with pytest.raises(TokenizerError, match="chat_template.jinja: the chat template does not parse"):
        Tokenizer.load(tmp_path / "none")


def test_a_refusing_template_is_a_400_and_the_server_keeps_serving(tmp_path):
    write_tokenizer(tmp_path)
    gen = fake_module()
    served = Served(name="fake_mini", gen=gen, weights={}, mesh=fake_mesh(), interpret=None,
                    tokenizer=Tokenizer.load(tmp_path), eos_token_ids=frozenset({EOS}))
    engine = Engine(gen, {}, served.mesh, 1, None, eos_token_ids=served.eos_token_ids)
    engine.start()
    try:
        with TestClient(create_app(served, engine)) as client:
            expected = raw_tokenizer(tmp_path).encode(RENDERED, add_special_tokens=False).ids
            assert client.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"] == expected
            tool = [{"role": "tool", "content": "x"}]
            for path in ("/v1/chat/completions", "/tokenize"):
                r = client.post(path, json={"model": "fake_mini", "messages": tool})
                assert r.status_code == 400, r.text
                assert r.json()["error"] == {
                    "message": "the chat template refused the messages: roles are system, user and "
                               "assistant, not tool", "type": "invalid_request_error", "param": "messages",
                    "code": 400}
            r = client.post("/v1/completions", json={"model": "fake_mini", "prompt": [1], "max_tokens": 1})
            assert r.status_code == 200
            # null content (OpenAI's; an assistant's message with tool calls) is empty text
            empty = [{"role": "system", "content": None}, MESSAGES[1]]
            expected = raw_tokenizer(tmp_path).encode(RENDERED.replace("be brief", ""),
                                                      add_special_tokens=False).ids
            assert client.post("/tokenize", json={"messages": empty}).json()["tokens"] == expected
    finally:
        engine.stop()


# The stand-in server over a checkpoint's tokenizer in a process of its own (a client in the
# server's process would share its GIL): it prints its URL and serves until killed.
TOKENIZER_SERVER = """
import sys, time
from pathlib import Path
from serve_fakes import fake_server
from mkc.serve.model import Tokenizer
with fake_server(tokenizer=Tokenizer.load(Path(sys.argv[1]))) as url:
    print(url, flush=True)
    time.sleep(600)
"""


def test_health_answers_while_huge_texts_are_tokenized(tmp_path):
    """The tokenizers library's `encode` holds the GIL: a 900k-character /tokenize held /health
    (and the engine's thread) for as long as it ran, a second or more here. Its batch calls
    release it, and large inputs take turns on a thread of low priority."""
    import os
    import random
    import subprocess
    import sys
    import threading
    import time

    import httpx
    write_tokenizer(tmp_path)
    rng = random.Random(0)
    text = " ".join(rng.choice(SENTENCES + ["✓", "\n", "zebra"]) for _ in range(100_000))[:2_000_000]
    body = json.dumps({"prompt": text}).encode()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests" / "serve")]),
           "JAX_PLATFORMS": "cpu"}
    server = subprocess.Popen([sys.executable, "-c", TOKENIZER_SERVER, str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().strip()
        assert url.startswith("http://"), "the stand-in server did not start"
        with httpx.Client(timeout=120) as http:
            http.get(url + "/health")
            latencies: list[float] = []
            done = threading.Event()

            def poll() -> None:
                while not done.is_set() and len(latencies) < 1000:
                    t = time.perf_counter()
                    assert http.get(url + "/health").status_code == 200
                    latencies.append(time.perf_counter() - t)
                    time.sleep(0.02)

            def tokenize() -> None:
                r = httpx.post(url + "/tokenize", content=body, timeout=120,
                               headers={"content-type": "application/json"})
                assert "more than the 32 a prompt may hold" in r.json()["error"]["message"]
            poller = threading.Thread(target=poll)
            poller.start()
            t0 = time.perf_counter()
            try:
                for t in (threads := [threading.Thread(target=tokenize) for _ in range(2)]):
                    t.start()
                for t in threads:
                    t.join()
            finally:
                done.set()
                poller.join()
    finally:
        server.kill()
        server.wait()
    print(f"two /tokenize of {len(text)} characters: {time.perf_counter() - t0:.2f} s; /health "
          f"{len(latencies)} answers, max {max(latencies) * 1e3:.0f} ms")
    assert len(latencies) >= 3 and max(latencies) < 0.5, latencies


def test_tokenizer_info_and_echo_of_a_text_prompt(tmp_path):
    # lm-eval's remote tokenizer reads GET /tokenizer_info (vLLM's: tokenizer_config.json's
    # fields, special tokens by their text, the class and the chat template); echo gives the
    # prompt's text back before the completion's, each token at the offset vLLM gives it
    write_tokenizer(tmp_path)
    (tmp_path / "special_tokens_map.json").write_text(json.dumps({"pad_token": "<unk>"}))
    gen = fake_module()
    served = Served(name="fake_mini", gen=gen, weights={}, mesh=fake_mesh(), interpret=None,
                    tokenizer=Tokenizer.load(tmp_path), eos_token_ids=frozenset({EOS}))
    engine = Engine(gen, {}, served.mesh, 1, None, eos_token_ids=served.eos_token_ids)
    engine.start()
    try:
        with TestClient(create_app(served, engine)) as client:
            info = client.get("/tokenizer_info").json()
            assert info == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<unk>",
                            "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": TEMPLATE}
            prompt = "ABC,42!"               # ids below the stand-in model's 64
            r = client.post("/v1/completions", json={"model": "fake_mini", "prompt": prompt, "echo": True,
                                                     "logprobs": 0, "max_tokens": 2, "temperature": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            ids = raw_tokenizer(tmp_path).encode(prompt, add_special_tokens=False).ids
            names = [raw_tokenizer(tmp_path).decode([t]) for t in ids + choice["token_ids"]]
            assert choice["text"].startswith(prompt) and choice["logprobs"]["tokens"] == names
            offsets = choice["logprobs"]["text_offset"]
            assert offsets[:len(ids)] == [len("".join(names[:i])) for i in range(len(ids))]
            assert offsets[len(ids)] == len(prompt)
    finally:
        engine.stop()


def test_a_template_that_does_not_parse_is_refused_at_start(tmp_path):
    (tmp_path / "config.json").write_text((ROOT / "mkc/model/configs/llama_mini.json").read_text())
    write_tokenizer(tmp_path, "{% for m in messages %}no end")
    r = run_python(["-m", "mkc", "serve", str(LLAMA_SPEC), "--model", str(tmp_path)], timeout=300)
    assert r.returncode == 1, r.stderr
    assert "error[E-SERVE]: the checkpoint's tokenizer: " in r.stderr
    assert "tokenizer_config.json: the chat template does not parse (line 1: Unexpected end of " \
           "template" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
def test_text_and_chat_through_the_checkpoint_tokenizer(tmp_path):
    import httpx
    import openai
    from serve_process import reference_greedy, running_server, token_ids

    from mkc.checkpoint import save_checkpoint
    from mkc.families.llama import reference
    config = json.loads((ROOT / f"mkc/model/configs/{LLAMA}.json").read_text())
    params = reference.init_params(reference.load_config(config), seed=5)
    save_checkpoint(tmp_path, config, params)
    write_tokenizer(tmp_path)
    tok = raw_tokenizer(tmp_path)
    greedy = reference_greedy(LLAMA_SPEC, LLAMA, params)
    name = tmp_path.name                # a checkpoint is served by its directory's name
    with running_server(["--batch", "1"], spec=LLAMA_SPEC, model=str(tmp_path)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        text = "the dog sat on the park ✓"
        ids = httpx.post(url + "/tokenize", json={"prompt": text}).json()["tokens"]
        assert ids == tok.encode(text, add_special_tokens=False).ids
        assert httpx.post(url + "/detokenize", json={"tokens": ids}).json()["prompt"] == text

        r = client.completions.create(model=name, prompt=text, max_tokens=4, temperature=0)
        expected, finish = greedy(ids, 4)
        assert token_ids(r.choices[0]) == expected
        assert r.choices[0].text == tok.decode(expected) and r.choices[0].finish_reason == finish
        assert r.usage.prompt_tokens == len(ids)

        prompt = tok.encode(RENDERED, add_special_tokens=False).ids
        assert httpx.post(url + "/tokenize", json={"messages": MESSAGES}).json()["tokens"] == prompt
        r = client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=3, temperature=0)
        expected, finish = greedy(prompt, 3)
        assert r.usage.prompt_tokens == len(prompt)
        assert token_ids(r.choices[0]) == expected
        assert r.choices[0].message.content == tok.decode(expected)
        with pytest.raises(openai.BadRequestError, match="not tool"):
            client.chat.completions.create(model=name, messages=[{"role": "tool", "content": "x"}])
