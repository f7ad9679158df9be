"""One shape contract per operator: the C++ shape inference MindSpore calls for the kernels
(custom_aot/infer_shape.cc: at graph build, and before every launch when a dimension is known only
at run time) gives the shapes the Python declaration infers, for every operator and every
attribute set of the shared cases, with every dimension known, unknown (-1) and the rank unknown
([-2]). The kernels' own entry checks protect memory; the Python declaration is the contract."""
import os
import shutil
import subprocess

import numpy as np
import pytest

from ms_moe_ops.ops import OPERATORS
from ms_moe_ops.ops._impls import kernel_library
from conftest import cpu_only
from cases import CASES

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "custom_aot", "harness", "infer_shapes.cc")
SYMBOLS = {op: impl.about.split()[-1] for op in OPERATORS for impl in op.impls
           if impl.name == "kernel"}
_KINDS = {bool: "b", int: "i", float: "f", str: "s"}

pytestmark = [cpu_only("the CPU kernels' shape inference"),
              pytest.mark.skipif(shutil.which("g++") is None, reason="builds a C++ harness")]


@pytest.fixture(scope="module")
def infer_shapes(tmp_path_factory):
    """calls -> answers through the compiled harness (one process for all calls)."""
    binary = str(tmp_path_factory.mktemp("harness") / "infer_shapes")
    subprocess.run(["g++", "-std=c++17", "-O1", "-D_GLIBCXX_USE_CXX11_ABI=0",
                    f"-I{os.path.join(ROOT, 'custom_aot')}", HARNESS, "-o", binary, "-ldl"],
                   check=True)

    def run(calls):
        lines = ["\t".join([symbol, str(outputs), attrs, *shapes]) for symbol, outputs, attrs,
                 shapes in calls]
        done = subprocess.run([binary, kernel_library()], input="\n".join(lines) + "\n",
                              capture_output=True, text=True, check=True)
        return [[tuple(int(d) for d in s.split(",") if d) for s in line.split("\t")]
                for line in done.stdout.splitlines()]

    return run


def _attrs(op, attrs):
    return ",".join(f"{name}={_KINDS[type(v)]}:{int(v) if isinstance(v, bool) else v}"
                    for name, v in op.resolve(**attrs).items())


def _unknown(shape, how):
    if how == "rank":
        return [-2]
    return [-1] * len(shape) if how == "dims" else list(shape)


CALLS = [(name, how) for name in sorted(CASES) for how in ("known", "dims", "rank")]


def test_every_operator_with_a_kernel_has_a_case():
    covered = {CASES[name](np.random.default_rng(0), "float32")[0] for name in CASES}
    assert set(SYMBOLS) <= covered


def test_cpp_and_python_infer_the_same_shapes(infer_shapes):
    calls, expected = [], []
    for name, how in CALLS:
        op, inputs, attrs, _ = CASES[name](np.random.default_rng(0), "float32")
        resolved = op.resolve(**attrs)
        shapes = [None if a is None else _unknown(np.shape(a), how) for a in inputs]
        # MindSpore hands the C++ inference the present inputs' shapes only
        present = [",".join(map(str, s)) for s in shapes if s is not None]
        calls.append((SYMBOLS[op], len(op.outputs), _attrs(op, attrs), present))
        expected.append((name, how, [tuple(s) for s in op.infer(resolved, *shapes)]))
    answers = infer_shapes(calls)
    wrong = [(name, how, want, got) for (name, how, want), got in zip(expected, answers)
             if want != got]
    assert len(answers) == len(expected) and not wrong, "\n".join(
        f"{name} ({how} shapes): Python {want}, C++ {got}" for name, how, want, got in wrong)


# -- the same over drawn shapes -------------------------------------------------------------------
# Every operator with a kernel, shapes drawn by hypothesis (every rank the operator takes: 1..8 for
# the activation gradient), each input's shape given whole, with some dimensions unknown (the
# last one among them), or with its rank unknown.

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import given, strategies as st  # noqa: E402

