"""Shared test helpers: device, per-test seeds, execution modes, dtype conversion, tolerances,
finite differences.

The device comes from MS_MOE_OPS_DEVICE (default CPU), so the suite runs unchanged on an Ascend
machine: `MS_MOE_OPS_DEVICE=Ascend pytest`.
"""
import importlib.util
import linecache
import os
import re
import sys
import zlib

import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn, ops

DEVICE = os.environ.get("MS_MOE_OPS_DEVICE", "CPU")
ms.set_device(DEVICE)
ms.set_context(mode=ms.PYNATIVE_MODE)

# -- the sources as loaded ------------------------------------------------------------------------
# GRAPH mode compiles a function from its source text, which MindSpore reads from the file
# (inspect.getsourcelines, through linecache) at the line where the loaded code starts. A source
# file edited while the suite runs therefore makes every later compilation parse what the file
# holds at that line now: once, conftest.run's FnCell around a 3-argument function was compiled
# as `def numpy(t)`, the line FnCell.construct had held when conftest was loaded. So the sources of
# this repository's modules are pinned in linecache as they were loaded (linecache never re-reads
# an entry without a modification time); tests/test_reproducibility.py shows both sides.

_REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# the package's sources too where it is installed (site-packages, not the checkout)
_SOURCES = tuple({_REPOSITORY + os.sep, os.path.dirname(os.path.dirname(os.path.abspath(
    importlib.util.find_spec("ms_moe_ops").origin))) + os.sep})
_PINNED = set()


def pin_source(path):
    """Keeps linecache (hence MindSpore's parser) on the text the file holds now."""
    with open(path, encoding="utf-8") as f:
        lines = f.readlines()
    linecache.cache[path] = (sum(len(line) for line in lines), None, lines, path)
    _PINNED.add(path)


def pin_sources():
    """Pins the source of every module of this repository (and of the package, wherever it is
    installed) loaded and not pinned yet."""
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if (path and path not in _PINNED and path.endswith(".py") and os.path.isabs(path)
                and path.startswith(_SOURCES) and os.path.isfile(path)):
            pin_source(path)


pin_sources()  # conftest itself, as it is being loaded


def pytest_collectreport(report):
    pin_sources()  # each test module (and what it imports) right after its import


def pytest_configure(config):
    # pytest-randomly shuffles the test order (its seed is printed in the header) and by default
    # also reseeds numpy's global generator before each test from that seed; the seeds below
    # come from the test id alone, so a test's data does not depend on the order's seed.
    if config.pluginmanager.hasplugin("randomly"):
        config.option.randomly_reset_seed = False
    config.addinivalue_line("markers", "every_isa: run under every instruction-set path of the CPU "
                                       "kernels (GRAPH-mode cases on the best path only)")
    config.addinivalue_line("markers", "best_isa_only: exempt a test of an every_isa module")
    config.addinivalue_line("markers", "every_isa_by_default: its cases on the lower "
                                       "instruction-set paths stay in the default run (a cheap "
                                       "representative of the slow sweep)")
    config.addinivalue_line("markers", "slow_in_graph: the GRAPH-mode cases of this test are slow "
                                       "(several compilations): they carry the slow marker")
    for name, what in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {what}")


# Checks left out of the default run (setup.cfg's addopts deselects them; `.ci/run` and
# `pytest -m ""` run everything). Each says why it is not in the few-minute default run.
MARKERS = {
    "slow": "a long check (fuzzing, the sweep over the lower instruction-set paths, whole-matrix "
            "dry runs, end-to-end example runs, checks above ~5 s)",
    "distributed": "launches several processes with msrun",
    "hosts": "cross-compiles and emulates other hosts (aarch64, macOS, Windows)",
}


# -- hypothesis profiles ----------------------------------------------------------------------------
# The property tests (tests/test_properties*.py) run a few examples each in the default run, the
# same ones every time (derandomize: a failure is reproduced by running the test again, and no
# example database is kept between runs); HYPOTHESIS_PROFILE=ci (.ci/run's long pass) runs ten
# times as many. The function-scoped fixtures of this file (seeds, mode, the instruction-set path)
# are set once per test, the same for all of its examples, as intended.
PROFILE_ENV = "HYPOTHESIS_PROFILE"
DEFAULT_EXAMPLES = 10
try:
    from hypothesis import HealthCheck, settings as _hypothesis_settings
except ImportError:  # (the test extra installs it; the property tests skip without it)
    _hypothesis_settings = None
