"""The spec-text, config and model-path mutations of the shipped specs (`MUTATIONS`): the
`check` target's kinds, and (those of the spec text, `SPEC_TEXT_KINDS`) the `fmt` target's."""
from __future__ import annotations

import json
import math
import re

from fuzz.cases import CONFIG_DIR, Base, Case, shown, split_lines


TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|\d+x\d+(?:x\d+)?|\d+|->|\"[^\"]*\"|[{}:;,=()/]")
REPLACEMENTS = ["0", "1", "3", "7", "999999999", "x", "gdn", "gqa", "start", "end", "next",
                "wait", "load", "store", "{", "}", ";", ",", "->", '"qwen3_8_mini"', "bf16",
                "f32", "tp", "state.conv", "before", "after", "two_level", "host", "chip",
                "kda", "mla", "moe", "dense", "pool", "view", "slots", "expert", "prefetch",
                "fetch", "experts", "allgather", "exchange", "sibling", "staging.experts",
                "staging.attention", "/", "(", ")", "route", "routed_experts", "over", "scoped",
                "kv", "tiles", "ring", "stream", "then", "lm_head", "parity", "vectors", "mesh",
                "shard", "phase", "schedule", "model", "target", "batch", "context", "vmem",
                "limit", "reserve", "MiB", "GiB", "KiB", "2x2x1", "direct", "wire", "with",
                "verify", "sequences", "to", "8", "16", "32", "heads", "mlp", "vocab",
                "expert_mlp", "latent_up", "tpu7x", "v6e", "v5e", "v5p", "v4", "2x4", "2x2x8",
                "moe", "shared_gate_up", "router", "gate_up", "down", "attention", "run",
                "latent_down"]
HUGE_DIGITS = "1" + "0" * 4300                     # 4301 digits: past int()'s default limit
EXTREME_INTS = ["0", "1", "2", "127", "128", "129", "255", "2147483647", "2147483648",
                "4294967296", "9223372036854775807", "9223372036854775808",
                "18446744073709551616", "999999999999999999999999999999", HUGE_DIGITS,
                "9" * 5000, "00", "0008"]
TOPOLOGIES = ["99999999x2x1", "0x0x0", "0x2x2", "2x2x0", "1x1x1", "1x1x2", "2x1x1", "4x4x4",
              "2x2x8", "16x16x16", "2147483648x1x1", "9223372036854775808x1x1", "1x1x99999999",
              "2x2x1", "2x2x2", "2x2x4", "1" * 30 + "x1x1", "2x4", "4x4", "1x1", "2x2", "8x16",
              "0x4", "2x4x1x1", "2", "4x8", "16x16", "99999999x99999999"]
# generations JAX knows, ones it refuses (v2, v3, v4i) and ones that do not exist
GENERATIONS = ["tpu7x", "v6e", "v5e", "v5p", "v4", "v4i", "v3", "v2", "v7", "tpu8", "TPU7X",
               "v5litepod", "v6 lite"]
TILE_BOUNDS = ["2147483648 x 1280", "1024 x 2147483648", "0 x 0", "1 x 1", "128 x 128",
               "127 x 1280", "1024 x 127", "9223372036854775808 x 9223372036854775808",
               "99999999 x 99999999", "256 x 256", "4096 x 4096", "65536 x 65536", "129 x 129"]
CONTEXTS = ["0", "1", "2", "127", "128", "129", "4097", "65536", "1048576", "16777216",
            "2147483648", "1099511627776", "1000000000000000000000000000000"]
ODD_UNICODE = ["\u00a0", "\u200b", "\u202e", "\ufeff", "é", "１", "٣", "\u2028", "\u0085",
               "\x00", "\x0c", "\x0b", "\x1b", "\r", "\t", "𝟘", "ǅ", "ﬁ", "İ", "\U0001F600",
               "\u0301", "ß", "K"]
BAD_BYTES = [b"\xff", b"\xfe", b"\x80", b"\xc3\x28", b"\xe9", b"\xed\xa0\x80", b"\xf4\x90\x80\x80",
             b"\xc0\xaf", b"\xe2\x82"]
