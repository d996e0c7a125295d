"""Run lm-eval (EleutherAI's lm-evaluation-harness) against an OpenAI-compatible server (`mkc
serve`) on a small task, through lm-eval's own `local-completions` or `local-chat-completions`
model.

    python benchmarks/serve_eval.py --url http://127.0.0.1:8000 [--api completions|chat]
        [--task arith|gsm8k|...] [--limit N] [--num-concurrent N]
    python benchmarks/serve_eval.py SPEC --model NAME [options] [-- mkc serve options]

lm-eval is not a dependency of mkc: install it where this runs with `pip install "lm-eval[api]"`,
or in a venv of its own, named by `--lm-eval-python PYTHON` (lm-eval only talks to the server).
The server's tokenizer is the one used: `local-completions` reads it through the server
(`tokenizer_backend=remote`: GET /tokenizer_info, POST /tokenize and /detokenize) and sends
token ids, which loglikelihood requests need (`echo` with `logprobs`: lm-eval counts the
context's tokens); `local-chat-completions` sends text (`tokenizer_backend=none`). So lm-eval
needs no tokenizer of its own, and the server needs one: a checkpoint directory's, or for a
model without one (a MINI config) `mkc serve --tokenizer bytes`, a byte-level stand-in (when
this script starts the server for a config name it adds that).

`--task arith` (the default) is a bundled generation task of eight short sums, `--task sums` a
bundled multiple-choice one (loglikelihood requests) of three, both made here and run offline:
short prompts, a few tokens, so a MINI model in interpret mode gets through them in minutes.
For a trained model (SmolLM2-135M-Instruct on `--backend emulation`), `--task capitals` is a
generation task of sixteen capitals to complete and `--task facts` a multiple-choice one of
sixteen general-knowledge questions, four answers each (benchmarks/smollm2_quality.py scores
the same items in process, per rounding format).
Any lm-eval task name works too (`gsm8k` downloads its dataset). On a MINI model the scores
mean nothing: the harness working is the point.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path

from serve_common import (HarnessError, against_server, at_least, exit_status, get_json,
                          parse_server_args, served_model, server_parser, server_stats)

INSTALL = 'pip install "lm-eval[api]"'
ARITH = [(2, 3), (7, 5), (12, 30), (9, 9), (41, 17), (6, 58), (23, 23), (80, 11)]
ARITH_TASK = "arith"
ARITH_NAME = "mkc_arith"          # the task's name inside lm-eval (not to clash with its own)
# digits and signs only: every byte is a token of any stand-in's vocabulary of 64 or more
SUMS = [("2+3=", ["5", "6"], 0), ("4+4=", ["9", "8"], 1), ("1+1=", ["2", "3"], 0)]
SUMS_TASK, SUMS_NAME = "sums", "mkc_sums"
# For a trained model (SmolLM2-135M-Instruct): short general knowledge, written here. A capital
# to complete (generation), and a question with four answers (multiple choice).
CAPITALS = [("France", "Paris"), ("Germany", "Berlin"), ("Italy", "Rome"), ("Spain", "Madrid"),
            ("Japan", "Tokyo"), ("Russia", "Moscow"), ("England", "London"), ("Egypt", "Cairo"),
            ("Greece", "Athens"), ("Portugal", "Lisbon"), ("Ireland", "Dublin"), ("Austria", "Vienna"),
            ("Norway", "Oslo"), ("Poland", "Warsaw"), ("China", "Beijing"), ("Canada", "Ottawa")]
CAPITALS_TASK, CAPITALS_NAME = "capitals", "mkc_capitals"
FACTS = [("How many legs does a spider have?", ["eight", "six", "four", "ten"], 0),
         ("What color is the sky on a clear day?", ["green", "blue", "red", "black"], 1),
         ("Which animal is known as the king of the jungle?", ["mouse", "cow", "lion", "frog"], 2),
         ("What do bees make?", ["milk", "silk", "wool", "honey"], 3),
         ("Which planet do we live on?", ["Earth", "Mars", "Venus", "Jupiter"], 0),
         ("What is frozen water called?", ["steam", "ice", "sand", "salt"], 1),
         ("How many days are there in a week?", ["five", "ten", "seven", "twelve"], 2),
         ("Which season comes after winter?", ["autumn", "summer", "winter", "spring"], 3),
         ("What do plants need from the sun to grow?", ["light", "noise", "sugar", "metal"], 0),
         ("Which organ pumps blood through the body?", ["lung", "heart", "liver", "brain"], 1),
         ("What is the largest ocean on Earth?", ["Arctic", "Indian", "Pacific", "Atlantic"], 2),
         ("What gas do humans need to breathe?", ["helium", "neon", "carbon", "oxygen"], 3),
         ("How many hours are there in a day?", ["twenty-four", "twelve", "sixty", "ten"], 0),
         ("Which animal gives us milk?", ["snake", "cow", "shark", "eagle"], 1),
         ("What is the opposite of hot?", ["warm", "loud", "cold", "fast"], 2),
         ("Which instrument has black and white keys?", ["drum", "flute", "violin", "piano"], 3)]
FACTS_TASK, FACTS_NAME = "facts", "mkc_facts"
MODELS = {"completions": ("local-completions", "/v1/completions"),
          "chat": ("local-chat-completions", "/v1/chat/completions")}


def _write_task(directory: Path, stem: str, rows: list[dict], config: dict) -> None:
    """A bundled task into `directory` (for lm-eval's --include_path): `rows` as JSON lines in
    `stem`.jsonl, and `config` (JSON, which YAML reads) with the data named by absolute path."""
    data = directory / f"{stem}.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in rows))
    full = {"task": config.pop("task"), "dataset_path": "json",
            "dataset_kwargs": {"data_files": {"test": str(data)}}, "test_split": "test",
            **config, "metadata": {"version": 1.0}}
    (directory / f"mkc_{stem}.yaml").write_text(json.dumps(full, indent=2) + "\n")


def write_arith_task(directory: Path) -> None:
    """The bundled generation task into `directory`."""
    _write_task(directory, "arith", [{"question": f"{a} + {b} =", "answer": str(a + b)}
                                     for a, b in ARITH], {
        "task": ARITH_NAME, "output_type": "generate_until",
        "doc_to_text": "Question: {{question}}\nAnswer:", "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": ["\n"], "max_gen_toks": 4, "do_sample": False,
                              "temperature": 0},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": True}]})


def write_sums_task(directory: Path) -> None:
    """The bundled multiple-choice task into `directory`."""
    _write_task(directory, "sums", [{"question": q, "choices": c, "gold": g} for q, c, g in SUMS], {
        "task": SUMS_NAME, "output_type": "multiple_choice", "doc_to_text": "{{question}}",
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]})


# The trained model's generation task: its answer up to a new line or full stop, compared with
# the capital's name ignoring case, punctuation and spaces (its leading space included).
CAPITALS_PROMPT = "The capital of {country} is"
CAPITALS_UNTIL, CAPITALS_TOKENS = ["\n", "."], 6
FACTS_PROMPT = "Question: {question}\nAnswer:"     # each choice follows after one space


def write_capitals_task(directory: Path) -> None:
    """The trained model's generation task into `directory`."""
    _write_task(directory, "capitals", [{"country": c, "answer": a} for c, a in CAPITALS], {
        "task": CAPITALS_NAME, "output_type": "generate_until",
        "doc_to_text": CAPITALS_PROMPT.replace("{country}", "{{country}}"),
        "doc_to_target": "{{answer}}",
        "generation_kwargs": {"until": CAPITALS_UNTIL, "max_gen_toks": CAPITALS_TOKENS,
                              "do_sample": False, "temperature": 0},
        "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True,
                         "ignore_case": True, "ignore_punctuation": True,
                         "regexes_to_ignore": [" "]}]})