else:
    _QUIET = [HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
              HealthCheck.data_too_large, HealthCheck.filter_too_much]
    _hypothesis_settings.register_profile(
        "default", derandomize=True, database=None, deadline=None, print_blob=True,
        max_examples=DEFAULT_EXAMPLES, suppress_health_check=_QUIET)
    _hypothesis_settings.register_profile("ci", _hypothesis_settings.get_profile("default"),
                                          max_examples=10 * DEFAULT_EXAMPLES)
    _hypothesis_settings.load_profile(os.environ.get(PROFILE_ENV, "default"))


def examples(n):
    """Hypothesis settings for a property worth n examples in the default run (scaled by the
    profile: ten times as many under HYPOTHESIS_PROFILE=ci)."""
    current = _hypothesis_settings.default.max_examples
    return _hypothesis_settings(max_examples=max(1, n * current // DEFAULT_EXAMPLES))


def pytest_terminal_summary(terminalreporter, config):
    # the order's seed also at the end, where `pytest -q` (which drops the header) shows it
    if config.pluginmanager.hasplugin("randomly"):
        terminalreporter.write_line(f"random test order: --randomly-seed="
                                    f"{config.getoption('randomly_seed')} repeats it")


def seed_of(nodeid):
    """A stable seed of its own for every test (from its id, so order and selection do not
    change the data a test sees). The instruction-set path is left out of the id: every path
    of a test sees the same data."""
    nodeid = re.sub(r"\[(?:generic|avx2|avxvnni|avx512|dotprod)\]|(?<=\[)(?:generic|avx2|avxvnni|avx512|dotprod)-|"
                    r"-(?:generic|avx2|avxvnni|avx512|dotprod)(?=[-\]])", "", nodeid)
    return zlib.crc32(nodeid.encode())


@pytest.fixture(autouse=True)
def _isolated(request):
    """Every test starts from the same global state: seeds set from its own id, PyNative mode."""
    pin_sources()  # modules a test imported late
    seed = seed_of(request.node.nodeid)
    ms.set_seed(seed % (2 ** 31))
    np.random.seed(seed)
    ms.set_context(mode=ms.PYNATIVE_MODE)
    yield
    ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.fixture(scope="session", autouse=True)
def _ascend_implementations_build():
    """After the session, on CPU: every Ascend implementation builds for every attribute set any
    test used, so a registration MindSpore would refuse on Ascend fails here."""
    yield
    if DEVICE != "CPU":
        return
    from ms_moe_ops.ops import _op  # pylint: disable=import-outside-toplevel

    failures = []
    for op, items in _op.built_attribute_sets():
        for impl in op.impls:
            # the C++ extension route compiles against MindSpore and CANN when it is built: its
            # sources are compiled against the stub CANN tree by tests/test_ascend_extension.py
            if impl.target == "Ascend" and impl.route != "extension":
                try:
                    impl.build(op, dict(items))
                except Exception as error:  # pylint: disable=broad-except
                    failures.append(f"{op.name} {impl.name} {dict(items)}: {error}")
    if failures:
        pytest.fail("Ascend implementations that do not build:\n" + "\n".join(failures))


@pytest.fixture
def rng(request):
    """numpy Generator seeded from the test's id: the test's own reproducible data."""
    return np.random.default_rng(seed_of(request.node.nodeid))


def cpu_only(reason):
    """Skip marker for tests that only make sense on the CPU backend (says why)."""
    return pytest.mark.skipif(DEVICE != "CPU", reason=f"CPU only: {reason}")

DTYPES = {"float32": ms.float32, "float16": ms.float16, "bfloat16": ms.bfloat16}
# Per-element relative tolerance against a float64 golden model computed on the same (rounded)
# inputs. For float16/bfloat16 it is the largest relative error of one rounding to nearest (half
# an ulp: 2^-11, 2^-8), so a correctly rounded output passes and an error of one ulp fails.
RTOL = {"float32": 1e-5, "float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
# Mantissa bits and smallest normal exponent of each dtype (for ulps).
_FORMAT = {"float32": (23, -126), "float16": (10, -14), "bfloat16": (7, -126)}


def tensor(array, dtype=None):
    """numpy -> Tensor; dtype may be a name ("bfloat16") or a MindSpore dtype."""
    array = np.asarray(array)
    if dtype is None:
        return Tensor(array)
    dtype = DTYPES.get(dtype, dtype)
    return Tensor(array.astype(np.float32), dtype) if dtype == ms.bfloat16 else Tensor(array, dtype)


def numpy(t):
    """Tensor -> numpy (bfloat16 through float32)."""
    if t.dtype == ms.bfloat16:
        t = t.astype(ms.float32)
    return t.asnumpy()


def rounded(array, dtype):
    """array as it looks after rounding to dtype (what an input of that dtype holds)."""
    return numpy(tensor(np.asarray(array, np.float32), dtype)).astype(np.float64)


class FnCell(nn.Cell):
    """A function as a Cell (GRAPH mode compiles Cells)."""

    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def construct(self, *args):
        return self.fn(*args)


def run(fn, *args, mode="pynative"):
    """Calls fn(*args) in PyNative, or compiled as a GRAPH-mode Cell."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        return FnCell(fn)(*args)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def grad(fn, *args, mode="pynative", argnums=0):
    """Gradient of the scalar fn(*args) with respect to args[argnums] (an int or a tuple)."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        return ms.grad(FnCell(fn), grad_position=argnums)(*args)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def nan_pool(mode):
    """Leaves NaN in freed blocks of MindSpore's memory pool. A CPU kernel that skips an empty
    input leaves its output as the pool had it: the zero-token paths must not depend on what the
    tests before them happened to leave there."""
    import gc  # pylint: disable=import-outside-toplevel

    def poison(x):
        y = x * np.nan
        return y + 1, (y * 2).sum(), ops.exp(y)

    sizes = (1, 4, 16, 64, 128, 256, 1024)
    blocks = [Tensor(np.full((n,), np.nan, np.float32)) * 1 for n in sizes for _ in range(20)]
    del blocks
    for n in sizes:
        run(poison, Tensor(np.ones((n,), np.float32)), mode=mode)
    # (one collection: each takes seconds late in the suite, with many objects alive)
    gc.collect()


def finite_diff(f, x, eps=1e-6):
    """Central differences of the scalar f (numpy, float64) at x."""
    x = np.array(x, np.float64)
    g = np.zeros_like(x)
    flat, gflat = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        hi = f(x)
        flat[i] = old - eps
        lo = f(x)
        flat[i] = old
        gflat[i] = (hi - lo) / (2 * eps)
    return g


def _report(actual, expected, bound, what):
    err = np.abs(actual - expected)
    bad = err > bound
    if bad.any():
        i = np.unravel_index(np.argmax(err - bound), err.shape)
        raise AssertionError(f"{int(bad.sum())} of {bad.size} elements off by more than {what}; "
                             f"worst at {tuple(int(v) for v in i)}: got {actual[i]!r}, expected "
                             f"{expected[i]!r} (error {err[i]:.3g} > {bound[i]:.3g})")


def assert_close(actual, expected, dtype="float32", rtol=None, atol=None):
    """Element by element: |actual - expected| <= rtol * |expected| + atol.

    rtol defaults to RTOL[dtype]; atol, a floor for elements near zero (where cancellation makes
    a relative bound meaningless), defaults to rtol * max|expected| / 20; it may be an array
    (for example rtol times the size of the terms that were summed).
    """
    actual = np.asarray(actual, np.float64)
    expected = np.asarray(expected, np.float64)
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    rtol = RTOL[dtype] if rtol is None else rtol
    if atol is None:
        atol = rtol * float(np.abs(expected).max(initial=0.0)) / 20
    bound = rtol * np.abs(expected) + atol
    _report(actual, expected, np.broadcast_to(bound, expected.shape),
            f"rtol={rtol:.3g}, atol={np.max(atol):.3g} ({dtype})")


def ulp(values, dtype):
    """The spacing of dtype's numbers at each value's magnitude (subnormal spacing near 0)."""
    bits, min_exp = _FORMAT[dtype]
    mag = np.abs(np.asarray(values, np.float64))
    exp = np.floor(np.log2(np.where(mag > 0, mag, 1.0)))
    return np.exp2(np.maximum(exp, min_exp) - bits)


def assert_rounded(actual, exact, dtype, err=None):
    """Every element of a float16/bfloat16 output is the exact result rounded to nearest: within
    half an ulp of `exact` (the float64 golden value on the same inputs), plus `err`, the
    float32 arithmetic's own error before the rounding (default 2e-6 * |exact|; pass a bound such
    as 1e-6 * (|A| @ |B|) for sums that cancel). A truncating or once-more rounded output is off
    by up to a whole ulp and fails."""
    actual = np.asarray(actual, np.float64)
    exact = np.asarray(exact, np.float64)
    assert actual.shape == exact.shape, (actual.shape, exact.shape)
    err = 2e-6 * np.abs(exact) if err is None else err
    bound = 0.5 * ulp(exact, dtype) + err
    _report(actual, exact, np.broadcast_to(bound, exact.shape), f"half an ulp ({dtype})")


@pytest.fixture(params=["pynative", "graph"])
def mode(request):
    return request.param


@pytest.fixture(params=list(DTYPES))
def dtype(request):
    return request.param


# ---------------------------------------------------------------------------------------------
# Instruction-set paths of the CPU kernels: a module or test marked `every_isa` runs once per path
# this CPU offers (generic, avx2, avx512), through MS_MOE_OPS_ISA, which the kernels read at every
# call. GRAPH-mode cases run the same kernels, so they run on the best path only.

def isa_paths():
    """The instruction-set paths the kernel library offers on this CPU, lowest first ([] when
    the kernels cannot run here: every operator then runs as its composition)."""
    import ctypes
    from ms_moe_ops.ops._impls import kernel_library, kernel_library_missing

    if kernel_library_missing():
        return []
    lib = ctypes.CDLL(kernel_library())
    lib.MsMoeOpsIsaPaths.restype = ctypes.c_char_p
    return lib.MsMoeOpsIsaPaths().decode().split()


def kernels_missing():
    """'' when this package's CPU kernels run here, else why not (not built, not on CPU, ...)."""
    from ms_moe_ops.ops._impls import kernel_library_missing

    return kernel_library_missing() if DEVICE == "CPU" else "CPU only"


def needs_kernels(what="needs the CPU kernel library", other_devices_too=False):
    """Skip marker for tests of what only the CPU kernels do on CPU (their ABI, paths, data
    checks, exact roundings): says why they cannot run here when they cannot. On another device
    the test is skipped too, unless other_devices_too (it then runs on that device's
    implementations)."""
    if DEVICE != "CPU":
        return pytest.mark.skipif(not other_devices_too, reason=f"{what}: CPU only")
    why = kernels_missing()
    return pytest.mark.skipif(bool(why), reason=f"{what}: {why}")


def pytest_generate_tests(metafunc):
    marked = metafunc.definition.get_closest_marker
    if DEVICE == "CPU" and marked("every_isa") and not marked("best_isa_only") and isa_paths():
        metafunc.parametrize("isa", isa_paths(), indirect=True)


def _params(item):
    spec = getattr(item, "callspec", None)
    return spec.params if spec else {}


@pytest.hookimpl(tryfirst=True)  # before -m selects by the markers added here
def pytest_collection_modifyitems(config, items):
    for item in items:
        if _params(item).get("mode") == "graph" and item.get_closest_marker("slow_in_graph"):
            item.add_marker(pytest.mark.slow)
    if DEVICE != "CPU" or not isa_paths():
        return
    best = isa_paths()[-1]
    keep, drop = [], []
    for item in items:
        params = _params(item)
        lower = params.get("isa", best) != best
        if lower and not item.get_closest_marker("every_isa_by_default"):
            item.add_marker(pytest.mark.slow)  # the sweep over the lower paths: the full run's
        (drop if lower and params.get("mode") == "graph" else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


@pytest.fixture(autouse=True)
def isa(request, monkeypatch):
    """The path a test marked every_isa runs on (None: the default, the best path)."""
    path = getattr(request, "param", None)
    if path is not None:
        monkeypatch.setenv("MS_MOE_OPS_ISA", path)
    return path


# ---------------------------------------------------------------------------------------------
# MindSpore's deprecation warnings caused by the package fail the test that caused them (the
# APIs MindSpore only documents as deprecated are found by tests/test_deprecations.py).

def package_directory():
    """Where the imported ms_moe_ops really lives (a checkout, an editable install or
    site-packages): the tests themselves may sit in a folder of the same name (a clone)."""
    import ms_moe_ops

    return os.path.dirname(os.path.realpath(ms_moe_ops.__file__))


def in_directory(path, directory):
    """Whether the file `path` lies inside `directory` (both compared as real paths)."""
    return os.path.realpath(path).startswith(directory + os.sep)


class _DeprecationsFromThePackage:
    """A handler on MindSpore's logger keeping the deprecation notices raised with a frame of
    ms_moe_ops on the stack."""

    def __init__(self):
        import logging
        import traceback

        self.found = []
        package = package_directory()
        handler = logging.Handler(logging.WARNING)

        def emit(record):
            message = record.getMessage()
            if "deprecated" in message.lower() and any(
                    in_directory(frame.filename, package) for frame in traceback.extract_stack()):
                self.found.append(message)

        handler.emit = emit
        self.handler = handler


@pytest.fixture(scope="session")
def _deprecation_watch():
    from ms_moe_ops._compat import mindspore_logger

    watch = _DeprecationsFromThePackage()
    logger = mindspore_logger()
    logger.addHandler(watch.handler)
    yield watch
    logger.removeHandler(watch.handler)


@pytest.fixture(autouse=True)
def _no_deprecated_mindspore_api(_deprecation_watch):
    yield
    found, _deprecation_watch.found[:] = list(_deprecation_watch.found), []
    if found:
        pytest.fail("the package called MindSpore APIs that MindSpore says are deprecated:\n"
                    + "\n".join(found))
