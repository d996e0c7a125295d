"""Pass `graph`'s op order: `run OP before OP` moves an op ahead of ops it does not depend on,
in source order, and everything after the graph (program points, views, collectives, the
kernel's body) follows it; a move past a dependency is refused (tests/broken_specs/run_*)."""
from mkc.compiler import check_source
from mkc.lang.parser import parse
from mkc.resolve import resolve_state
from tests_support import K3_SPEC

RUN = "    run latent_down before router\n"


def _graph(text: str):
    return resolve_state(parse(text, str(K3_SPEC)), after="graph").graph


def test_the_shipped_k3_spec_runs_latent_down_ahead_of_the_router():
    text = K3_SPEC.read_text()
    assert RUN in text
    family = _graph(text.replace(RUN, "")).kinds["moe"].op_names()
    moved = check_source(text, str(K3_SPEC)).ir.kinds["moe"].ops
    assert family.index("router") < family.index("latent_down")
    assert moved.index("latent_down") == moved.index("router") - 1
    assert sorted(moved) == sorted(family)
    layer = _graph(text).dims.layer_kinds.index("moe")
    nodes = [n for n in _graph(text).graph.nodes if n.startswith(f"layers.{layer}.")]
    assert nodes == [f"layers.{layer}.{op}" for op in moved]


def test_moves_apply_in_source_order():
    text = K3_SPEC.read_text().replace(RUN, RUN + "    run shared_gate_up before router\n")
    text = text.replace("    moe: router, shared_gate_up,", "    moe: shared_gate_up, router,")
    ops = check_source(text, str(K3_SPEC)).ir.kinds["moe"].ops
    i = ops.index("latent_down")
    assert ops[i:i + 4] == ["latent_down", "shared_gate_up", "router", "route"]