def write_facts_task(directory: Path) -> None:
    """The trained model's multiple-choice task into `directory`."""
    _write_task(directory, "facts", [{"question": q, "choices": c, "gold": g} for q, c, g in FACTS], {
        "task": FACTS_NAME, "output_type": "multiple_choice",
        "doc_to_text": FACTS_PROMPT.replace("{question}", "{{question}}"),
        "doc_to_choice": "{{choices}}", "doc_to_target": "{{gold}}",
        "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}]})


BUNDLED = {ARITH_TASK: (ARITH_NAME, write_arith_task), SUMS_TASK: (SUMS_NAME, write_sums_task),
           CAPITALS_TASK: (CAPITALS_NAME, write_capitals_task), FACTS_TASK: (FACTS_NAME, write_facts_task)}


def probe(url: str, api: str) -> tuple[str, int | None, bool]:
    """The served model's name and context, and whether mkc serve runs it in interpret mode;
    HarnessError when the server cannot be reached or (mkc serve's /tokenize says) has no
    tokenizer or chat template for what lm-eval will send."""
    model, context = served_model(url)
    check = {"messages": [{"role": "user", "content": "1"}]} if api == "chat" else {"prompt": "1"}
    try:
        status, answer = get_json(url + "/tokenize", check)
    except OSError:
        status, answer = None, None
    if status == 400 and isinstance(answer, dict):
        said = (answer.get("error") or {}).get("message", "").split(" (")[0]    # not its own hints
        raise HarnessError(f"the server cannot take lm-eval's text ({said}); lm-eval sends text, "
                           "so the server needs a tokenizer (and a chat template for --api chat): "
                           "serve a checkpoint directory that has one, or a model without one (a "
                           "MINI config) with `mkc serve ... --tokenizer bytes`")
    return model, context, bool((server_stats(url) or {}).get("interpret"))


def lm_eval_command(url: str, model: str, context: int | None, args: argparse.Namespace,
                    include: Path | None) -> list[str]:
    """The lm-eval command line for the server at `url`."""
    kind, path = MODELS[args.api]
    remote = args.api == "completions"
    model_args = {"model": model, "base_url": url + path,
                  "tokenizer_backend": "remote" if remote else "none",
                  "tokenized_requests": str(remote), "num_concurrent": args.num_concurrent,
                  "max_retries": 3, "timeout": args.timeout}
    if context is not None:
        model_args["max_length"] = context
    cmd = [args.lm_eval_python or sys.executable, "-m", "lm_eval", "--model", kind,
           "--model_args", ",".join(f"{k}={v}" for k, v in model_args.items()),
           "--tasks", BUNDLED[args.task][0] if args.task in BUNDLED else args.task]
    if args.limit is not None:
        cmd += ["--limit", str(args.limit)]
    if args.num_fewshot is not None:
        cmd += ["--num_fewshot", str(args.num_fewshot)]
    if args.max_gen_toks is not None:
        cmd += ["--gen_kwargs", f"max_gen_toks={args.max_gen_toks}"]
    if args.api == "chat":
        cmd.append("--apply_chat_template")
    if include is not None:
        cmd += ["--include_path", str(include)]
    if args.output_path:
        cmd += ["--output_path", args.output_path, "--log_samples"]
    return cmd


def evaluate(url: str, args: argparse.Namespace) -> int:
    """Probe the server, run lm-eval against it (its output passes through); lm-eval's status."""
    model, context, interpret = probe(url, args.api)
    with tempfile.TemporaryDirectory(prefix="mkc-eval-") as tmp:
        include = None
        if args.task in BUNDLED:
            include = Path(tmp)
            BUNDLED[args.task][1](include)
        cmd = lm_eval_command(url, model, context, args, include)
        print(f"serve_eval: {shlex.join(cmd)}", file=sys.stderr, flush=True)
        status = subprocess.run(cmd).returncode
    if interpret:
        print("serve_eval: NOTE: the server runs in TPU interpret mode on CPU (a MINI model): the "
              "scores mean nothing; the harness ran", file=sys.stderr)
    return status


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The options; what follows `--` goes to `mkc serve` (as `serve_args`)."""
    ap = server_parser(__doc__)
    ap.add_argument("--api", choices=tuple(MODELS), default="completions",
                    help="lm-eval's local-completions (default) or local-chat-completions")
    ap.add_argument("--task", default=ARITH_TASK,
                    help=f"an lm-eval task, or one bundled: '{ARITH_TASK}' (default): eight short sums "
                         f"to generate, '{SUMS_TASK}': three to choose (multiple choice); for a trained "
                         f"model '{CAPITALS_TASK}' (generate) and '{FACTS_TASK}' (multiple choice)")
    ap.add_argument("--limit", type=at_least(1), default=4,
                    help="samples of the task (default 4; lm-eval's --limit)")
    ap.add_argument("--num-fewshot", type=at_least(0), help="lm-eval's --num_fewshot (default: the task's)")
    ap.add_argument("--max-gen-toks", type=at_least(1),
                    help="tokens a generation may have (default: the task's)")
    ap.add_argument("--num-concurrent", type=at_least(1), default=1,
                    help="requests lm-eval keeps in flight (default 1; past the server's --batch "
                         "they only wait for a row)")
    ap.add_argument("--timeout", type=at_least(1), default=600,
                    help="seconds lm-eval waits for a request (default 600: interpret mode is slow)")
    ap.add_argument("--lm-eval-python", help="the Python that runs lm-eval (default this one): lm-eval "
                    "is a client of the server, so it may live in a venv of its own")
    ap.add_argument("--output-path", help="lm-eval's --output_path (results and samples as JSON)")
    return parse_server_args(ap, argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.lm_eval_python is not None:
        found = subprocess.run([args.lm_eval_python, "-c", "import lm_eval"], capture_output=True)
        if found.returncode != 0:
            print(f"serve_eval: --lm-eval-python {args.lm_eval_python} cannot import lm_eval; "
                  f"install it there with:\n    {args.lm_eval_python} -m {INSTALL}", file=sys.stderr)
            return 2
    elif find_spec("lm_eval") is None:
        print(f"serve_eval: lm-eval is not installed (it is not a dependency of mkc); install it "
              f"into this Python with:\n    {sys.executable} -m {INSTALL}\nor give "
              "--lm-eval-python, a Python (another venv's) that has it", file=sys.stderr)
        return 2
    if args.url is None and not Path(args.model).is_dir() and "--tokenizer" not in args.serve_args:
        args.serve_args += ["--tokenizer", "bytes"]     # a config name: random weights, no tokenizer
    return exit_status("serve_eval", lambda: against_server(args, lambda url: evaluate(url, args),
                                                           "serve_eval"))


if __name__ == "__main__":
    sys.exit(main())
