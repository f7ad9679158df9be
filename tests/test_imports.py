"""The package's import graph: no cycles, and each layer imports only those below it (ops <- nn
<- parallel <- models <- convert; _compat and reference at the bottom), at module level: an
import inside a function would hide a cycle from Python until that function runs. Read from the
source, so it also holds for modules the tests do not import."""
import ast
import importlib.util
import os

PACKAGE = "ms_moe_ops"
# the imported package's sources (a checkout's, or an installed package's)
ROOT = os.path.dirname(os.path.realpath(importlib.util.find_spec(PACKAGE).origin))
# what each part of the package may import from the package: whole models on the Cells, the
# checkpoint converter on the models' parameter tables
LAYERS = {"_compat": set(), "reference": set(), "ops": {"_compat", "ops"},
          "nn": {"_compat", "ops", "nn"}, "parallel": {"_compat", "ops", "nn", "parallel"},
          "models": {"_compat", "ops", "nn", "parallel", "models"},
          "convert": {"_compat", "ops", "nn", "models", "convert"},
          # `python -m ms_moe_ops.info`: a report of the whole package, imported by nothing
          "info": {"_compat", "ops", "nn", "parallel", "models", "convert", "reference"},
          # `python -m ms_moe_ops.selftest`: the device self-test, imported by nothing
          "selftest": {"_compat", "ops", "nn", "reference"},
          # `python -m ms_moe_ops.generate`: text from a checkpoint, imported by nothing
          "generate": {"models", "convert", "generate"},
          "__init__": {"nn", "ops", "parallel", "reference", "models", "convert"}}


def _modules():
    """{module name: path} of every module of the package."""
    out = {}
    for folder, _, files in os.walk(ROOT):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                parts = os.path.relpath(path, os.path.dirname(ROOT))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts = parts[:-1]
                out[".".join(parts)] = path
    return out


def _imports(module, path, modules):
    """[(imported package module, line, inside a function)] of one module."""
    package = module if path.endswith("__init__.py") else module.rsplit(".", 1)[0]
    with open(path) as f:
        tree = ast.parse(f.read())
    functions = {id(n) for f in ast.walk(tree)
                 if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[:len(package.split(".")) - node.level + 1] +
                                ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                     for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] == PACKAGE and name in modules:
                # importing a.b.c runs the packages a and a.b first
                parts = name.split(".")
                for end in range(2, len(parts) + 1):
                    found.append((".".join(parts[:end]), node.lineno, id(node) in functions))
    return found


def _part(module):
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _graph():
    modules = _modules()
    return {m: _imports(m, p, modules) for m, p in modules.items()}


def _cycle(graph):
    """A cycle of the graph (a list of modules), or None."""
    state = {}

    def visit(node, stack):
        state[node] = "open"
        for target, _, _ in graph.get(node, ()):
            if state.get(target) == "open":
                return stack[stack.index(target):] + [target]
            if target not in state:
                found = visit(target, stack + [target])
                if found:
                    return found
        state[node] = "done"
        return None

    for node in graph:
        if node not in state:
            found = visit(node, [node])
            if found:
                return found
    return None


def _without_packages(graph):
    """A module naming its own package (`from . import sibling`) is no cycle: Python has the
    package's module object already."""
    return {m: [edge for edge in edges if edge[0] != m and not m.startswith(edge[0] + ".")]
            for m, edges in graph.items()}


def test_no_import_cycle():
    graph = _without_packages(_graph())
    assert len(graph) > 20
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_layers_import_downwards_only():
    wrong = [f"{m} imports {t} (line {line})" for m, edges in _graph().items()
             for t, line, _ in edges if _part(t) not in LAYERS[_part(m)]]
    assert not wrong, wrong


def test_no_package_import_inside_a_function():
    """(but in an entry point that no module imports, such as `python -m ms_moe_ops.info`, which
    imports lazily to report what fails to import: it closes no cycle)"""
    graph = _graph()
    imported = {t for edges in _without_packages(graph).values() for t, _, _ in edges}
    inner = [f"{m} imports {t} inside a function (line {line})"
             for m, edges in graph.items() if m in imported for t, line, inside in edges if inside]
    assert not inner, inner


def test_the_check_finds_a_cycle():
    graph = {"a": [("b", 1, False)], "b": [("c", 2, False)], "c": [("a", 3, True)]}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": [("b", 1, False)], "b": []}) is None
