"""The CPU kernels' instruction-set paths and hosts: which paths a CPU gets, how MS_MOE_OPS_ISA
forces one, that the generic path runs on any x86-64 CPU, rounding to float16/bfloat16 exactly to
nearest-even on every path (the AVX-512, F16C and plain conversions are separate code), the
builds for other hosts (tools/check_hosts.py, marked `hosts`), and what happens where MindSpore
cannot run the kernels (no compiler at install time, or a platform MindSpore refuses)."""
import glob
import json
import logging
import os
import platform
import shutil
import subprocess
import sys

import numpy as np
import pytest
from mindspore import ops as ms_ops

from ms_moe_ops import moe_token_unpermute, swiglu_group
from ms_moe_ops import info
from ms_moe_ops.ops import OPERATORS, _library, _op
from ms_moe_ops.ops._impls import kernel_library
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP
from cases import CASES, compare, op_input
from conftest import DEVICE, isa_paths, kernels_missing, needs_kernels, numpy, tensor

pytestmark = [pytest.mark.every_isa, pytest.mark.skipif(DEVICE != "CPU", reason="CPU only: "
                                                        "the CPU kernels' instruction sets")]
kernels = needs_kernels()
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
x86_only = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 paths")


def cpu_flags():
    with open("/proc/cpuinfo") as f:
        return next(line for line in f if line.startswith("flags")).split(":")[1].split()


@x86_only
@kernels
@pytest.mark.best_isa_only
def test_paths_follow_the_cpu_flags():
    flags = set(cpu_flags())
    v3 = {"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe", "abm"} <= flags
    vnni = v3 and "avx_vnni" in flags
    v4 = v3 and {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_vnni"} <= flags
    assert isa_paths() == ["generic"] + ["avx2"] * v3 + ["avxvnni"] * vnni + ["avx512"] * v4


@x86_only
@kernels
@pytest.mark.best_isa_only
@pytest.mark.skipif(shutil.which("objdump") is None, reason="needs objdump (binutils)")
def test_generic_path_uses_only_baseline_x86_64():
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_baseline.py"),
                           kernel_library()], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr


@kernels
@pytest.mark.best_isa_only
@pytest.mark.parametrize("value, words", [("sse9", "is not a path"), ("AVX2", "is not a path")])
def test_unknown_path_is_a_clear_error(value, words, monkeypatch, capfd):
    monkeypatch.setenv("MS_MOE_OPS_ISA", value)
    with pytest.raises(RuntimeError):
        numpy(swiglu_group(tensor(np.ones((2, 4), np.float32)))[0])
    assert f"MS_MOE_OPS_ISA={value} {words}" in capfd.readouterr().err


@kernels
@pytest.mark.every_isa_by_default
def test_every_case_of_every_kernel_on_this_path(isa, monkeypatch):
    """Each operator's cases (tests/cases.py) on the kernel, against the golden model, on every
    instruction-set path this CPU runs, in the default run: the paths below the best one were
    checked only by the slow sweep, where a path's own mistake (the avx2 int8 product's -128
    correction, a vector store's rounding) hid from the default run. (float32 here; the
    half-precision stores of every path: test_*_round_half_to_even below.)"""
    dtype = "float32"
    monkeypatch.setenv("MS_MOE_OPS_IMPL", "kernel")
    for name in sorted(CASES):
        op, inputs, attrs, golden = CASES[name](np.random.default_rng(7), dtype)
        args = [op_input(a, dtype) for a in inputs]
        outs = op(*args, **attrs)
        try:
            compare(outs if isinstance(outs, tuple) else (outs,), golden, dtype)
        except AssertionError as error:
            raise AssertionError(f"{name} on {isa or 'the best path'}: {error}") from None


def _built_paths():
    import ctypes

    if kernels_missing():
        return []
    lib = ctypes.CDLL(kernel_library())
    lib.MsMoeOpsIsaBuilt.restype = ctypes.c_char_p
    return lib.MsMoeOpsIsaBuilt().decode().split()


def _near_misses(paths):
    """Spellings next to each path's name: every proper prefix ("avx", "avx51"), one letter more,
    upper case, spaces around; none of them a path's name."""
    out = set()
    for p in paths:
        out.update(p[:i] for i in range(1, len(p)))
        out.update({p + "x", p + "0", p.upper(), f" {p}", f"{p} ", f"{p},{p}"})
    return sorted(out - set(paths))


