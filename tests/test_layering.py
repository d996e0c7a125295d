"""The plug-in boundary (issue 8), checked on the source: the compiler core names no family and
branches on none, its imports form no cycle, nothing outside the family packages imports them
(the registry finds them by name), and checking a spec (model, resolve) reaches no family's
ops, lowering, weights or reference, nor the in-kernel runtime."""
import ast
import re

from mkc.model import registry
from tests_support import ROOT

# The generic core: language, model interface, resolve, IR, trace, checks, codegen (templates
# too), the runtime mechanisms, the numerics and checkpoint code every family shares, and the
# drivers every `mkc check` runs (the pipeline, a checkpoint's requantization, output writing).
CORE = ("mkc/lang", "mkc/model", "mkc/layers", "mkc/resolve", "mkc/ir.py", "mkc/trace.py", "mkc/checks",
        "mkc/codegen", "mkc/runtime", "mkc/numerics.py", "mkc/reference", "mkc/checkpoint.py",
        "mkc/compiler.py", "mkc/requantize.py", "mkc/files.py")
FAMILY_WORD = re.compile(r"kimi|qwen|(^|_)k3($|_)", re.I)


def _files(suffix: str):
    for part in CORE:
        path = ROOT / part
        yield from ([path] * (path.suffix == suffix) if path.is_file() else sorted(path.rglob(f"*{suffix}")))


def _docstrings(tree: ast.AST) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            out.add(id(body[0].value))
    return out


