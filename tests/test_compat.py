"""Canaries of ms_moe_ops/_compat.py: each MindSpore internal or compiler behaviour the package
relies on still exists and behaves as relied on. A failure here after a MindSpore upgrade names
what changed; mend _compat.py (and nothing else)."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn, ops

from ms_moe_ops import _compat


def test_context_is_read_from_the_live_cxx_context():
    for name, value in (("device_target", ms.get_context("device_target")),
                        ("mode", ms.get_context("mode"))):
        assert _compat.context_param(name) == value, (
            f"MSContext.get_param({name}) no longer matches ms.get_context: the resolver reads "
            f"the device target and mode through it")
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        assert _compat.context_param("mode") == ms.GRAPH_MODE, "mode changes are not seen live"
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert isinstance(_compat.ascend_soc_version(), str)


def test_a_partial_runs_in_python_while_the_graph_is_built():
    calls = []

    def choose(x):
        calls.append(x.shape)
        return ops.relu

    chosen = _compat.run_at_compile_time(choose)

    class Net(nn.Cell):
        def construct(self, x):
            return chosen(x)(x)

    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        net = Net()
        out = net(Tensor(np.array([-1.0, 2.0], np.float32)))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert out.asnumpy().tolist() == [0.0, 2.0]
    assert calls == [(2,)], (f"MindSpore no longer runs a functools.partial in Python while it "
                             f"compiles a graph (calls: {calls}): the resolver depends on it")


def test_compiling_tells_compiled_code_from_python():
    seen = []
    record = _compat.run_at_compile_time(lambda flag: seen.append(flag) or 0)

    def f(x):
        record(_compat.compiling())
        return x + 1

    class Net(nn.Cell):
        def construct(self, x):
            return f(x)

    x = Tensor(np.array([1.0], np.float32))
    f(x)
    ms.jit(f)(x)
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        Net()(x)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert seen == [False, True, True], (
        f"_compat.compiling() no longer tells a compiled call from a Python one ({seen}): "
        f"MindSpore may have changed how a constexpr receives a function (its _run_in_jit)")


def test_is_constant_tells_static_from_dynamic_dimensions():
    # evaluated by the graph compiler (as the resolver's call signature is), not in Python
    seen = []
    recorder = _compat.run_at_compile_time(lambda flags: seen.append(flags) or 0)

    class Net(nn.Cell):
        def construct(self, x):
            recorder((_compat.is_constant(x.shape[0]), _compat.is_constant(x.shape[1])))
            return x + 1

    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        net = Net()
        net.set_inputs(Tensor(shape=[None, 3], dtype=ms.float32))
        net(Tensor(np.zeros((2, 3), np.float32)))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert seen == [(False, True)], f"isconstant of (dynamic, static) dims gave {seen}"


@pytest.mark.parametrize("name", ["gmm_v2_op", "gmm_v2_backward_op", "FFNExt", "tensor_to_tuple",
                                  "transpose_ext_view"])
def test_generated_primitives_exist(name):
    assert callable(_compat.auto_generate(name)), f"mindspore.ops.auto_generate.{name} is gone"


def test_mixed_precision_switch_and_rewrite_list_exist():
    from mindspore.rewrite.common import namespace

    assert isinstance(getattr(namespace, "_subtree_black_list", None), list), (
        "mindspore.rewrite.common.namespace._subtree_black_list is gone: AMP O1 would rewrite "
        "the MoE Cells' source")
    from ms_moe_ops import MoELayer

    assert MoELayer in namespace._subtree_black_list
    cell = nn.Cell()
    cell.mixed_precision_type = _compat.NO_AUTOMATIC_CASTS  # accepted by Cell


def test_the_amp_wrapper_holds_the_converted_network():
    net = nn.Dense(2, 2)
    wrapped = ms.amp.auto_mixed_precision(net, "O2", ms.bfloat16)
    assert _compat.amp_inner_cell(wrapped) is net, (
        f"auto_mixed_precision O2 returned a {type(wrapped).__name__} without the network as "
        f"its _backbone: generate would not find the model inside it")
    assert _compat.amp_inner_cell(net) is None


def test_mindspore_warnings_reach_its_logger():
    import logging

    from mindspore.common._decorator import deprecated

    logger = _compat.mindspore_logger()
    assert isinstance(logger, logging.Logger)
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    try:
        deprecated("2.9.0", "new_api", False, "ops.")(lambda: None)()
    finally:
        logger.removeHandler(handler)
    assert any("is deprecated" in m for m in seen), (
        f"MindSpore's deprecation notices no longer reach mindspore_logger(): {seen}")


def test_custom_primitives_are_refused_off_linux_by_a_check_of_their_own(monkeypatch):
    import platform

    from mindspore.ops import Custom

    assert callable(getattr(Custom, "_check_platform", None)), (
        "MindSpore's Custom no longer has _check_platform: see _compat.custom_platform_refusal")
    assert _compat.custom_platform_refusal() == ""
    monkeypatch.setattr(platform, "system", lambda: "Windows")
    assert "Linux" in _compat.custom_platform_refusal(), (
        "Custom._check_platform no longer refuses other platforms: the CPU kernels may now run "
        "there (ops/_library.py)")


def test_a_custom_primitive_cannot_take_run_time_host_integers():
    # Why aclnnMoeFFN goes through the C++ extension route, not ops.Custom (docs/ascend.md): its
    # expert counts are a host aclIntArray, and a Custom primitive declares no input whose value
    # is read on the host at run time, so counts computed in the graph (TensorToTuple) fail in a
    # backend pass, where a constant tuple gets through to kernel selection. The day MindSpore
    # takes the run-time tuple, this fails: then ops.Custom could bind it too.
    from mindspore.ops import CustomRegOp, DataType

    reg = (CustomRegOp("aclnnMsMoeOpsCanary").input(0, "x", "required")
           .attr("counts", "required", "listInt").attr("activation", "required", "str")
           .output(0, "y", "required")
           .dtype_format(DataType.F16_Default, DataType.F16_Default).target("Ascend")
           .get_op_info())
    prim = ops.Custom("aclnnMsMoeOpsCanary", lambda *s: s[0], lambda *d: d[0], func_type="aot",
                      reg_info=reg)
    to_tuple = _compat.auto_generate("tensor_to_tuple")

    class RunTime(nn.Cell):
        def construct(self, x, counts):
            return prim(x, to_tuple(counts), "fastgelu")

    class Constant(nn.Cell):
        def construct(self, x, counts):
            return prim(x, (1, 3), "fastgelu")

    x = Tensor(np.ones((4, 8), np.float16))
    counts = Tensor(np.array([1, 3], np.int64))
    messages = {}
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        for name, cell in (("run_time", RunTime()), ("constant", Constant())):
            try:
                cell(x, counts)
                messages[name] = "ran"
            except (RuntimeError, TypeError, ValueError) as error:
                messages[name] = str(error)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert "user defined function path" in messages["constant"], messages["constant"][:500]
    assert "Tuple to TupleUnfold" in messages["run_time"], (
        "a Custom primitive may now take run-time host integers: aclnnMoeFFN could be bound "
        "through ops.Custom too "
        f"(what MindSpore said: {messages['run_time'][:500]})")


def test_no_module_but_compat_imports_a_private_mindspore_module():
    """Every MindSpore internal goes through _compat.py: no other module of the package imports
    a private MindSpore module (a dotted path with a part starting with "_") or reads a private
    attribute by name with getattr."""
    import ast
    import pathlib

    package = pathlib.Path(_compat.__file__).parent
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            if any(n.startswith("mindspore") and any(p.startswith("_") for p in n.split("."))
                   for n in names):
                found.append(f"{path.relative_to(package)}:{node.lineno}")
            if (isinstance(node, ast.Call) and getattr(node.func, "id", "") == "getattr"
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant)
                    and str(node.args[1].value).startswith("_")
                    and not str(node.args[1].value).startswith("__")):
                found.append(f"{path.relative_to(package)}:{node.lineno} getattr {node.args[1].value}")
    assert not found, f"MindSpore internals used outside _compat.py: {found}"