NAMES = ["__init__", "os", "sys", "class", "None", "True", "import", "jax", "numpy", "mkc",
         "__main__", "_", "a" * 300, "types", "functools", "np", "lax", "pl", "builtins",
         "generated", "test", "pytest", "json", "model", "schedule"]
MODEL_DIR_NAMES = ["my-model", "1model", "model.v2", "mödel", "a b", "__init__", "class", "os",
                   "None", "", "-", "x" * 250]


def _token_spans(text: str) -> list[tuple[int, int]]:
    comments = [m.span() for m in re.finditer(r"#[^\n]*", text)]
    return [m.span() for m in TOKEN.finditer(text)
            if not any(a <= m.start() < b for a, b in comments)]


def _int_spans(text: str) -> list[tuple[int, int]]:
    """Every integer a parser reads: INT tokens and the three numbers of a topology."""
    comments = [m.span() for m in re.finditer(r"#[^\n]*", text)]
    spans = [m.span() for m in re.finditer(r"(?<![A-Za-z0-9_])\d+(?=x\d|[^A-Za-z0-9_]|$)|(?<=\dx)\d+",
                                           text)]
    return [s for s in spans if not any(a <= s[0] < b for a, b in comments)]


def _code_lines(text: str) -> list[int]:
    return [i for i, ln in enumerate(split_lines(text)) if ln.strip() and not ln.strip().startswith("#")]


def _sub(text: str, span: tuple[int, int], new: str) -> str:
    return text[:span[0]] + new + text[span[1]:]


def _where(text: str, pos: int) -> str:
    line = text.count("\n", 0, pos) + 1
    return f"{line}:{pos - (text.rfind(chr(10), 0, pos) + 1) + 1}"


def mut_token_delete(rng, b: Base, case: Case):
    s = rng.choice(_token_spans(b.spec))
    case.desc = f"delete token {shown(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])}"
    return _sub(b.spec, s, "")


def mut_token_replace(rng, b: Base, case: Case):
    s = rng.choice(_token_spans(b.spec))
    new = rng.choice(REPLACEMENTS)
    case.desc = f"replace token {shown(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])} with {new!r}"
    return _sub(b.spec, s, new)


def mut_token_duplicate(rng, b: Base, case: Case):
    s = rng.choice(_token_spans(b.spec))
    case.desc = f"duplicate token {shown(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])}"
    return b.spec[:s[1]] + " " + b.spec[s[0]:s[1]] + b.spec[s[1]:]


def mut_number_extreme(rng, b: Base, case: Case):
    s = rng.choice(_int_spans(b.spec))
    new = rng.choice(EXTREME_INTS)
    case.desc = f"number {b.spec[s[0]:s[1]]} at {_where(b.spec, s[0])} -> {shown(new, 30)}"
    return _sub(b.spec, s, new)


def mut_topology(rng, b: Base, case: Case):
    m = re.search(r"target\s+(\S+)\s+topology\s+(\S+)", b.spec)
    topo = rng.choice(TOPOLOGIES)
    text = _sub(b.spec, m.span(2), topo)
    case.desc = f"topology {m.group(2)} -> {shown(topo, 40)}"
    if rng.random() < 0.3:                      # and another generation
        gen = rng.choice(GENERATIONS)
        text = _sub(text, m.span(1), gen)
        case.desc = f"target {m.group(1)} -> {gen}, " + case.desc
    if rng.random() < 0.5:                      # and a mesh over every core of it
        cores = rng.choice([1, 2]) * math.prod(int(v) for v in topo.split("x") if v.isdigit())
        text = re.sub(r"tp = \d+", f"tp = {cores}", text)
        case.desc += f", mesh tp = {shown(str(cores), 40)}"
    return text


def mut_tile_bound(rng, b: Base, case: Case):
    m = re.search(r"up to (\d+ x \d+)", b.spec)
    new = rng.choice(TILE_BOUNDS)
    case.desc = f"ring tile bound {m.group(1)} -> {new}"
    return _sub(b.spec, m.span(1), new)


