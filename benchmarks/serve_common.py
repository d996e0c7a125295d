"""What benchmarks/serve_load.py and serve_eval.py share: the choice of a running server (--url)
or one started here (SPEC --model NAME, `mkc serve` options after `--`), their argument
checks, and running a measurement against either. Standard library only (serve_eval.py runs
in lm-eval's environment)."""
from __future__ import annotations

import argparse
import json
import shlex
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Callable, TypeVar

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

T = TypeVar("T")


class HarnessError(Exception):
    """A run that cannot start or go on: the message says why and what to do."""


def get_json(url: str, body: dict | None = None) -> tuple[int, Any]:
    """GET `url` (or POST `body` as JSON): the status and the JSON answer (None if it is not
    JSON). OSError (urllib's URLError is one) when the server cannot be reached."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            status, text = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, None


def served_model(url: str) -> tuple[str, int | None]:
    """The served model's name and context (`max_model_len`, which mkc serve and vLLM give),
    from GET /v1/models; HarnessError when the server cannot be reached or names no model."""
    try:
        status, models = get_json(url + "/v1/models")
    except OSError as e:
        raise HarnessError(f"cannot reach the server at {url} ({getattr(e, 'reason', e)}); is it "
                           "running? (start it with `mkc serve SPEC --model NAME`, or give SPEC "
                           "and --model instead of --url)") from None
    try:
        model = models["data"][0]
        return model["id"], model.get("max_model_len")
    except (TypeError, KeyError, IndexError):
        raise HarnessError(f"{url}/v1/models answered {status} without a model: is this an "
                           "OpenAI-compatible server?") from None


def server_stats(url: str) -> dict | None:
    """mkc serve's GET /stats (whether it runs in interpret mode, its steps); None from a
    server without it."""
    try:
        status, stats = get_json(url + "/stats")
    except OSError:
        return None
    return stats if status == 200 and isinstance(stats, dict) else None


def url_arg(text: str) -> str:
    """argparse type: an http(s) URL, without a trailing slash."""
    try:
        parts = urllib.parse.urlsplit(text)
        _ = parts.port                  # raises ValueError for a port out of range
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"'{text}' is not a URL ({e})")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise argparse.ArgumentTypeError(f"'{text}' is not an http:// or https:// URL (e.g. "
                                         "http://127.0.0.1:8000)")
    return text.rstrip("/")


def at_least(low: int) -> Callable[[str], int]:
    """argparse type: a whole number of at least `low`."""
    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            v = low - 1
        if v < low:
            raise argparse.ArgumentTypeError(f"expected a whole number of at least {low}, got '{text}'")
        return v
    return parse


def server_parser(doc: str) -> argparse.ArgumentParser:
    """A parser with the server's arguments (SPEC, --model, --url); the script adds its own."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0],
                                 usage="%(prog)s (--url URL | SPEC --model NAME) [options] "
                                       "[-- mkc serve options]")
    ap.add_argument("spec", nargs="?", help="a .sched file: start `mkc serve SPEC --model NAME` here")
    ap.add_argument("--model", help="with SPEC: the model to serve (a config name or checkpoint "
                                    "directory)")
    ap.add_argument("--url", type=url_arg, help="a running server, e.g. http://127.0.0.1:8000")
    return ap


def parse_server_args(ap: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """Parse argv; what follows `--` is kept as `serve_args` (options of `mkc serve`)."""
    ours, serve_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = ap.parse_args(ours)
    if (args.url is None) == (args.spec is None):
        ap.error("give either --url (a running server) or SPEC and --model (start one here)")
    if args.spec is not None and args.model is None:
        ap.error("SPEC needs --model NAME (the model mkc serve serves)")
    if args.url is not None and (args.model is not None or serve_args):
        ap.error("--model and `-- mkc serve options` start a server: not with --url")
    args.serve_args = serve_args
    return args


def exit_status(script: str, body: Callable[[], int]) -> int:
    """`body()`'s exit status; a HarnessError is said on stderr and exits 2, an interrupt 130."""
    try:
        return body()
    except HarnessError as e:
        print(f"{script}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{script}: interrupted", file=sys.stderr)
        return 130


def against_server(args: argparse.Namespace, run: Callable[[str], T], script: str) -> T:
    """`run(url)` against --url, or against `mkc serve SPEC --model NAME serve_args` started
    here (and stopped after); HarnessError when the server does not come up."""
    if args.url is not None:
        return run(args.url)
    from mkc.serve.launch import ServerError, running_server
    if not Path(args.spec).is_file():
        raise HarnessError(f"{args.spec}: no such spec file")
    print(f"{script}: starting mkc serve {args.spec} --model {args.model} {shlex.join(args.serve_args)}"
          " (a MINI model compiles for minutes in interpret mode)", file=sys.stderr, flush=True)
    try:
        with running_server(args.spec, args.model, args.serve_args) as url:
            return run(url)
    except ServerError as e:
        raise HarnessError(str(e)) from None
