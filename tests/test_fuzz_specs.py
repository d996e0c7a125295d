"""Mutated specs never crash mkc: every outcome is a clean compile or an MkcError diagnostic."""
import random
import re

import pytest

from mkc.compiler import check_spec
from mkc.diagnostics import MkcError
from tests_support import K3_SPEC, SPEC

_TOKEN = re.compile(r"[A-Za-z_][A-Za-z0-9_.]*|\d+x\d+x\d+|\d+|->|\"[^\"]*\"|[{}:;,=()/]")
_REPLACEMENTS = ["0", "1", "3", "7", "999999999", "x", "gdn", "gqa", "start", "end", "next",
                 "wait", "load", "store", "{", "}", ";", ",", "->", '"qwen3_8_mini"', "bf16",
                 "f32", "tp", "state.conv", "before", "after", "two_level", "host", "chip",
                 "kda", "mla", "moe", "dense", "pool", "view", "slots", "expert", "prefetch",
                 "fetch", "experts", "allgather", "exchange", "sibling", "staging.experts",
                 "staging.attention", "/", "(", ")", "route", "routed_experts", "over"]
# The K3 spec on 2 hosts (16 cores), checked with the MINI config: small traces, every construct.
_K3_ON_16 = (K3_SPEC.read_text().replace("topology 2x2x4", "topology 2x2x2")
             .replace("tp = 32", "tp = 16"))
_CASES = [("qwen", SPEC.read_text(), "qwen3_8_mini"), ("k3", _K3_ON_16, "kimi_k3_mini")]


def _mutations(text: str, count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    spans = [m.span() for m in _TOKEN.finditer(text)]
    out = []
    for _ in range(count):
        start, end = spans[rng.randrange(len(spans))]
        kind = rng.randrange(3)
        if kind == 0:                                   # delete a token
            out.append(text[:start] + text[end:])
        elif kind == 1:                                 # replace it
            out.append(text[:start] + rng.choice(_REPLACEMENTS) + text[end:])
        else:                                           # duplicate it
            out.append(text[:end] + " " + text[start:end] + text[end:])
    return out


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("case", _CASES, ids=lambda c: c[0])
def test_mutated_specs_give_diagnostics_not_crashes(tmp_path, seed, case):
    _, base, model = case
    spec = tmp_path / "mutant.sched"
    outcomes = {"ok": 0, "rejected": 0}
    for text in _mutations(base, 40, seed):
        spec.write_text(text)
        try:
            check_spec(spec, model)
            outcomes["ok"] += 1
        except MkcError as e:
            for d in e.diagnostics:
                assert d.span.line >= 1 and d.hint, (text, d)
            outcomes["rejected"] += 1
    assert outcomes["rejected"] > 0
