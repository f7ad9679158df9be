"""`python -m ms_moe_ops.info`'s report, exactly: for every operator, device and mode the
implementation it names is the one the resolver really picks for a call (the one that runs, here),
the implementations it says were passed over are the resolver's (one of another device is not
passed over: it never runs here), and the instruction-set line names the path a kernel call takes.
Evidence apart from info.py: the resolver's own choice and log (ms_moe_ops.ops._op.choose), the
calls themselves (record_choices), the CPU's flags."""
import logging
import platform
import re

import numpy as np
import pytest

from ms_moe_ops import info
from ms_moe_ops.ops import OPERATORS, _op, _platform, record_choices
from cases import CASES, op_input
from conftest import DEVICE, isa_paths, kernels_missing, run

# the first case of each operator (tests/cases.py)
FIRST = {}
for _name in sorted(CASES):
    FIRST.setdefault(CASES[_name](np.random.default_rng(0), "float32")[0], _name)
PLATFORMS = [("CPU", ""), ("Ascend", _platform.A2), ("Ascend", _platform.A3),
             ("Ascend", _platform.ASCEND_950)]


def _call(op):
    _, inputs, attrs, _ = CASES[FIRST[op]](np.random.default_rng(1), "float32")
    args = [op_input(a, "float32") for a in inputs]
    signature = tuple(None if a is None else (a.dtype, tuple(a.shape)) for a in args)
    return args, attrs, signature


def _resolver(op, target, soc, mode, caplog):
    """(name, [passed over]) as the resolver decides and logs them for op's first case."""
    args, attrs, signature = _call(op)
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger="ms_moe_ops"):
        try:
            name = _op.choose(op, tuple(op.resolve(**attrs).items()), (target, soc, mode, None),
                              signature).name
        except NotImplementedError:
            return None, None
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith(op.name + ":")]
    passed = re.search(r"passed over: (.*)$", said[-1]) if said else None
    listed = [] if passed is None or passed.group(1) == "none" else passed.group(1).split("; ")
    return name, listed


@pytest.mark.parametrize("target,soc", PLATFORMS, ids=["CPU", "A2", "A3", "950"])
@pytest.mark.parametrize("mode", ["graph", "pynative"])
def test_each_row_is_the_resolvers_choice(target, soc, mode, caplog):
    for op in OPERATORS:
        name, passed = info.resolution(op, target, soc, mode)
        expected, expected_passed = _resolver(op, target, soc, mode, caplog)
        assert name == expected, (op.name, name, expected)
        if expected is not None:
            assert passed == expected_passed, (op.name, passed, expected_passed)
        others = {i.name for i in op.impls if i.target not in (None, target)}
        assert not [p for p in passed if p.split(" (")[0] in others], (op.name, passed)


def _rows():
    lines = info.report()
    start = next(i for i, line in enumerate(lines) if line.startswith("operator "))
    rows = {}
    for line in lines[start + 1:]:
        if line.startswith("["):
            break
        name, graph, pynative = re.split(r"\s{2,}", line.strip())
        rows[name] = (graph, pynative)
    notes = [line for line in lines[start + 1:] if line.startswith("[")]
    return rows, notes


@pytest.mark.skipif(DEVICE != "CPU", reason="the report of a CPU host")
def test_the_report_names_what_runs():
    """Each operator's PyNative cell names the implementation a call runs (its first case,
    called), and its passed-over marks point at notes of implementations of this device. (The
    GRAPH column is the resolver's choice: test_each_row_is_the_resolvers_choice.)"""
    mode = "pynative"
    rows, notes = _rows()
    assert sorted(rows) == sorted(op.name for op in OPERATORS)
    column = 0 if mode == "graph" else 1
    for op in OPERATORS:
        args, attrs, _ = _call(op)
        def call(*xs):
            return op(*xs, **attrs)

        with record_choices() as ran:
            run(call, *args, mode=mode)
        cell = rows[op.name][column]
        assert (op.name, cell.split(" (")[0]) in ran, (op.name, cell, ran)
        for mark in re.findall(r"\[(\d+)\]", cell):
            note = notes[int(mark) - 1]
            impl = op.impl(note.split("] ", 1)[1].split(" (")[0])
            assert impl is not None and impl.target in (None, DEVICE), (op.name, note)


@pytest.mark.skipif(platform.machine() != "x86_64" or DEVICE != "CPU", reason="x86-64 CPU")
@pytest.mark.skipif(bool(kernels_missing()), reason="needs the CPU kernel library")
def test_the_path_line_names_the_path_a_call_takes(monkeypatch):
    """Unforced, a kernel call takes the best path this CPU runs (from /proc/cpuinfo's flags, as
    test_isa.py::test_paths_follow_the_cpu_flags), and the report says that one."""
    monkeypatch.delenv("MS_MOE_OPS_ISA", raising=False)
    with open("/proc/cpuinfo") as f:
        flags = set(next(line for line in f if line.startswith("flags")).split(":")[1].split())
    v3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"} <= flags
    v4 = v3 and {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"} <= flags
    best = "avx512" if v4 else "avxvnni" if v3 and "avx_vnni" in flags else "avx2" if v3 else "generic"
    assert isa_paths()[-1] == best
    line, = [line for line in info.report() if "a kernel call takes" in line]
    assert line.endswith(f"a kernel call takes {best} (the best this CPU offers)"), line
    assert f"this CPU runs {' '.join(isa_paths())};" in line, line