from ms_moe_ops.ops.cast import CAST  # noqa: E402
from ms_moe_ops.ops.dequantize import DEQUANTIZE  # noqa: E402
from ms_moe_ops.ops.rms_norm import ADD_RMS_NORM, RMS_NORM  # noqa: E402
from ms_moe_ops.ops.decode_attention import DECODE_ATTENTION  # noqa: E402
from ms_moe_ops.ops.ffn import FFN_ACTIVATION_GRAD, MOE_FFN  # noqa: E402
from ms_moe_ops.ops.gating import (GATING_BACKWARD, GATING_GRAD, GATING_SOFTMAX_BACKWARD,  # noqa: E402
                                   GATING_TOP_K)
from ms_moe_ops.ops.grouped_matmul import GROUPED_MATMUL  # noqa: E402
from ms_moe_ops.ops.permute import PERMUTE, UNPERMUTE, UNPERMUTE_BACKWARD  # noqa: E402
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP, SWIGLU_GROUP_QUANT_GRAD  # noqa: E402
from ms_moe_ops.ops.weight_quant_grouped_matmul import WEIGHT_QUANT_GROUPED_MATMUL  # noqa: E402
from conftest import examples  # noqa: E402

DIM = st.integers(1, 9)


@st.composite
def valid_calls(draw):
    """(op, attrs, input shapes) of a call the declaration accepts (None: an absent input)."""
    op = draw(st.sampled_from(sorted(SYMBOLS, key=lambda o: o.name)))
    opt = lambda shape: draw(st.sampled_from([shape, None]))  # noqa: E731
    m, n, k = draw(DIM), draw(DIM), draw(DIM)
    if op is GATING_TOP_K:
        return op, dict(k=min(k, n)), [[m, n], opt([n])]
    if op in (GATING_BACKWARD, GATING_SOFTMAX_BACKWARD, GATING_GRAD):
        n = max(n, 2)
        shapes = [[m, n], [m, min(k, n)], [m, min(k, n)]]
        return op, {}, shapes + ([opt([m, n])] if op is GATING_GRAD else [])
    if op in (SWIGLU_GROUP, SWIGLU_GROUP_QUANT_GRAD):
        lead = draw(st.lists(DIM, min_size=1, max_size=2))
        weight, groups = opt(lead + [1]), opt([k])
        if op is SWIGLU_GROUP:
            return op, {}, [lead + [2 * n], weight, groups]
        y_origin = lead + [n] if weight is not None else opt(lead + [n])
        return op, {}, [lead + [n], lead + [2 * n], weight, y_origin, groups]
    if op is MOE_FFN:
        e, f = draw(DIM), draw(DIM)
        return op, {}, [[m, n], [e], [e, n, f], opt([e, f]), [e, f, n], opt([e, n])] + [None] * 4
    if op is FFN_ACTIVATION_GRAD:
        h = draw(st.lists(st.integers(0, 4), min_size=1, max_size=8))
        return op, {}, [h, h]
    if op is GROUPED_MATMUL:
        form = draw(st.sampled_from(["plain", "transpose_weight", "transpose_x"]))
        attrs = dict(transpose_x=form == "transpose_x", transpose_weight=form == "transpose_weight")
        if form == "transpose_x":
            return op, attrs, [[m, k], [m, n], [draw(DIM)], None]
        g = draw(DIM)
        w = [g, n, k] if form == "transpose_weight" else [g, k, n]
        return op, attrs, [[m, k], w, [g], opt([g, n])]
    if op is WEIGHT_QUANT_GROUPED_MATMUL:
        e = draw(DIM)
        return op, {}, [[m, k], [e, k, n], [e, n], [e]]
    if op is PERMUTE:
        return op, dict(num_experts=draw(DIM)), [[m, n], [m, k]]
    if op is CAST:
        shape = draw(st.lists(st.integers(0, 4), min_size=0, max_size=4))
        return op, dict(dtype=draw(st.sampled_from(["float32", "float16", "bfloat16"]))), [shape]
    if op is DEQUANTIZE:
        e = draw(DIM)
        return op, {}, [[e, k, n], [e, n], [draw(st.integers(0, 9))]]
    if op is RMS_NORM:
        shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        return op, {}, [shape, shape[-1:]]
    if op is ADD_RMS_NORM:
        shape = draw(st.lists(st.integers(0, 4), min_size=1, max_size=4))
        return op, {}, [shape, shape, shape[-1:]]
    if op is DECODE_ATTENTION:
        kv, d = draw(st.integers(1, 3)), 2 * draw(st.integers(1, 4))
        one = [m, kv, 1, d]
        return op, {}, [[m, kv * draw(st.integers(1, 3)), 1, d], one, one, [m, 1, 1, d],
                        [m, 1, 1, d], [m, kv, k, d], [m, kv, k, d], [m, 1, 1, k], []]
    with_probs = draw(st.booleans())
    attrs = dict(with_probs=with_probs, top_k=draw(st.sampled_from([0, k])) if with_probs else k)
    shapes = [[m * k, n], [m * k], [m, k] if with_probs else None]
    return op, attrs, shapes + ([[m, n]] if op is UNPERMUTE_BACKWARD else [])


