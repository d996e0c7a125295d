"""mkc/serve/model.py's byte-level stand-in tokenizer (`mkc serve --tokenizer bytes`), alone and
behind the API over the stand-in module (serve_fakes: its vocabulary is 64 ids, so the text
here keeps to bytes below 64)."""
from __future__ import annotations

from fastapi.testclient import TestClient
from serve_fakes import EOS, fake_greedy, fake_mesh, fake_module

from mkc.serve.api import create_app
from mkc.serve.engine import Engine
from mkc.serve.model import ByteTokenizer, Served


def test_bytes_are_token_ids():
    tok = ByteTokenizer()
    assert tok.encode("a1é") == [97, 49, 0xC3, 0xA9]
    assert tok.decode(tok.encode("a1é")) == "a1é"
    assert tok.decode([104, 300, 105]) == "hi"             # ids past a byte decode to nothing
    assert tok.decode([0xC3]).endswith("\ufffd")           # a partial character, as the API waits on
    assert tok.chat([{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "2+2"}]}]) == \
        tok.encode("system: be brief\nuser: 2+2\nassistant: ")


def test_text_prompts_and_stop_strings_through_the_api():
    gen = fake_module()
    served = Served(name="fake_mini", gen=gen, weights={}, mesh=fake_mesh(), interpret=None,
                    tokenizer=ByteTokenizer(), eos_token_ids=frozenset({EOS}))
    engine = Engine(gen, {}, served.mesh, 1, None, eos_token_ids=served.eos_token_ids)
    engine.start()
    with TestClient(create_app(served, engine)) as client:
        try:
            r = client.post("/v1/completions", json={"model": "fake_mini", "prompt": "1+2=",
                                                     "max_tokens": 6, "temperature": 0})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            expected = fake_greedy([49, 43, 50, 61], 6)
            assert choice["token_ids"] == expected
            assert choice["text"] == ByteTokenizer().decode(expected)
            assert client.post("/tokenize", json={"prompt": "1+2="}).json()["tokens"] == [49, 43, 50, 61]
            stop = ByteTokenizer().decode(expected[2:4])
            r = client.post("/v1/completions", json={"model": "fake_mini", "prompt": "1+2=",
                                                     "max_tokens": 6, "temperature": 0, "stop": stop})
            assert r.json()["choices"][0]["text"] == ByteTokenizer().decode(expected[:2])
            assert r.json()["choices"][0]["finish_reason"] == "stop"
        finally:
            engine.stop()      # before the client's event loop closes: a cut request still ends


def test_a_model_is_served_by_its_name_not_its_path(tmp_path):
    from mkc.serve.model import served_name
    (tmp_path / "smollm2").mkdir()
    (tmp_path / "smollm2" / "config.json").write_text("{}")
    (tmp_path / "tiny.json").write_text("{}")
    assert served_name(str(tmp_path / "smollm2")) == "smollm2"
    assert served_name(str(tmp_path / "smollm2") + "/.") == "smollm2"
    assert served_name(str(tmp_path / "smollm2" / "config.json")) == "smollm2"
    assert served_name(str(tmp_path / "tiny.json")) == "tiny"
    assert served_name("qwen3_8_mini") == "qwen3_8_mini"         # a shipped config
