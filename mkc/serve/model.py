"""What `mkc serve` serves: a spec compiled for a model, imported, with its weights placed on
the mesh, and the checkpoint's tokenizer when it has one (or the byte-level stand-in,
`--tokenizer bytes`).

JAX is imported only after `prepare_devices` has set the CPU device count (on a CPU host the
module's ranks are virtual devices).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from mkc import files


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
    """Import a generated module's text (from a private temporary directory), kept in
    sys.modules under `name`."""
    return files.import_generated(source=source, name=name, register=True)


class TokenizerError(ValueError):
    """A checkpoint's tokenizer files that cannot be used (an unreadable tokenizer_config.json, a
    chat template that does not parse), or a conversation its chat template refuses; the
    message says which file or which refusal."""


# The special-token names transformers passes to a chat template (its special_tokens_map)
_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                   "mask_token")


def _token_text(value: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string, or an AddedToken's dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _plain(value: Any) -> Any:
    """A tokenizer_config.json value with each AddedToken dict as its text (vLLM's form)."""
    if isinstance(value, dict):
        return value["content"] if isinstance(value.get("content"), str) else \
            {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TokenizerError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} holds a {type(data).__name__}, not an object")
    return data


class ChatTemplate:
    """A checkpoint's Jinja chat template, rendered as transformers' `apply_chat_template`
    renders it: in jinja2's immutable sandbox with `trim_blocks` and `lstrip_blocks`; the
    `loopcontrols` extension; `{% generation %}` blocks (transformers' assistant-mask marker)
    kept as plain text; the globals `raise_exception(message)` and `strftime_now(format)`; a
    `tojson` filter that does not escape HTML (json.dumps, `ensure_ascii` off); and the
    variables `messages`, `add_generation_prompt`, `tools` and `documents` (none) and the
    tokenizer's special tokens (`bos_token`, `eos_token`, ...). A message whose content is
    OpenAI's list of parts reaches the template as its text parts joined, and null content as
    empty text.

    Raises TokenizerError when the template does not parse (at start), and from `render` when
    it refuses a conversation (its `raise_exception`, an undefined name, a sandbox violation,
    any error while rendering)."""

    def __init__(self, source: str, variables: dict[str, Any], where: str):
        import jinja2
        from jinja2.ext import Extension, loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        class Generation(Extension):
            tags = {"generation"}

            def parse(self, parser):
                next(parser.stream)
                return parser.parse_statements(("name:endgeneration",), drop_needle=True)

        def raise_exception(message: Any) -> None:
            raise jinja2.TemplateError(str(message))

        def tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
                   separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
            return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                              sort_keys=sort_keys)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=[loopcontrols, Generation])
        env.filters["tojson"] = tojson
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as e:
            raise TokenizerError(f"{where}: the chat template does not parse (line {e.lineno}: "
                                 f"{e.message})") from None
        self.source = source
        self._variables = variables

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
        # parts as their text; null content (OpenAI's, an assistant's message with tool calls) as ""
        messages = [{**m, "content": _text_of(m["content"])} if "content" in m
                    and not isinstance(m["content"], str) else m for m in messages]
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **self._variables)
        except Exception as e:           # the template is the checkpoint's code: any failure is its refusal
            import jinja2
            what = str(e) if isinstance(e, jinja2.TemplateError) else f"{type(e).__name__}: {e}"
            raise TokenizerError(f"the chat template refused the messages: {what}") from None

    @staticmethod
    def load(directory: Path, config: dict) -> "ChatTemplate | None":
        """The directory's chat template: chat_template.jinja (which transformers prefers), else
        tokenizer_config.json's `chat_template` (a string, or a list of named templates: the one
        named "default"); None when it has none."""
        file = directory / "chat_template.jinja"
        where = str(file)
        if file.is_file():
            source = file.read_text(encoding="utf-8")
        else:
            where = str(directory / "tokenizer_config.json")
            source = config.get("chat_template")
            if isinstance(source, list):
                named = {t.get("name"): t.get("template") for t in source if isinstance(t, dict)}
                if "default" not in named:
                    raise TokenizerError(f"{where}: chat_template lists the templates "
                                         f"{sorted(map(str, named))} and none is named 'default' "
                                         "(the one served)")
                source = named["default"]
            if source is None:
                return None
            if not isinstance(source, str):
                raise TokenizerError(f"{where}: chat_template is a {type(source).__name__}, not a string "
                                     "or a list of named templates")
        return ChatTemplate(source, _template_variables(directory, config), where)


