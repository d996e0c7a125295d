"""What `mkc serve` serves: a spec compiled for a model, imported, with its weights placed on
the mesh, and the checkpoint's tokenizer when it has one (or the byte-level stand-in,
`--tokenizer bytes`).

JAX is imported only after `prepare_devices` has set the CPU device count (on a CPU host the
module's ranks are virtual devices).
"""
from __future__ import annotations

import importlib.util
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any


def prepare_devices(spec: str) -> None:
    """Before JAX starts: on a CPU host, as many virtual devices as the spec's mesh has ranks
    (the flag only affects JAX's CPU platform), and the pinned vector ISA of mkc.numerics."""
    from mkc.lang.parser import parse_file
    from mkc.numerics import pin_cpu_isa
    sched, _ = parse_file(spec)
    mesh = sched.settings.get("mesh")
    ranks = mesh.value[1] if mesh is not None else 1
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={ranks}".strip()
    pin_cpu_isa()


def import_generated(source: str, name: str) -> Any:
    """Import a generated module's text from a private temporary directory."""
    path = Path(tempfile.mkdtemp(prefix="mkc-serve-")) / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


class Tokenizer:
    """A checkpoint's tokenizer: transformers' AutoTokenizer when transformers is installed
    (it brings the chat template), else `tokenizers`' tokenizer.json (text, no chat)."""

    def __init__(self, directory: Path):
        self.chat = None
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        if AutoTokenizer is not None:
            self._hf = AutoTokenizer.from_pretrained(str(directory))
            self._encode = lambda text: self._hf.encode(text, add_special_tokens=False)
            self._decode = lambda ids: self._hf.decode(ids)
            if getattr(self._hf, "chat_template", None):
                self.chat = lambda messages: list(self._hf.apply_chat_template(
                    messages, add_generation_prompt=True, tokenize=True))
        else:
            from tokenizers import Tokenizer as Raw
            raw = Raw.from_file(str(directory / "tokenizer.json"))
            self._encode = lambda text: raw.encode(text, add_special_tokens=False).ids
            self._decode = lambda ids: raw.decode(ids)

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))

    @staticmethod
    def load(directory: Path) -> "Tokenizer | None":
        """The directory's tokenizer, or None when it has none or no tokenizer library is
        installed (text requests are then refused with a 400 that says so)."""
        if not any((directory / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json")):
            return None
        try:
            return Tokenizer(directory)
        except ImportError:
            return None


class ByteTokenizer:
    """A stand-in tokenizer for a model without one (a MINI config's random weights), so text
    and chat requests, and harnesses that send text (lm-eval), run against it: each UTF-8 byte
    is its token id (0 to 255; ids past 255 decode to nothing), and chat is "role: content"
    lines, then "assistant: ". The text means nothing; the plumbing is what it exercises."""

    def __init__(self):
        self.chat = lambda messages: self.encode(
            "".join(f"{m.get('role', 'user')}: {_text_of(m.get('content'))}\n" for m in messages)
            + "assistant: ")

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode(errors="replace")


def _text_of(content: Any) -> str:
    """A chat message's text: a string, or OpenAI's list of parts (their text parts)."""
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict))
    return "" if content is None else str(content)


TOKENIZERS = {"bytes": ByteTokenizer}       # `mkc serve --tokenizer`


@dataclass
class Served:
    """A compiled module ready to serve: the module, its placed weights, the mesh, the
    interpret parameters (None on TPU), the tokenizer (or None) and the model's EOS ids.
    `replica`: under jax.distributed on CPU, the mesh is this process's own devices (interpret
    mode cannot run a kernel across processes), so every process runs a whole replica."""

    name: str
    gen: Any
    weights: dict
    mesh: Any
    interpret: Any
    tokenizer: Tokenizer | ByteTokenizer | None
    eos_token_ids: frozenset[int]
    replica: bool = False


def _eos_ids(config: dict) -> frozenset[int]:
    eos = config.get("eos_token_id")
    if eos is None:
        return frozenset()
    return frozenset(int(e) for e in (eos if isinstance(eos, list) else [eos]))


def load_served(spec: str, model: str, batch: int | None = None, seed: int = 0,
                tokenizer: str | None = None) -> tuple[Served, int]:
    """Compile `spec` for `model` (a shipped config name, a config.json, or a checkpoint
    directory), import it and place its weights: the checkpoint's for a directory, else
    `random_weights(seed)`; and the batch to serve (default the spec's largest). `tokenizer`:
    a name in TOKENIZERS to serve in place of the checkpoint's. Raises MkcError for a bad spec
    or model, a batch the spec does not build, or a vocabulary the byte tokenizer does not fit
    (before any weight is read)."""
    from mkc import compiler
    from mkc.diagnostics import Diagnostic, MkcError, Span
    c = compiler.compile_spec(spec, model)
    gen = import_generated(c.module_source, compiler.module_name(c))
    low, high = gen.BATCH_RANGE
    batch = high if batch is None else batch
    if not low <= batch <= high:
        raise MkcError(Diagnostic("E-SERVE", f"--batch {batch}: the spec builds its kernel for "
                                  f"batches {low} to {high}", Span.unknown(spec),
                                  hint=f"pass --batch between {low} and {high}, or change the "
                                       "spec's `batch` line"))
    if tokenizer == "bytes" and gen.DIMS.vocab_size < 256:
        raise MkcError(Diagnostic("E-SERVE", f"--tokenizer bytes needs a vocabulary of at least 256 "
                                  f"token ids; {model}'s has {gen.DIMS.vocab_size}", Span.unknown(spec),
                                  hint="serve without --tokenizer (token-id prompts)"))

    import jax
    from jax.experimental.pallas import tpu as pltpu
    directory = Path(model) if Path(model).is_dir() else None
    if directory is not None:
        from mkc.checkpoint import load_checkpoint
        config, hf = load_checkpoint(directory)
    else:
        config = dict(gen.HF_CONFIG)
        hf = gen.random_weights(seed)
    interpret = None
    if jax.default_backend() == "cpu":
        from mkc.interpret import lean_interpreter
        lean_interpreter()
        interpret = pltpu.InterpretParams(dma_execution_mode="on_wait")
    replica = interpret is not None and jax.process_count() > 1
    mesh = gen.make_mesh(jax.local_devices() if replica else None)
    hosts = {d.process_index for d in mesh.devices.flat}
    if not replica and len(hosts) < jax.process_count():
        raise MkcError(Diagnostic(
            "E-SERVE", f"the spec's mesh of {mesh.devices.size} ranks lies on process(es) "
            f"{sorted(hosts)} of {jax.process_count()}: the others would hold no rank",
            Span.unknown(spec), hint="serve a spec whose topology spans every host, or serve it "
                                     "from one host"))
    weights = gen.place_weights(hf, mesh)
    if tokenizer is not None:
        tok = TOKENIZERS[tokenizer]()
    else:
        tok = Tokenizer.load(directory) if directory is not None else None
    return Served(name=model, gen=gen, weights=weights, mesh=mesh, interpret=interpret,
                  tokenizer=tok, eos_token_ids=_eos_ids(config), replica=replica), batch