def mut_context(rng, b: Base, case: Case):
    m = re.search(r"context (\d+)", b.spec)
    new = rng.choice(CONTEXTS)
    case.desc = f"context {m.group(1)} -> {new}"
    return _sub(b.spec, m.span(1), new)


def mut_unicode(rng, b: Base, case: Case):
    ch = rng.choice(ODD_UNICODE)
    spans = _token_spans(b.spec)
    mode = rng.randrange(4)
    if mode == 0:                                   # inside a token
        s = rng.choice(spans)
        pos = rng.randrange(s[0], s[1] + 1)
        case.desc = f"insert {ch!r} into token {shown(b.spec[s[0]:s[1]])} at {_where(b.spec, pos)}"
        return b.spec[:pos] + ch + b.spec[pos:]
    if mode == 1:                                   # between tokens
        s = rng.choice(spans)
        case.desc = f"insert {ch!r} before token {shown(b.spec[s[0]:s[1]])} at {_where(b.spec, s[0])}"
        return b.spec[:s[0]] + ch + " " + b.spec[s[0]:]
    if mode == 2:                                   # replace a token's character
        s = rng.choice(spans)
        pos = rng.randrange(s[0], s[1])
        case.desc = f"replace {b.spec[pos]!r} at {_where(b.spec, pos)} with {ch!r}"
        return b.spec[:pos] + ch + b.spec[pos + 1:]
    case.desc = f"prepend {ch!r} to the file"       # e.g. a BOM
    return ch + b.spec


def mut_bytes(rng, b: Base, case: Case):
    raw = b.spec.encode()
    bad = rng.choice(BAD_BYTES)
    mode = rng.randrange(4)
    if mode == 0:
        pos = rng.randrange(len(raw) + 1)
        case.desc = f"insert bytes {bad!r} at byte {pos}"
        return raw[:pos] + bad + raw[pos:]
    if mode == 1:
        pos = raw.index(b"#")
        case.desc = f"insert bytes {bad!r} in the first comment"
        return raw[:pos + 1] + bad + raw[pos + 1:]
    if mode == 2:
        pos = raw.index(b'"') + 1
        case.desc = f"insert bytes {bad!r} inside the model string"
        return raw[:pos] + bad + raw[pos:]
    enc = rng.choice(["utf-16", "utf-32", "latin-1"])
    case.desc = f"the whole file encoded as {enc}"
    return (b.spec.replace("#", "# é", 1)).encode(enc)


def mut_line_duplicate(rng, b: Base, case: Case):
    lines = split_lines(b.spec)
    i = rng.choice(_code_lines(b.spec))
    case.desc = f"duplicate line {i + 1}: {lines[i].strip()!r}"
    return "".join(lines[:i + 1] + [lines[i]] + lines[i + 1:])


def mut_line_swap(rng, b: Base, case: Case):
    lines = split_lines(b.spec)
    code = _code_lines(b.spec)
    i = rng.choice(code)
    j = rng.choice([k for k in code if abs(k - i) <= 2 and k != i] if rng.random() < 0.6 else code)
    if i == j:
        j = code[(code.index(i) + 1) % len(code)]
    lines[i], lines[j] = lines[j], lines[i]
    case.desc = f"swap lines {min(i, j) + 1} and {max(i, j) + 1}"
    return "".join(lines)


def mut_line_delete(rng, b: Base, case: Case):
    lines = split_lines(b.spec)
    i = rng.choice(_code_lines(b.spec))
    case.desc = f"delete line {i + 1}: {lines[i].strip()!r}"
    return "".join(lines[:i] + lines[i + 1:])


def mut_line_repeat(rng, b: Base, case: Case):
    lines = split_lines(b.spec)
    i = rng.choice(_code_lines(b.spec))
    n = rng.choice([3, 10, 100, 1000, 5000])
    case.desc = f"repeat line {i + 1} {n} times: {lines[i].strip()!r}"
    return "".join(lines[:i + 1] + [lines[i]] * (n - 1) + lines[i + 1:])