def _template_variables(directory: Path, config: dict) -> dict[str, Any]:
    """The special tokens a chat template sees: tokenizer_config.json's, then
    special_tokens_map.json's for the names it lacks."""
    extra = _read_json(directory / "special_tokens_map.json")
    out: dict[str, Any] = {}
    for name in _SPECIAL_TOKENS:
        text = _token_text(config.get(name, extra.get(name)))
        if text is not None:
            out[name] = text
    more = config.get("additional_special_tokens", extra.get("additional_special_tokens"))
    if isinstance(more, list):
        out["additional_special_tokens"] = [t for t in map(_token_text, more) if t is not None]
    return out


class Tokenizer:
    """A checkpoint's tokenizer: transformers' AutoTokenizer when transformers is installed,
    else its tokenizer.json through `tokenizers`; and its chat template (ChatTemplate, whichever
    library encodes), rendered to text and encoded without added special tokens (the template
    writes them), as transformers does. Decoding skips special tokens. Both libraries' fast
    tokenizers encode through `tokenizers`' batch calls, which release the GIL while they run,
    so the event loop and the engine's thread go on beside them."""

    def __init__(self, directory: Path):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            AutoTokenizer = None
        config = _read_json(directory / "tokenizer_config.json")
        self._class = config.get("tokenizer_class") or "PreTrainedTokenizerFast"
        if AutoTokenizer is not None:
            hf = AutoTokenizer.from_pretrained(str(directory))
            self._class = type(hf).__name__
            self._encode = lambda text: hf.encode(text, add_special_tokens=False)
            self._decode = lambda ids: hf.decode(ids, skip_special_tokens=True)
        else:
            from tokenizers import Tokenizer as Raw
            if not (directory / "tokenizer.json").is_file():
                raise ImportError("a tokenizer without tokenizer.json needs transformers")
            raw = Raw.from_file(str(directory / "tokenizer.json"))
            # the batch entry points, which release the GIL while they run (`encode` holds it:
            # a 900k-character text held up the event loop and the engine's thread for a second);
            # encode_batch_fast (tokenizers 0.21) also skips the offsets nothing here reads
            batch = getattr(raw, "encode_batch_fast", raw.encode_batch)
            self._encode = lambda text: batch([text], add_special_tokens=False)[0].ids
            self._decode = lambda ids: raw.decode_batch([ids], skip_special_tokens=True)[0]
        self.template = ChatTemplate.load(directory, config)
        self.chat = None if self.template is None else self._chat
        self._config = {**_template_variables(directory, config), **config}

    def info(self) -> dict[str, Any]:
        """The tokenizer's configuration as vLLM's GET /tokenizer_info gives it:
        tokenizer_config.json's fields (special tokens by their text, also special_tokens_map.json's
        where it lacks them; file paths dropped), `tokenizer_class`, and the chat template served."""
        out = {k: _plain(v) for k, v in self._config.items()
               if k not in ("vocab_file", "merges_file", "chat_template")}
        out["tokenizer_class"] = self._class
        if self.template is not None:
            out["chat_template"] = self.template.source
        return out

    def _chat(self, messages: list[dict[str, Any]]) -> list[int]:
        return self.encode(self.template.render(messages))

    def encode(self, text: str) -> list[int]:
        return list(self._encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._decode(list(ids))

    @staticmethod
    def load(directory: Path) -> "Tokenizer | None":
        """The directory's tokenizer, or None when it has none or no tokenizer library is
        installed (text requests are then refused with a 400 that says so). Raises
        TokenizerError for tokenizer files that cannot be used."""
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

    def info(self) -> dict[str, Any]:
        """GET /tokenizer_info's answer: no special tokens, no chat template of a checkpoint."""
        return {"tokenizer_class": type(self).__name__}

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
    hf: Any = None                  # the HF-named weights placed (for --prefill reference)
    ir: Any = None                  # the schedule IR compiled (its rounding, for the same)
    replica: bool = False             # each process runs its own copy (CPU, multi-process)


def _eos_ids(config: dict, vocab: int, where: str) -> frozenset[int]:
    """The config's eos ids (`mkc.model.config.eos_token_ids`, which compiling the spec for
    it already checked); MkcError for one outside the vocabulary."""
    from mkc.diagnostics import Diagnostic, MkcError, Span
    from mkc.model.config import eos_token_ids
    from mkc.model.family import ConfigError
    try:
        return eos_token_ids(config, vocab)
    except ConfigError as e:
        raise MkcError(Diagnostic("E-SERVE", f"{where}: {e}", Span.unknown("--model"), hint=e.hint)) from None


def _check_context(config: dict, context: int, where: str) -> None:
    """MkcError where the spec's context runs past the config's `max_position_embeddings` (at
    its top or in `text_config`): positions the model was never trained at, which would be
    served as though it had been (vLLM refuses such a max_model_len too)."""
    from mkc.diagnostics import Diagnostic, MkcError, Span
    from mkc.model.config import text_setting
    longest = text_setting(config, "max_position_embeddings")
    if type(longest) is int and 0 < longest < context:
        raise MkcError(Diagnostic(
            "E-SERVE", f"the spec's context of {context} tokens runs past {where}'s "
            f"max_position_embeddings ({longest})", Span.unknown("--model"),
            hint=f"serve a spec with `context {longest}` or less, or a model trained that long"))


def served_name(model: str) -> str:
    """The name `--model` is served by unless `--served-model-name` gives one: a checkpoint
    directory's own name (not its path, which would tell every client the server's files), a
    config file's name (its directory's for a config.json), a shipped config's name."""
    path = Path(model)
    if path.is_dir():
        return path.resolve().name
    if path.is_file():
        return path.resolve().parent.name if path.name == "config.json" else path.stem
    return model


def load_served(spec: str, model: str, batch: int | None = None, seed: int = 0,
                tokenizer: str | None = None, place: bool = True,
                name: str | None = None) -> tuple[Served, int]:
    """Compile `spec` for `model` (a shipped config name, a config.json, or a checkpoint
    directory), import it and place its weights: the checkpoint's for a directory, else
    `random_weights(seed)`; and the batch to serve (default the spec's largest). `tokenizer`:
    a name in TOKENIZERS to serve in place of the checkpoint's; `place` False leaves the kernel's
    weights unplaced (`weights` empty: `--backend emulation` holds its own); `name`: the name it
    is served by (default `served_name(model)`). Raises MkcError
    for a bad spec or model, a batch the spec does not build, or a vocabulary the byte
    tokenizer does not fit, or tokenizer files that cannot be used (a chat template that does
    not parse), before any weight is read; and (E-CHECKPOINT) for a checkpoint value the loader
    refuses (a non-finite weight, a scale outside its format's range), before any is packed."""
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
    where = str(Path(model) / "config.json") if Path(model).is_dir() else model
    eos_token_ids = _eos_ids(gen.HF_CONFIG, gen.DIMS.vocab_size, where)
    _check_context(gen.HF_CONFIG, gen.CONTEXT, where)
    if tokenizer == "bytes" and gen.DIMS.vocab_size < 256:
        raise MkcError(Diagnostic("E-SERVE", f"--tokenizer bytes needs a vocabulary of at least 256 "
                                  f"token ids; {model}'s has {gen.DIMS.vocab_size}", Span.unknown(spec),
                                  hint="serve without --tokenizer (token-id prompts)"))

    directory = Path(model) if Path(model).is_dir() else None
    if tokenizer is not None:
        tok = TOKENIZERS[tokenizer]()
    else:
        try:
            tok = Tokenizer.load(directory) if directory is not None else None
        except TokenizerError as e:
            raise MkcError(Diagnostic("E-SERVE", f"the checkpoint's tokenizer: {e}", Span.unknown(spec),
                                      hint="fix the file it names")) from None

    import jax
    from jax.experimental.pallas import tpu as pltpu
    if directory is not None:
        from mkc.checkpoint import CheckpointError, checkpoint_error, load_checkpoint
        try:
            _, hf = load_checkpoint(directory)      # every value checked as it is read
        except CheckpointError as e:
            raise checkpoint_error(e, Span.unknown("--model")) from None
    else:
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
    weights = gen.place_weights(hf, mesh) if place else {}
    return Served(name=name or served_name(model), gen=gen, weights=weights, mesh=mesh, interpret=interpret,
                  tokenizer=tok, eos_token_ids=eos_token_ids, hf=hf, ir=c.ir,
                  replica=replica), batch