@kernels
@pytest.mark.best_isa_only
def test_every_accepted_spelling_is_exact(monkeypatch, capfd):
    """MS_MOE_OPS_ISA takes exactly the name of a path this CPU runs, and nothing near one: a
    prefix matched as a path ("avx" as avx2, "avx51" as avx512) would run a path nobody asked
    for. The kernels (which read it at every call) and `info`'s report agree on every spelling."""
    built, here = _built_paths(), isa_paths()
    misses = _near_misses(built)
    assert "avx" in misses and "avx51" in misses or platform.machine() != "x86_64", misses
    x = tensor(np.ones((2, 4), np.float32))
    for value in built + misses:
        monkeypatch.setenv("MS_MOE_OPS_ISA", value)
        report = "\n".join(line for line in info.report() if "a kernel call takes" in line)
        if value in here:
            numpy(swiglu_group(x)[0])
            assert f"takes {value} (forced by MS_MOE_OPS_ISA)" in report, (value, report)
            continue
        with pytest.raises(RuntimeError):
            numpy(swiglu_group(x)[0])
        said = capfd.readouterr().err
        words = "is not a path" if value not in built else "has no"
        assert f"MS_MOE_OPS_ISA={value}" in said and words in said, (value, said)
        assert f"none: MS_MOE_OPS_ISA={value} is not a path this CPU runs" in report, (value, report)


def unit(values, bits):
    """The spacing of a float with `bits` stored mantissa bits around each finite non-zero value
    (float32's exponent range); 1 elsewhere."""
    finite = np.isfinite(values) & (values != 0)
    magnitude = np.abs(values, where=finite, out=np.ones_like(values))
    return 2.0 ** (np.floor(np.log2(magnitude)) - bits), finite


def rne(values, dtype):
    """values (exact in float64) rounded to nearest-even in float16/bfloat16, computed without
    the kernels' algorithm: numpy's float16 cast, and np.rint on the scaled bfloat16 significand
    (float32's exponent range: no subnormal or overflow case)."""
    values = np.asarray(values, np.float64)
    if dtype == "float16":
        with np.errstate(over="ignore", invalid="ignore"):
            return values.astype(np.float32).astype(np.float16).astype(np.float64)
    step, finite = unit(values, 7)
    return np.where(finite, np.rint(values / step) * step, values)


def ties(values, dtype):
    """Which values lie exactly half-way between two neighbours of dtype (normal range)."""
    values = np.asarray(values, np.float64)
    step, finite = unit(values, 10 if dtype == "float16" else 7)
    fraction = np.zeros_like(values)
    fraction[finite] = (values[finite] / step[finite]) % 1
    return fraction == 0.5


@pytest.mark.every_isa_by_default  # (each path has its own vector stores)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_swiglu_stores_round_half_to_even(dtype, rng):
    # gate >= 88 makes sigmoid(gate) exactly 1, so y = gate * up exactly in float32, then rounded
    # to dtype by the kernel's block store (vectors of 16 and a scalar tail: H = 71)
    bits = 11 if dtype == "float16" else 8
    gate = rng.integers(88, 256, 200_000).astype(np.float64)
    up = rng.integers(2 ** (bits - 1), 2 ** bits, 200_000) * 2.0 ** (1 - bits) * rng.choice([-1, 1], 200_000)
    product = gate * up
    half_way = ties(product, dtype)
    pick = np.concatenate([np.flatnonzero(half_way)[:142], np.flatnonzero(~half_way)[:142]])
    rng.shuffle(pick)
    gate, up, product = gate[pick].reshape(4, 71), up[pick].reshape(4, 71), product[pick].reshape(4, 71)
    assert ties(product, dtype).sum() == 142
    y, y_origin = SWIGLU_GROUP(tensor(np.concatenate([gate, up], axis=1), dtype), None, None,
                               clamp_limit=0.0)
    np.testing.assert_array_equal(numpy(y), rne(product, dtype))
    np.testing.assert_array_equal(numpy(y_origin), rne(product, dtype))


@pytest.mark.every_isa_by_default
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_scalar_conversions_round_half_to_even(dtype, rng):
    # an unpermute with one slot per token: out[t, j] = probs[t] * row[j] in float32 (exact:
    # powers of two), rounded to dtype one value at a time. Ties, float16 subnormals and
    # float16 overflow included.
    t = 512
    row = np.array([1.0, 2.0 ** -8, 2.0 ** -14, 2.0 ** -20, 2.0 ** -24, 2.0 ** 8, 2.0 ** 15, 0.125])
    bits = (rng.integers(105, 130, t).astype(np.uint32) << 23) | rng.integers(0, 1 << 23, t).astype(np.uint32)
    bits[0::3] = (bits[0::3] & ~np.uint32(0x1FFF)) | 0x1000  # float16 ties
    bits[1::3] = (bits[1::3] & ~np.uint32(0xFFFF)) | 0x8000  # bfloat16 ties
    bits[1::2] |= np.uint32(0x80000000)
    probs = bits.view(np.float32).reshape(t, 1)
    # by hand, times the row's powers of two: 65520 (ties to inf in float16) and 65519; float16
    # subnormal ties 1.5 * 2^-24, 2^-25, 2.5 * 2^-24; ties next to 1 in float16 (2^-11) and
    # bfloat16 (2^-8); infinities and NaN
    probs[:13, 0] = [65520 * 2.0 ** -15, 65519 * 2.0 ** -15, 1.5, 0.5, 2.5, 1 + 2.0 ** -11,
                     1 + 3 * 2.0 ** -11, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, np.inf, -np.inf, np.nan, 0.0]
    expected = probs.astype(np.float64) * row
    assert ties(expected, dtype).sum() > t // 4
    out = moe_token_unpermute(tensor(np.tile(row, (t, 1)), dtype), tensor(np.arange(t, dtype=np.int32)),
                              tensor(probs))
    np.testing.assert_array_equal(numpy(out), rne(expected, dtype))


