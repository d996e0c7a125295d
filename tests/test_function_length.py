"""No function in mkc/ is longer than 80 lines (its decorators, signature, docstring and body):
a longer one is split into parts with names that say what each does."""
import ast

from tests_support import ROOT

LIMIT = 80


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function, nested ones named inside their parent's."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            name = prefix + node.name
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            yield name, node.end_lineno - first + 1
            yield from _functions(node, name + ".")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, prefix + node.name + ".")
        else:
            yield from _functions(node, prefix)


def _long_functions() -> dict[tuple[str, str], int]:
    out = {}
    for path in sorted((ROOT / "mkc").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        for name, lines in _functions(ast.parse(path.read_text())):
            if lines > LIMIT:
                out[rel, name] = lines
    return out


def test_no_function_in_mkc_is_over_80_lines():
    assert _long_functions() == {}
