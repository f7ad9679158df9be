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
