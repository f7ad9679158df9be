"""No MindSpore API that MindSpore 2.10 documents as deprecated is used by the package, and the
ones whose signature it announces will change are called in a way the change keeps working, so
the next MindSpore release does not break the package. MindSpore 2.10 prints no warning for most
of them (only their docstrings say so), so the package's source is scanned for every `ops.X`,
`mint.X` and `nn.X` it calls and X's notice is read; the warnings MindSpore does print are turned
into test failures by tests/conftest.py."""
import ast
import glob
import os
import re

import pytest
from mindspore import mint, nn, ops

import ms_moe_ops

PACKAGE = os.path.dirname(os.path.abspath(ms_moe_ops.__file__))
MODULES = {"ops": ops, "mint": mint, "nn": nn}
GOING = re.compile(r"(api|interface) is deprecated|will be removed|parameter order", re.I)
CHANGING = re.compile(r"non-backward-compatible change|will be renamed|will become|default "
                      r"value will change", re.I)
# How a call of each API announced to change stays valid after the change: (at most this many
# positional arguments (dtype of zeros/ones becomes keyword-only), at least this many (softmax's
# default axis changes), keywords it must not use (parameters that are renamed))
SAFE_CALLS = {"zeros": (1, 0, ()), "ones": (1, 0, ()), "stack": (9, 0, ("axis",)),
              "sort": (9, 0, ("axis",)), "cumsum": (9, 0, ("x", "axis")),
              "concat": (9, 0, ("axis",)), "cat": (9, 0, ("axis",)), "chunk": (9, 0, ("axis",)),
              "split": (9, 0, ("axis",)), "repeat_interleave": (9, 0, ("axis",)),
              "softmax": (9, 2, ("axis",)), "log_softmax": (9, 2, ("axis",))}


def notice(module, attr):
    """The part of an API's documentation that announces its future (before the examples)."""
    return (getattr(getattr(MODULES[module], attr, None), "__doc__", "") or "").split(
        "Examples:")[0]


def _calls():
    """(file:line, module name, attribute, the call or None) of every ops.X / mint.X / nn.X the
    package names."""
    found = []
    for path in sorted(glob.glob(os.path.join(PACKAGE, "**", "*.py"), recursive=True)):
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in MODULES:
                where = f"{os.path.relpath(path, PACKAGE)}:{node.lineno}"
                found.append((where, node.value.id, node.attr, calls.get(id(node))))
    return found


def test_the_scan_finds_the_package_s_calls():
    names = {attr for _, module, attr, _ in _calls() if module == "ops"}
    assert {"Gather", "Custom", "sort", "zeros"} <= names


def test_no_deprecated_mindspore_api_is_used():
    bad = [f"{where}: {module}.{attr}" for where, module, attr, _ in _calls()
           if GOING.search(notice(module, attr))]
    assert not bad, "MindSpore documents these as going away:\n" + "\n".join(bad)


def test_apis_about_to_change_are_called_so_the_change_keeps_working():
    bad = []
    for where, module, attr, call in _calls():
        text = notice(module, attr)
        if GOING.search(text) or not CHANGING.search(text):
            continue
        if attr not in SAFE_CALLS:
            bad.append(f"{where}: {module}.{attr} will change: add how it may be called")
            continue
        most, least, renamed = SAFE_CALLS[attr]
        if call is None:
            continue
        keywords = {k.arg for k in call.keywords}
        if not least <= len(call.args) <= most or keywords & set(renamed):
            bad.append(f"{where}: {module}.{attr}({len(call.args)} positional, keywords "
                       f"{sorted(keywords)}) breaks when it changes")
    assert not bad, "\n".join(bad)


@pytest.mark.parametrize("api", ["tensor_scatter_add", "scatter_nd", "tensor_scatter_elements",
                                 "fill", "dyn_shape", "index_add", "assign", "assign_add"])
def test_the_check_knows_the_apis_the_package_stopped_using(api):
    assert GOING.search(notice("ops", api)), api


def test_the_warning_watch_counts_the_package_files_only(tmp_path, _deprecation_watch):
    """The watch of tests/conftest.py blames a deprecation notice on the package only when one of
    the package's own files is on the stack: a clone of the repository is a folder named
    ms_moe_ops too, and the test files inside it called nn.Adam (MindSpore's own notice) while
    the check looked for "/ms_moe_ops/" in any path."""
    from conftest import _DeprecationsFromThePackage
    from ms_moe_ops._compat import mindspore_logger

    watch = _DeprecationsFromThePackage()
    logger = mindspore_logger()
    logger.addHandler(watch.handler)

    def notice_from(filename):
        code = compile("logger.warning(\"'FusedSparseAdam' is deprecated\")", filename, "exec")
        exec(code, {"logger": logger})  # pylint: disable=exec-used
        found, watch.found[:] = list(watch.found), []
        return found

    try:
        clone = tmp_path / "ms_moe_ops" / "tests" / "test_train.py"
        assert notice_from(str(clone)) == [], "a file of a folder named ms_moe_ops was blamed"
        assert notice_from(os.path.join(PACKAGE, "nn", "moe_layer.py")), \
            "a notice raised from the package's own file was not caught"
    finally:
        logger.removeHandler(watch.handler)
        _deprecation_watch.found[:] = []  # the session's own watch saw the planted notice too