@x86_only
@kernels
@pytest.mark.hosts
@pytest.mark.best_isa_only
@pytest.mark.parametrize("group", ["x86", "aarch64", "windows", "macos"])
def test_other_hosts_agree(group):
    """tools/check_hosts.py, one host group: x86 (older CPUs under qemu), aarch64 (qemu, with and
    without the dot product), windows (MinGW-w64, Wine), macos (zig cross link, no run)."""
    if not glob.glob(os.path.join(ROOT, "ms_moe_ops", "_kernels*.so")):
        pytest.skip("the package is not built in place (ms_moe_ops/_kernels*.so)")
    # a work folder per group: each run builds and runs the native harness in it, and the groups
    # may run at once (pytest -n 2)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "tools", "check_hosts.py"),
                           "--hosts", group, "--work", os.path.join(ROOT, "build", "hosts", group)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode == 3:
        pytest.skip(done.stderr.strip())
    assert done.returncode == 0, done.stdout[-5000:] + done.stderr[-3000:]
    assert "all outputs agree" in done.stdout


# -- where the kernels cannot run -------------------------------------------------------------

def _setup(tmp_path, **env):
    """setup.py build_ext into tmp_path with the given environment: (exit status, output, the
    record it wrote or None)."""
    done = subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib",
                           str(tmp_path / "lib"), "--build-temp", str(tmp_path / "temp")],
                          cwd=ROOT, env=dict(os.environ, **env), capture_output=True, text=True,
                          timeout=300)
    record = tmp_path / "lib" / "ms_moe_ops" / _library.RECORD
    data = json.loads(record.read_text()) if record.exists() else None
    return done.returncode, done.stdout + done.stderr, data


@pytest.mark.best_isa_only
def test_install_without_a_compiler_says_why(tmp_path):
    status, output, record = _setup(tmp_path, CXX="false", MS_MOE_OPS_REQUIRE_KERNELS="0")
    assert status == 0, output
    assert record["built"] is False and "`false -dumpmachine`" in record["reason"], record
    assert "the CPU kernels are NOT built" in output and record["reason"] in output
    assert not [p for p in os.listdir(tmp_path / "lib" / "ms_moe_ops") if p.startswith("_kernels.")]


@pytest.mark.best_isa_only
def test_required_kernels_make_a_missing_compiler_an_error(tmp_path):
    status, output, _ = _setup(tmp_path, CXX="no-such-compiler", MS_MOE_OPS_REQUIRE_KERNELS="1")
    assert status != 0 and "no C++ compiler found ('no-such-compiler')" in output


@pytest.fixture
def no_library(monkeypatch):
    """The package as installed without the library, the reason recorded by setup.py."""
    monkeypatch.setattr(_library, "library_path", lambda: None)
    monkeypatch.setattr(_library, "build_record",
                        lambda: {"built": False, "reason": "no C++ compiler found ('c++')"})
    monkeypatch.setattr(_library, "_told", [])
    _library._unusable.cache_clear()
    _op.choose.cache_clear()
    yield
    _library._unusable.cache_clear()
    _op.choose.cache_clear()


@pytest.mark.best_isa_only
def test_without_the_library_every_operator_is_a_composition_said_once(no_library, caplog):
    caplog.set_level(logging.WARNING, logger="ms_moe_ops")
    for op in OPERATORS:
        for mode in ("graph", "pynative"):
            assert info.resolution(op, "CPU", "", mode)[0] == "composition", (op.name, mode)
    x = tensor(np.ones((2, 4), np.float32))
    for _ in range(2):  # two calls through the resolver, which passes the kernel over
        np.testing.assert_allclose(numpy(swiglu_group(x)), np.full((2, 2), 1 / (1 + np.exp(-1))),
                                   rtol=1e-6)
    warnings = [r.getMessage() for r in caplog.records if "CPU kernels are not used" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "no C++ compiler found ('c++')" in warnings[0] and "composition" in warnings[0]
    report = "\n".join(info.report())
    assert "not built: no C++ compiler found" in report and "composition ([1] passed over)" in report


@pytest.mark.best_isa_only
def test_mindspore_refuses_custom_operators_off_linux(monkeypatch):
    """The fact the package relies on (MindSpore 2.10: ops.Custom runs on Linux only), read from
    MindSpore itself: on another platform its Custom primitive cannot even be built, and the
    kernels are passed over with MindSpore's reason."""
    monkeypatch.setattr(platform, "system", lambda: "Darwin")
    with pytest.raises(Exception, match="Linux"):
        ms_ops.Custom("lib.so:Fn", out_shape=lambda x: x, out_dtype=lambda x: x, func_type="aot")
    why = _library.custom_ops_refused()
    assert "runs Custom operators on Linux only" in why
    monkeypatch.setattr(platform, "system", lambda: "Linux")
    assert _library.custom_ops_refused() == ""