@st.composite
def partly_known(draw, shape):
    """shape, with some dimensions unknown (-1), or its rank unknown ([-2])."""
    how = draw(st.sampled_from(["known", "last", "some", "rank"]))
    if how == "rank":
        return [-2]
    if how == "known" or not shape:
        return list(shape)
    if how == "last":
        return list(shape[:-1]) + [-1]
    return [-1 if draw(st.booleans()) else d for d in shape]


@given(st.data())
@examples(30)
def test_cpp_and_python_infer_the_same_shapes_of_drawn_calls(infer_shapes, data):
    calls, expected = [], []
    for _ in range(12):  # (one run of the harness for several calls)
        op, attrs, shapes = data.draw(valid_calls())
        resolved = op.resolve(**attrs)
        op.infer(resolved, *shapes)  # the known shapes are a valid call
        given_shapes = [None if s is None else data.draw(partly_known(s)) for s in shapes]
        present = [",".join(map(str, s)) for s in given_shapes if s is not None]
        calls.append((SYMBOLS[op], len(op.outputs), _attrs(op, attrs), present))
        expected.append((op.name, attrs, given_shapes,
                         [tuple(s) for s in op.infer(resolved, *given_shapes)]))
    answers = infer_shapes(calls)
    wrong = [f"{name} {attrs} {shapes}: Python {want}, C++ {got}"
             for (name, attrs, shapes, want), got in zip(expected, answers) if want != got]
    assert len(answers) == len(calls) and not wrong, "\n".join(wrong)


@pytest.mark.parametrize("op,attrs,shapes,want", [
    # T from probs' rows, or from the T*K permuted rows when only K is known, or from grad_out's
    (UNPERMUTE, dict(with_probs=True), [[6, 2], [6], [-1, 3]], [(2, 2)]),
    (UNPERMUTE_BACKWARD, dict(with_probs=True), [[6, 2], [6], [3, -1], [-2]], [(6, 2), (3, -1)]),
    (UNPERMUTE_BACKWARD, dict(with_probs=True), [[-2], [-1], [-1, -1], [9, 2]], [(-2,), (9, -1)]),
])
def test_unpermute_tokens_from_whichever_input_knows_them(infer_shapes, op, attrs, shapes, want):
    assert [tuple(s) for s in op.infer(op.resolve(**attrs), *shapes)] == want
    present = [",".join(map(str, s)) for s in shapes]
    assert infer_shapes([(SYMBOLS[op], len(op.outputs), _attrs(op, attrs), present)]) == [want]