def _blocks(text: str) -> list[tuple[int, int]]:
    """(first, last) line indexes of the `{ ... }` blocks inside the schedule."""
    lines = split_lines(text)
    out = []
    for i, ln in enumerate(lines):
        if ln.startswith("  ") and not ln.startswith("   ") and ln.rstrip().endswith("{"):
            j = next(k for k in range(i + 1, len(lines)) if lines[k].rstrip() == "  }")
            out.append((i, j))
    return out


def mut_block(rng, b: Base, case: Case):
    lines = split_lines(b.spec)
    i, j = rng.choice(_blocks(b.spec))
    head = lines[i].strip()
    mode = rng.randrange(3)
    if mode == 0:
        case.desc = f"duplicate block {head!r} (lines {i + 1}-{j + 1})"
        return "".join(lines[:j + 1] + lines[i:j + 1] + lines[j + 1:])
    if mode == 1:
        case.desc = f"delete block {head!r} (lines {i + 1}-{j + 1})"
        return "".join(lines[:i] + lines[j + 1:])
    n = rng.choice([10, 200])
    case.desc = f"repeat block {head!r} {n} times"
    return "".join(lines[:j + 1] + lines[i:j + 1] * (n - 1) + lines[j + 1:])


def mut_truncate(rng, b: Base, case: Case):
    pos = rng.randrange(len(b.spec))
    case.desc = f"truncate at {_where(b.spec, pos)} (char {pos} of {len(b.spec)})"
    return b.spec[:pos]


_ITEM = r"[A-Za-z_][\w.]*(?:\s*->\s*[A-Za-z_][\w.]*)?"        # `o_proj`, `state.conv -> conv_buf`
# a comma-separated list (two or more items), or one item alone after `KEY:` (a stream line)
_LIST = re.compile(rf"{_ITEM}(?:[ \t]*,[ \t]*{_ITEM})+|(?<=:)[ \t]*{_ITEM}(?=[ \t]*(?:#|$))", re.M)


def _lists(text: str) -> list[tuple[int, int]]:
    """Spans of the item lists outside comments and strings."""
    skip = [m.span() for m in re.finditer(r'"[^"\n]*"|#[^\n]*', text)]
    return [m.span() for m in _LIST.finditer(text)
            if not any(a <= m.start() < b or a < m.end() <= b for a, b in skip)]


def mut_list_duplicate(rng, b: Base, case: Case):
    """An item of a list written twice: at the list's end (`..., down, down`) or beside itself."""
    lo, hi = rng.choice(_lists(b.spec))
    items = [m for m in re.finditer(_ITEM, b.spec[lo:hi])]
    item = rng.choice(items)
    word = item.group()
    if rng.random() < 0.5:
        case.desc = f"list at {_where(b.spec, lo)}: {word!r} again at the end"
        return b.spec[:hi] + ", " + word + b.spec[hi:]
    at = lo + item.end()
    case.desc = f"list at {_where(b.spec, lo)}: {word!r} again after itself"
    return b.spec[:at] + ", " + word + b.spec[at:]


# what str.splitlines() (and editors) break lines at, besides "\n"; lark counts only "\n"
LINE_BREAKS = ["\r", "\u2028", "\u2029", "\f", "\x0b", "\x85"]


def mut_line_break(rng, b: Base, case: Case):
    """A run of odd line-break characters inside a comment, at a line's end, in place of a
    line's "\n", or every line end written "\r" or "\r\n"."""
    run = "".join(rng.choice(LINE_BREAKS) for _ in range(rng.choice([1, 1, 2, 3])))
    lines = split_lines(b.spec)
    comment = [i for i, ln in enumerate(lines) if "#" in ln]
    mode = rng.randrange(6)
    if mode == 5:
        end = rng.choice(["\r", "\r\n"])
        case.desc = f"every line ends in {end!r}"
        return b.spec.replace("\n", end)
    i = rng.choice(comment if mode in (0, 1, 3) else _code_lines(b.spec))
    ln = lines[i]
    body = ln.rstrip("\n")
    if mode == 0:                                       # inside a comment
        pos = rng.randrange(ln.index("#") + 1, len(body) + 1)
        lines[i] = ln[:pos] + run + ln[pos:]
        case.desc = f"{run!r} inside the comment on line {i + 1}"
    elif mode in (1, 2):                                # at the end of a (comment or code) line
        lines[i] = body + run + ln[len(body):]
        case.desc = f"{run!r} at the end of line {i + 1}"
    else:                                               # in place of the line's "\n"
        lines[i] = body + run
        case.desc = f"{run!r} in place of line {i + 1}'s line feed"
    return "".join(lines)


