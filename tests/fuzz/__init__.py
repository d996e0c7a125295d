"""Fuzz campaign for mkc: seeded mutants of the shipped specs (and hostile arguments,
checkpoints and editor sessions), each run by a target in a worker process with a timeout and
a memory cap, every outcome classified.

    .venv/bin/python benchmarks/fuzz_campaign.py [--cases 10000] [--seed 0] [--workers 2]
        [--timeout 10] [--mem-gib 4] [--compile-fraction 0.2] [--json OUT]
        [--target check|fmt|retarget|checkpoint|lsp|serve|all] [--kind K]
    .venv/bin/python benchmarks/fuzz_campaign.py --seed S --only I [--target T] [--emit DIR]

Mutants start from every shipped spec (`bases()`): checked with a MINI config where one divides
the spec's mesh (the K3 specs moved to 2 hosts, `2x2x2`, `tp = 16`, as the tests run them), and
the 27B Qwen and 397B MoE specs with their own full configs. Mutation kinds: token deletes,
replacements and duplications; numbers replaced by extreme values; non-UTF-8 bytes and odd
unicode; topologies, tile bounds and contexts at the edges (and generations, 2-D and 3-D);
duplicated, swapped, deleted and repeated lines and blocks; truncation; an item of a list
written twice (`gqa: qkv_gate, o_proj, gate_up, down, down`); runs of line breaks other than
"\n" (`\r`, `\u2028`, `\u2029`, `\f`, `\x0b`, `\x85`) inside comments, at line ends or in
place of a line feed; odd model paths (devices, directories, a FIFO, a symlink loop);
config.json files with extreme or mistyped values for each key and malformed documents;
schedule and model names that make bad module names.

Targets (`--target`; `all` draws one per case, apart from the mutation's stream, among those
available; `TARGETS` is the registry, each with its kinds, its run function and its share of
the timeout):

    check       `mkc.compiler.check_spec`; for a sample of accepted cases (and every config,
                model-path and name case) also `compile_spec`, writing the module into a package
                directory and importing it; for a sample of the others the step-time model
                (`mkc perf`'s `perf.run`)
    fmt         `mkc fmt -` on the spec-text mutants: what the parser accepts must format to
                text that parses to the same AST (`mkc.lang.ast.meaning`) with the same
                comments, and formatting that text again must change nothing
    retarget    `mkc retarget` as the command line runs it, with hostile --target strings
                (generations, topologies at the edges and with numbers of 5000 digits,
                malformed text, odd white space), --models values and -o paths, and spec
                mutants to a slice that works; what it writes must pass `mkc check`
    checkpoint  `mkc check SPEC --model ckpt` (and the requantization report) on a MINI
                checkpoint directory made hostile by a generator of
                fuzz.checkpoint's GENERATORS (`(rng, dir) -> description`; one
                kind each), SPEC the spec of the MINI config it picked (`spec_text`)
    lsp         `mkc lsp` fed a hostile session (fuzz.lsp: `hostile_session(rng)`
                frames, sent one at a time by `run_session`, each owed answer awaited 10 s)
    serve       `mkc serve`'s HTTP API and engine fed hostile requests (fuzz.serve:
                bodies, numbers at type edges, wrong types, chat messages and parts, non-Unicode
                text, routes, streams, several at once), each beside good requests; the server
                is the API over the tests' stand-in module in the worker, or a running `mkc
                serve` at MKC_FUZZ_SERVE_URL

A target whose module is missing is reported as unavailable (`--target all` skips it).
Outcome classes:

    ok             accepted (and, when compiled, the module imports)
    diagnostic     MkcError whose diagnostics all have file, line, column and hint, and render
                   (retarget: also argparse's usage error and `mkc`'s E-IO for an OSError)
    bad_diagnostic MkcError with a diagnostic lacking a location or hint, or failing to render
    traceback      any other exception (signature: type and innermost mkc frame); lsp: a
                   traceback on the server's stderr or in an answer
    bad_output     accepted, but the written module fails on import, overwrites a file it did
                   not create, or has a name that is not a safe module name; a retargeted spec
                   that fails `mkc check`, or a retarget that changed its input
    fmt_unstable   formatting the formatted text changes it again
    fmt_changed_meaning  the formatted text does not parse, or parses to another AST, or its
                   comments differ (trailing white space aside)
    hang           more CPU seconds than the case's timeout (--timeout times its target's
                   factor, the CPU of an lsp case's server included), or a minute of wall time
                   blocked without computing (signature: the outermost mkc frames of a stack
                   dump taken at the deadline); the worker is restarted;
                   lsp: a server that does not exit after shutdown and exit
    memory         MemoryError under the address-space cap
    crash          the worker process died; lsp: the server died or exited with a nonzero status
    lsp_unanswered a request of the session got no answer (result or JSON-RPC error)
    serve_harmed   a good request beside the hostile ones failed or answered otherwise than alone
                   (serve's other verdicts: a 5xx is a traceback, a refusal without OpenAI's
                   error body or an error event in a stream bad_output, no answer in 20 s a
                   hang, a dropped connection or a /health that stops answering a crash)

The package, by part: `cases` (the base specs, a case and what it writes), `mutations` (the
spec-text, config and model-path mutations), one module per target (`check`, `fmt`,
`retarget`, `checkpoint`, `lsp`, `serve`: its kinds and its run function), `targets` (their
registry, `make_case`, `reproducer`), `worker` (a case run and classified in a worker
process), `pool` (the workers), `report` and the command line (`__main__`, also
benchmarks/fuzz_campaign.py).

A case is a pure function of (seed, index) and the --target and --kind asked for, so `--only I`
reproduces it and `--emit DIR` writes its spec and files. Signatures of targets other than
check start with `[target]`. The exit status is 1 if any case is outside ok/diagnostic.
`tests/test_fuzz_specs.py` runs a smaller seeded campaign through the same generators.
"""
