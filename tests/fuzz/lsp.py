"""Hostile stdio sessions against `mkc lsp`: seeded raw frames (malformed headers, invalid JSON,
bad params, unknown methods, unopened documents) and a driver that sends them one at a time and
reports each request left unanswered, any traceback on stderr, whether the server died, and
its exit status after `exit` (None when it did not exit).

    python benchmarks/fuzz_lsp.py --seed 0 --sessions 3

Every request gets an answer: its result, or a JSON-RPC error (-32602 for bad params, -32601 for
an unknown method); a frame whose request cannot be read gets a -32700 / -32600 error with id
null. `shutdown` still answers at the end.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import random
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SPEC = ROOT / "schedules" / "qwen3_8_27b.sched"
SPEC_URI = "file:///tmp/mkc-fuzz-lsp/q.sched"          # opened from the frames, never read
STARTUP_TIMEOUT_S = 60.0                               # the first answer waits for the imports
_CONTENT_LENGTH = re.compile(rb"^Content-Length: (\d+)$", re.I | re.M)


def frame(message: dict | bytes, header: bytes | None = None) -> bytes:
    """One frame: `header` (default: the right Content-Length) and the JSON body."""
    body = message if isinstance(message, bytes) else json.dumps(message).encode()
    return (b"Content-Length: %d\r\n" % len(body) if header is None else header) + b"\r\n" + body


def request(msg_id: int | str, method: str, params: object) -> dict:
    return {"jsonrpc": "2.0", "id": msg_id, "method": method, "params": params}


def notification(method: str, params: object) -> dict:
    return {"jsonrpc": "2.0", "method": method, "params": params}


def position(uri: str, line: int, character: int) -> dict:
    return {"textDocument": {"uri": uri}, "position": {"line": line, "character": character}}


def opening(uri: str, text: str, version: int = 1) -> dict:
    return notification("textDocument/didOpen", {"textDocument": {
        "uri": uri, "languageId": "sched", "version": version, "text": text}})


def expected_answer(data: bytes) -> tuple[bool, object]:
    """(whether the server owes this frame an answer, the answer's id): a well-formed request
    is answered with its id, a frame the server cannot read as one with id null, a
    notification not at all."""
    head, sep, body = data.partition(b"\r\n\r\n")
    m = _CONTENT_LENGTH.search(head)
    if not sep or not m or int(m.group(1)) != len(body):
        return True, None
    try:
        message = json.loads(body)
    except (ValueError, RecursionError):
        return True, None
    if not isinstance(message, dict):
        return True, None
    if "method" not in message:                  # a response is not answered; neither id nor method is
        return "id" not in message, None
    if "id" not in message:
        return False, None
    msg_id = message["id"]
    return True, msg_id if isinstance(msg_id, (int, str)) and not isinstance(msg_id, bool) else None


def hostile_session(rng: random.Random, count: int = 16) -> list[bytes]:
    """A seeded session: initialize, open a spec, `count` hostile frames, then shutdown."""
    uri, frames = SPEC_URI, []
    ids = iter(range(1, 1 << 30))
    methods = ["textDocument/hover", "textDocument/definition", "textDocument/completion"]

    def valid() -> dict:
        return request(next(ids), rng.choice(methods), position(uri, rng.randrange(60), rng.randrange(40)))

    kinds = {
        "bad_length": lambda: frame(valid(), rng.choice(
            [b"Content-Length: abc\r\n", b"Content-Length: -5\r\n", b"Content-Length: 1e3\r\n",
             b"Content-Length:\r\n", b"Content-Length: 99999999999999999999\r\n"])),
        # (a frame with no header line at all is not here: after a bad frame, whose body the
        # server skips up to the next Content-Length, it reads as the rest of that body)
        "no_length": lambda: frame(valid(), rng.choice([b"Content-Type: application/json\r\n",
                                                        b"Content-Lenght: 12\r\n"])),
        "invalid_json": lambda: frame(rng.choice(
            [b'{"jsonrpc": "2.0", "id": 1, "method": ', b"not json", b"\xff\xfe{}", b"[" * 100000])),
        "not_an_object": lambda: frame(rng.choice([b"[]", b"42", b'"x"', b"null", b'[{"jsonrpc": "2.0"}]'])),
        "bad_id": lambda: frame(request(rng.choice([{"a": 1}, 1.5, True, [1]]), methods[0],
                                        position(uri, 0, 0))),
        "params_null": lambda: frame(request(next(ids), rng.choice(
            [*methods, "textDocument/formatting"]), None)),
        "bad_position": lambda: frame(request(next(ids), rng.choice(methods), {
            "textDocument": {"uri": uri},
            **rng.choice([{}, {"position": {"line": -1, "character": 0}},
                          {"position": {"line": 0, "character": -3}},
                          {"position": {"line": "x", "character": 0}},
                          {"position": {"line": 1 << 40, "character": 0}}])})),
        "unknown_method": lambda: frame(request(next(ids), "mkc/" + rng.choice(["nope", "x"]), {})),
        "unopened": lambda: frame(request(next(ids), rng.choice([*methods, "textDocument/formatting"]), {
            **position(rng.choice(["file:///nonexistent/x.sched", "file:///etc/passwd",
                                   SPEC.as_uri(), "untitled:1"]), 0, 0),
            "options": {"tabSize": 2, "insertSpaces": True}})),
        "bad_notification": lambda: frame(rng.choice(
            [notification("textDocument/didChange", None),
             notification("textDocument/didChange", {"textDocument": {"uri": "file:///nope", "version": 2},
                                                     "contentChanges": [{"text": "x"}]}),
             notification("textDocument/didOpen", {"textDocument": {"uri": uri}}),
             notification("mkc/nope", [1, 2])])),
        "valid": lambda: frame(valid()),
    }
    frames.append(frame(request(0, "initialize", {"processId": None, "rootUri": None, "capabilities": {}})))
    frames.append(frame(notification("initialized", {})))
    frames.append(frame(opening(uri, SPEC.read_text())))
    names = sorted(kinds)
    frames += [kinds[rng.choice(names)]() for _ in range(count)]
    frames.append(frame(request("shutdown", "shutdown", None)))
    return frames


def process_cpu(pid: int) -> float:
    """CPU seconds process `pid` has used, with its children: those waited for, and those
    still running (Linux: /proc)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        seconds = sum(int(f) for f in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0
    try:
        running = {int(c) for task in Path(f"/proc/{pid}/task").iterdir()
                   for c in (task / "children").read_text().split()}
    except (OSError, ValueError):
        running = set()
    return seconds + sum(process_cpu(c) for c in running)


class LspProcess:
    """`python -m mkc lsp` on pipes; threads collect what it writes (stdout as messages)."""

    def __init__(self, cwd: Path = ROOT):
        env = dict(os.environ, JAX_PLATFORMS="cpu",
                   PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        self.proc = subprocess.Popen([sys.executable, "-m", "mkc", "lsp"], cwd=cwd, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.messages: queue.Queue[dict] = queue.Queue()
        self.received: list[dict] = []           # every message taken from the queue so far
        self._stderr: list[bytes] = []
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=lambda: self._stderr.extend(iter(self.proc.stderr.readline, b"")),
                         daemon=True).start()

    def _read_stdout(self) -> None:
        out = self.proc.stdout
        while True:
            length = None
            while (line := out.readline()) not in (b"\r\n", b"\n"):
                if not line:
                    return
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            self.messages.put(json.loads(out.read(length)))

    def cpu_seconds(self) -> float:
        """The CPU time the server has used so far, with its children's."""
        return process_cpu(self.proc.pid)

    def send(self, data: bytes) -> bool:
        """Write raw bytes; False once the server no longer reads."""
        try:
            self.proc.stdin.write(data)
            self.proc.stdin.flush()
            return True
        except (BrokenPipeError, OSError):
            return False

    def wait_for(self, accept, timeout: float) -> dict | None:
        """The next message `accept`s (taking those before it), or None after `timeout` s."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                message = self.messages.get(timeout=left)
            except queue.Empty:
                return None
            self.received.append(message)
            if accept(message):
                return message
        return None

    def answer(self, msg_id: object, timeout: float) -> dict | None:
        return self.wait_for(lambda m: "method" not in m and m.get("id") == msg_id
                             and ("result" in m or "error" in m), timeout)

    def close(self, timeout: float = 10.0) -> tuple[int | None, str]:
        """Send `exit`, wait for the process with its input still open (an editor need not close
        it); (its exit status or None if it had to be killed, stderr)."""
        self.send(frame(notification("exit", None)))
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            code = None
        try:
            self.proc.stdin.close()
        except OSError:
            pass
        time.sleep(0.1)                          # let the stderr thread take the last lines
        return code, b"".join(self._stderr).decode(errors="replace")


def run_session(frames: list[bytes], timeout: float) -> dict:
    """Send `frames` one at a time to a fresh server, waiting up to `timeout` s for each answer
    owed (the first answer waits for startup too); what went wrong, and every answer by frame."""
    server = LspProcess()
    answers: dict[int, dict] = {}
    seconds: dict[int, float] = {}               # how long each answer took
    unanswered: list[str] = []
    for i, data in enumerate(frames):
        if server.proc.poll() is not None or not server.send(data):
            unanswered += [f"frame {j}: the server is gone" for j in range(i, len(frames))
                           if expected_answer(frames[j])[0]]
            break
        owed, msg_id = expected_answer(data)
        if owed:
            sent = time.monotonic()
            found = server.answer(msg_id, timeout if answers else max(timeout, STARTUP_TIMEOUT_S))
            if found is None:
                unanswered.append(f"frame {i}: no answer in {timeout} s to {data[:160]!r}")
            else:
                answers[i], seconds[i] = found, round(time.monotonic() - sent, 3)
    died = server.proc.poll() is not None
    code, stderr = server.close()
    tracebacks = [m for m in server.received if "traceback" in json.dumps(m).lower()]
    if "Traceback (most recent call last)" in stderr:
        tracebacks.append({"stderr": stderr[-3000:]})
    return {"unanswered": unanswered, "tracebacks": tracebacks, "died": died, "exit_code": code,
            "answers": answers, "seconds": seconds, "received": server.received, "stderr": stderr}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sessions", type=int, default=3)
    ap.add_argument("--frames", type=int, default=16, help="hostile frames per session")
    ap.add_argument("--timeout", type=float, default=1.0, help="seconds each answer may take")
    args = ap.parse_args()
    failed = 0
    for s in range(args.sessions):
        report = run_session(hostile_session(random.Random(f"{args.seed}:{s}"), args.frames), args.timeout)
        bad = report["unanswered"] or report["tracebacks"] or report["died"] or report["exit_code"] != 0
        failed += bool(bad)
        slowest = max(list(report["seconds"].items())[1:], key=lambda kv: kv[1], default=None)
        print(json.dumps({"session": s, "ok": not bad, "answers": len(report["answers"]), "slowest": slowest,
                          **{k: report[k] for k in ("unanswered", "tracebacks", "died", "exit_code")}}))
    return 1 if failed else 0


# ---- the campaign's `lsp` target -------------------------------------------------------------

SESSION_SECONDS = 10.0          # each owed answer of a case's session is awaited this long


def kinds() -> dict:
    """One kind: a hostile session (`hostile_session`) drawn in the worker."""
    def make(rng, b, case):
        case.desc = "a hostile LSP session (tests/fuzz/lsp.py)"
        return b.spec
    return {"lsp_session": (make, 1)}


def run(case, d: Path, res: dict) -> dict:
    """A hostile session with `mkc lsp` (`run_session`): a server that
    died or exited badly is a crash, one that did not exit on `exit` a hang, a traceback on its
    stderr or in an answer a traceback, a request it left unanswered lsp_unanswered."""
    res["stage"] = "session"
    frames = hostile_session(random.Random(f"mkc-fuzz-lsp:{case.seed}:{case.index}"))
    out = run_session(frames, SESSION_SECONDS)
    if out["died"] or out["exit_code"] not in (0, None):
        return {"cls": "crash", "sig": f"server died (exit status {out['exit_code']})",
                "detail": out["stderr"][-400:]}
    if out["tracebacks"]:
        first = json.dumps(out["tracebacks"][0])        # its innermost mkc frame is the signature
        where = re.findall(r'/(mkc/[\w/]+\.py)\\?", line \d+, in (\w+)', first)
        return {"cls": "traceback", "detail": first[-600:],
                "sig": "traceback @ " + (":".join(where[-1]) if where else "no mkc frame")}
    if out["unanswered"]:
        return {"cls": "lsp_unanswered", "sig": f"{len(out['unanswered'])} requests unanswered",
                "detail": "\n".join(out["unanswered"][:4])}
    if out["exit_code"] is None:
        return {"cls": "hang", "sig": "server did not exit after shutdown and exit",
                "detail": out["stderr"][-400:]}
    return {"cls": "ok"}