MODEL_PATHS = ["/dev/zero", "/dev/null", "/dev/urandom", "/", ".", "..", "", "emptydir",
               "dir_with_dir_config", "fifo", "loop", "dangling", "/etc/passwd", "/etc",
               "/proc/self/status", "qwen3_8_mini\x00", "x" * 5000, "a/" * 3000 + "config.json",
               "~/config.json", "*", "qwen3_8_mini.json", "configs/qwen3_8_mini", "-", "\u202e",
               "empty.json", "spec.sched", "../../../../../../etc/hostname"]


def mut_model_path(rng, b: Base, case: Case):
    path = rng.choice(MODEL_PATHS)
    case.files += [("dir", "emptydir", None), ("dir", "dir_with_dir_config/config.json", None),
                   ("fifo", "fifo", None), ("symlink", "loop", "loop"),
                   ("symlink", "dangling", "nowhere/config.json"), ("file", "empty.json", b"")]
    if rng.random() < 0.5:
        case.model = path
        case.desc = f"--model {shown(path, 50)}"
        return b.spec
    case.model = None
    case.desc = f"model line {shown(path, 50)}"
    return re.sub(r'model\s+"[^"]*"', lambda _: 'model "' + path.replace('"', "") + '"', b.spec,
                  count=1)


def _leaves(obj, path=()):
    """(path, value) of every leaf and every container below the root."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield path + (k,), v
            if isinstance(v, (dict, list)):
                yield from _leaves(v, path + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield path + (i,), v
            if isinstance(v, (dict, list)):
                yield from _leaves(v, path + (i,))


NUMERIC_VALUES = ["NaN", "Infinity", "-Infinity", "-1", "0", "1", "2147483648",
                  "9223372036854775808", "1e30", "1000000000000000000000000000000", "1e308",
                  "1e-320", "0.5", "1.0000001", "-0.0", HUGE_DIGITS, "true", '"8"', "null", "[]"]
OTHER_VALUES = ["null", "[]", "{}", '"x"', "1", "[1, 2]", "NaN", "true", '""']


def _set(obj, path, value):
    for k in path[:-1]:
        obj = obj[k]
    if value is _DELETE:
        del obj[path[-1]]
    else:
        obj[path[-1]] = value


_DELETE = object()


def _config_text(raw: dict, path, literal: str | None) -> str:
    """The config with the value at path replaced by a JSON literal (or deleted if None)."""
    raw = json.loads(json.dumps(raw))
    if literal is None:
        _set(raw, path, _DELETE)
        return json.dumps(raw, indent=2)
    _set(raw, path, "@@VALUE@@")
    return json.dumps(raw, indent=2).replace('"@@VALUE@@"', literal)


def _use_config(rng, b: Base, case: Case, text: bytes, what: str) -> str:
    if rng.random() < 0.5:
        case.files.append(("file", "cfg/config.json", text))
        where = "cfg"
    else:
        case.files.append(("file", "cfg.json", text))
        where = "cfg.json"
    if rng.random() < 0.7:
        case.model = where
        case.desc = f"--model {where} with {what}"
        return b.spec
    case.model = None
    case.desc = f"model line {where!r} with {what}"
    return re.sub(r'model\s+"[^"]*"', f'model "{where}"', b.spec, count=1)


def mut_config_value(rng, b: Base, case: Case):
    raw = json.loads((CONFIG_DIR / f"{b.config}.json").read_text())
    path, value = rng.choice(list(_leaves(raw)))
    numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
    literal = rng.choice(NUMERIC_VALUES if numeric else OTHER_VALUES)
    if rng.random() < 0.05:
        literal = None
    key = ".".join(map(str, path))
    what = f"{key} deleted" if literal is None else f"{key} = {shown(literal, 30)}"
    case.compile = True
    return _use_config(rng, b, case, _config_text(raw, path, literal).encode(), f"config {what}")


CONFIG_DOCUMENTS = [("an empty file", b""), ("[]", b"[]"), ("null", b"null"), ("1", b"1"),
                    ('"x"', b'"x"'), ("{", b"{"), ("nesting 100000 deep", b"[" * 100000),
                    ("nesting 100000 deep objects", b'{"a":' * 100000),
                    ("a UTF-8 BOM", "\ufeff{}".encode()), ("a latin-1 byte", b'{"x": "\xe9"}'),
                    ("a 1 MB string value", b'{"model_type": "' + b"a" * (1 << 20) + b'"}'),
                    ("a NUL byte", b'{"model_type"\x00: 1}')]


def mut_config_document(rng, b: Base, case: Case):
    raw = json.loads((CONFIG_DIR / f"{b.config}.json").read_text())
    mode = rng.randrange(4)
    if mode == 0:
        what, text = rng.choice(CONFIG_DOCUMENTS)
    elif mode == 1:                                  # a non-UTF-8 byte in an otherwise good config
        good = json.dumps(raw, indent=2).encode()
        pos = good.index(b'"dtype"') + 1
        what, text = "a \\xff byte in a key", good[:pos] + b"\xff" + good[pos:]
    elif mode == 2:                                  # keys repeated (the last one wins in json)
        good = json.dumps(raw, indent=2)
        what, text = "model_type repeated with another family", (
            good[:-2] + ',\n  "model_type": "llama"\n}').encode()
    else:                                            # the whole file as UTF-16
        what, text = "UTF-16 encoded", json.dumps(raw).encode("utf-16")
    case.compile = True
    return _use_config(rng, b, case, text, f"a config.json of {what}")


def mut_names(rng, b: Base, case: Case):
    text = b.spec
    m = re.search(r"schedule (\w+)", text)
    case.compile = True
    mode = rng.randrange(3)
    if mode == 0:                                    # a schedule name
        name = rng.choice(NAMES)
        case.desc = f"schedule name {shown(name, 40)}"
        return _sub(text, m.span(1), name)
    if mode == 1:                                    # the same name for schedule and model dir
        name = rng.choice(NAMES)[:250]               # a directory name the OS accepts
        case.files.append(("file", f"{name}/config.json",
                           (CONFIG_DIR / f"{b.config}.json").read_bytes()))
        case.model = name
        case.desc = f"schedule name and --model directory {shown(name, 40)}"
        return _sub(text, m.span(1), name)
    dirname = rng.choice(MODEL_DIR_NAMES)           # an odd model directory name
    rel = f"{dirname}/config.json" if dirname else "config.json"
    case.files.append(("file", rel, (CONFIG_DIR / f"{b.config}.json").read_bytes()))
    case.model = dirname or "."
    case.desc = f"--model directory {shown(case.model, 40)}"
    return text


# kind -> (generator, weight)
MUTATIONS = {
    "token_delete": (mut_token_delete, 10),
    "token_replace": (mut_token_replace, 14),
    "token_duplicate": (mut_token_duplicate, 8),
    "number_extreme": (mut_number_extreme, 10),
    "topology": (mut_topology, 4),
    "tile_bound": (mut_tile_bound, 3),
    "context": (mut_context, 3),
    "unicode": (mut_unicode, 5),
    "bytes": (mut_bytes, 3),
    "line_duplicate": (mut_line_duplicate, 5),
    "line_swap": (mut_line_swap, 5),
    "line_delete": (mut_line_delete, 4),
    "line_repeat": (mut_line_repeat, 2),
    "block": (mut_block, 3),
    "truncate": (mut_truncate, 2),
    "list_duplicate": (mut_list_duplicate, 5),
    "line_break": (mut_line_break, 5),
    "model_path": (mut_model_path, 4),
    "config_value": (mut_config_value, 10),
    "config_document": (mut_config_document, 2),
    "names": (mut_names, 4),
}
SPEC_TEXT_KINDS = [k for k in MUTATIONS if k not in ("model_path", "config_value", "config_document")]