def _imports(tree: ast.AST, modules=()) -> set[str]:
    """What a module imports: `from m import n` is m.n when that is one of `modules`, else m."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules
                       else node.module for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _module(path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def _families():
    return set(registry.all_families())


def _identifier(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.arg):
        return node.arg
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
        return node.name
    return None


def test_the_core_names_no_family_and_branches_on_none():
    """No identifier, import or string value of the core (docstrings and comments aside: they
    give shipped models as examples) is a family's name, model type or package."""
    fams = _families()
    assert len(fams) >= 3
    names = set(registry.model_types()) | {f.name for f in fams}
    packages = {f.package for f in fams}
    found = []
    for path in _files(".py"):
        tree = ast.parse(path.read_text())
        docs = _docstrings(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs \
                    and (node.value in names or node.value in packages):
                found.append((path.name, node.lineno, node.value))
            ident = _identifier(node)
            if ident and FAMILY_WORD.search(ident):
                found.append((path.name, node.lineno, ident))
        found += [(path.name, 0, m) for m in _imports(tree) if m.startswith(tuple(packages))]
    for path in _files(".j2"):
        found += [(path.name, i + 1, line.strip()) for i, line in enumerate(path.read_text().splitlines())
                  if FAMILY_WORD.search(line)]
    assert found == []


def _graph() -> dict[str, set[str]]:
    paths = {_module(p): p for p in (ROOT / "mkc").rglob("*.py")}
    return {m: {d for d in _imports(ast.parse(p.read_text()), paths) if d in paths and d != m}
            for m, p in paths.items()}


def _is_family_package(module: str) -> bool:
    return module == registry.PACKAGE or module.startswith(registry.PACKAGE + ".")


def test_nothing_outside_the_families_imports_them():
    """The import arrows point from the family packages to the model interface, never back:
    no module of mkc outside mkc/families (mkc.model and its registry included) imports the
    families' package or any family, anywhere in its body. The registry finds them by name
    (`importlib`), which is no import statement."""
    graph = _graph()
    assert "mkc.model.registry" in graph
    back = {m: sorted(d for d in deps if _is_family_package(d))
            for m, deps in graph.items() if not _is_family_package(m)}
    assert {m: d for m, d in back.items() if d} == {}


def _family_of(module: str, packages: set[str]) -> str | None:
    return next((p for p in packages if module == p or module.startswith(p + ".")), None)


def test_no_family_imports_another():
    """A family is a config reader and a composition of the layer library's kinds, plus what is
    truly its own: no module of a family's package imports another family's, anywhere in its
    body (what two families share lives in `mkc.layers`)."""
    graph = _graph()
    packages = {f.package for f in _families()}
    assert len(packages) >= 7
    crossing = {m: sorted(d for d in deps if _family_of(d, packages) not in (None, _family_of(m, packages)))
                for m, deps in graph.items() if _family_of(m, packages)}
    assert {m: d for m, d in crossing.items() if d} == {}


def test_mkc_imports_form_no_cycle():
    """Every import counts, function-local ones too (the family registry's are by name)."""
    graph = _graph()
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import cycle: " + " -> ".join(path[path.index(m):] + [m]))
        if m in done:
            return
        for d in graph[m]:
            visit(d, path + [m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


def test_model_and_resolve_reach_no_ops_lowering_or_runtime():
    """What checking a spec imports (statically, transitively from mkc.model and mkc.resolve)
    holds no family compute module and no in-kernel runtime mechanism."""
    graph = _graph()
    seen: set[str] = set()
    todo = [m for m in graph if m.split(".")[:2] in (["mkc", "model"], ["mkc", "resolve"])]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    compute = (".ops", ".lowering", ".weights", ".reference")
    assert [m for m in seen if m.endswith(compute) or m.startswith("mkc.runtime")] == []


# The stages after resolve: they read the IR, which carries what the family contributes.
AFTER_RESOLVE = ("mkc.checks", "mkc.trace", "mkc.program", "mkc.codegen", "mkc.perf", "mkc.runtime",
                 "mkc.report", "mkc.cost")


def test_nothing_after_resolve_goes_back_to_the_family_registry():
    """Checks, trace, codegen, perf and the runtime import neither the registry
    (mkc.model.registry) nor a family package, directly or through another module: statically,
    transitively. A driver that runs resolve again (`mkc tune`'s candidates) reaches the
    registry through resolve only, and the checkpoint check (`mkc.checks.checkpoint`) through
    the checkpoint reader (`mkc.checkpoint`, which reads an input as resolve reads the config:
    the checkpoint's own config.json names its family): neither is followed."""
    graph = _graph()
    later = [m for m in graph if m.startswith(AFTER_RESOLVE)]
    assert len(later) >= 20
    for start in later:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m not in seen:
                seen.add(m)
                followed = m.split(".")[:2] != ["mkc", "resolve"] and m != "mkc.checkpoint"
                todo += graph[m] if followed else []
        back = sorted(m for m in seen if m == "mkc.model.registry" or _is_family_package(m))
        assert back == [], (start, back)


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    """Every module `start` imports, statically and transitively (itself included)."""
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo += graph[m]
    return seen


def test_requantize_reaches_no_family_module():
    """`mkc.requantize` (every `mkc check` with a checkpoint runs it) finds the family's weights
    module by the name the IR carries (`importlib`), never by an import: nothing it imports,
    directly or through another module, is a family package, and no in-kernel runtime."""
    reached = _reached(_graph(), "mkc.requantize")
    assert [m for m in reached if _is_family_package(m) or m.startswith("mkc.runtime")] == []


def test_writing_output_drags_no_compiler_stage():
    """Writing a file (`mkc.files`) imports nothing of mkc, and no stage after resolve (the perf
    exporters, plots and measures that write files) reaches the pipeline (`mkc.compiler`)."""
    graph = _graph()
    assert _reached(graph, "mkc.files") == {"mkc.files"}
    later = sorted(m for m in graph if m.startswith(AFTER_RESOLVE))
    assert [m for m in later if "mkc.compiler" in _reached(graph, m)] == []


def test_resolve_imports_no_check():
    """Checks read what resolve produces, never the reverse: no resolve module imports a check,
    directly or through another module (what both need lives in a neutral module, as
    `ScheduleIR.fits_hbm` for the HBM fit the smallest-slice search and `check_hbm` share)."""
    graph = _graph()
    resolve = sorted(m for m in graph if m.split(".")[:2] == ["mkc", "resolve"])
    assert len(resolve) >= 15
    assert {m: sorted(d for d in _reached(graph, m) if d.startswith("mkc.checks"))
            for m in resolve} == {m: [] for m in resolve}


def _external_imports(module: str) -> set[str]:
    path = ROOT / (module.replace(".", "/") + ".py")
    path = path if path.exists() else ROOT / module.replace(".", "/") / "__init__.py"
    return {m.split(".")[0] for m in _imports(ast.parse(path.read_text()))}


def test_what_a_spec_check_loads_of_the_layer_library_holds_no_jax():
    """A layer library package's `__init__` (a kind's options, ops and tensors, or the expert
    formats' rules and slot tensors) is what a family graph, so every `mkc check`, imports:
    neither it nor anything it reaches imports jax or a compute module (`ops`, `lowering`,
    `weights`, `reference`) or the in-kernel runtime; the jax modules import it, never the
    reverse."""
    graph = _graph()
    packages = sorted(m for m in graph if m.startswith("mkc.layers.") and m.count(".") == 2
                      and (ROOT / m.replace(".", "/") / "__init__.py").exists())
    assert {"mkc.layers.expert_formats", "mkc.layers.moe", "mkc.layers.gqa"} <= set(packages)
    compute = (".ops", ".lowering", ".weights", ".reference")
    for package in packages:
        reached = _reached(graph, package)
        assert [m for m in reached if m.endswith(compute) or m.startswith("mkc.runtime")] == [], package
        assert [m for m in reached if "jax" in _external_imports(m)] == [], package


def test_the_runtime_and_the_model_interface_import_nothing_of_the_layer_library():
    """The layer library is built on the model interface (`mkc.model`) and the in-kernel
    runtime (`mkc.runtime`), never the reverse: no module of either imports a module of
    `mkc.layers`, anywhere in its body (what both need, jax-free, lives below, as the
    per-column requantization `mkc.model.channel_codes`)."""
    graph = _graph()
    below = [m for m in graph if m.startswith(("mkc.runtime.", "mkc.model."))]
    assert len(below) >= 15
    upward = {m: sorted(d for d in graph[m] if d == "mkc.layers" or d.startswith("mkc.layers."))
              for m in below}
    assert {m: d for m, d in upward.items() if d} == {}
