"""Lower the checked schedule IR to one readable Pallas module through jinja2 templates."""
from __future__ import annotations

import hashlib
import re
from pathlib import Path

import jinja2

import mkc
import mkc.families
from mkc import ir
from mkc.codegen import generic
from mkc.model.family import Family
from mkc.program import layer_program

_TEMPLATES = Path(__file__).with_name("templates")
_JNP = {"bf16": "jnp.bfloat16", "f32": "jnp.float32", "int32": "jnp.int32"}


def _generic_env() -> jinja2.Environment:
    return _configured(jinja2.FileSystemLoader(_TEMPLATES))


def _env(family: Family) -> jinja2.Environment:
    """A family's own template (the families not yet on the generic one): its package first,
    then the shared templates."""
    return _configured(jinja2.FileSystemLoader([family.directory(), _TEMPLATES]))


def _configured(loader: jinja2.BaseLoader) -> jinja2.Environment:
    env = jinja2.Environment(loader=loader, autoescape=False,
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True,
                             trim_blocks=True, lstrip_blocks=True)
    env.filters["jnp"] = lambda d: _JNP[d]
    # Free text (file names) only reaches the module docstring, restricted to safe characters.
    env.filters["safe_text"] = lambda t: re.sub(r"[^A-Za-z0-9_.\-]", "_", str(t))
    return env


def _geometry(s: ir.ScheduleIR, kind_ids: dict[str, int], sem_index: dict[str, int],
              misc_sems: dict[str, int]) -> dict:
    """Per-rank sizes and tables the template prints as constants."""
    d = s.dims
    kind_layers = {k: [i for i, kk in enumerate(s.layer_kinds) if kk == k] for k in sorted(s.kinds)}
    state_buffer: dict[str, dict[str, ir.Buffer]] = {}     # kind -> state family -> buffer
    for kname, k in s.kinds.items():
        for t in k.transfers:
            state_buffer.setdefault(kname, {})[t.state] = s.buffer(t.buffer)
    dims_literal = "{" + ", ".join(f"{key!r}: {val!r}" for key, val in sorted(d.items())
                                   if key != "layer_kinds") + \
        f", 'layer_kinds': {tuple(s.layer_kinds)!r}" + "}"
    return {
        "dims_literal": dims_literal,
        "layer_kind_ids": tuple(kind_ids[k] for k in s.layer_kinds),
        "vocab_local": s.per_rank["vocab"],
        "state_index": tuple(kind_layers[k].index(i) for i, k in enumerate(s.layer_kinds)),
        "kind_layers": kind_layers,
        **s.per_rank,
        "sem_names": {**{k.replace(":", "_"): v for k, v in sem_index.items()}, **misc_sems},
        "state_buffer": state_buffer,
    }


def render(s: ir.ScheduleIR, spec_text: str) -> str:
    """The generated module's source; deterministic for the same inputs."""
    digest = hashlib.sha256((spec_text + "\0" + s.config_digest + "\0" + mkc.__version__)
                            .encode()).hexdigest()[:16]
    sem_index: dict[str, int] = {}
    for k in s.kinds.values():
        for t in k.transfers:
            sem_index.setdefault(f"{t.direction}:{t.buffer}", len(sem_index))
    misc_sems = {"head_norm": len(sem_index), "embed": len(sem_index) + 1,
                 "kv_rows": len(sem_index) + 2}
    plans = {name: layer_program(s, name) for name in s.kinds}
    families = {name: {f.name: f for f in fams} for name, fams in s.stream.families.items()}
    kind_ids = {name: i for i, name in enumerate(sorted(s.kinds))}
    state_arrays = []          # (kind, state family, hbm name)
    for name in sorted(s.kinds):
        for sname in sorted(s.kinds[name].states):
            state_arrays.append((name, sname, f"{name}__{sname}"))
    cache_arrays = [(name, c) for name in sorted(s.kinds) if s.kinds[name].kv
                    for c in ("key", "value")]
    resident = [b for b in s.buffers if b.scope is None]
    family = mkc.families.get(s.family)
    if family.template is None:
        return _generic_env().get_template("module.py.j2").render(
            s=s, version=mkc.__version__, digest=digest,
            **generic.context(s, family, family.dims_import))
    unknown = {op for k in s.kinds.values() for op in k.ops} - family.lowered_ops
    if unknown:
        raise ValueError(f"no lowering for ops {sorted(unknown)}")
    # Each receive buffer has its own send/receive semaphores and use counter (its parity).
    collectives = [b for b in s.buffers if b.cls == "collective"]
    return _env(family).get_template(family.template).render(
        s=s, d=s.dims, version=mkc.__version__, digest=digest, plans=plans,
        families=families, kind_ids=kind_ids, g=_geometry(s, kind_ids, sem_index, misc_sems),
        sem_index=sem_index, misc_sems=misc_sems,
        n_sems=len(sem_index) + len(misc_sems), state_arrays=state_arrays,
        cache_arrays=cache_arrays, resident=resident, collectives=collectives,
        all_families=[f for fs in s.stream.families.values() for f in fs] + s.stream.tail,
        facts=family.template_facts(s) if family.template_facts else None)
