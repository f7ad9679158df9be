"""The CPU kernel library: where it is, what was built (setup.py's record beside it), whether
MindSpore can run it here, and the one message that says so when it cannot.

MindSpore 2.10 runs `ops.Custom` primitives on Linux only: `Custom.__init__` calls
`_check_platform`, which raises "Custom op only supported on Linux platform currently." elsewhere
(read through `_compat.custom_platform_refusal`), and its CPU AOT kernel (custom_aot_cpu_kernel.cc) has
no Windows loader. On macOS and Windows every operator therefore runs as its composition, whether
or not the library was built.
"""
import functools
import glob
import json
import logging
import os
import sys

from .. import _compat

_HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = "_kernels_build.json"
_SUFFIXES = (".so", ".dylib", ".dll")
_log = logging.getLogger("ms_moe_ops")
_told = []


def library_path():
    """Path of the built library, or None."""
    found = sorted(p for p in glob.glob(os.path.join(_HERE, "_kernels*")) if p.endswith(_SUFFIXES))
    return found[0] if found else None


def build_record():
    """What setup.py recorded ({'built': ..., 'reason' or 'compiler', 'paths', ...}), or {} when
    there is no record (a build of an older setup.py, or none at all)."""
    try:
        with open(os.path.join(_HERE, RECORD)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def custom_ops_refused():
    """'' when MindSpore runs Custom primitives on this platform, else its reason."""
    error = _compat.custom_platform_refusal()
    if not error:
        return ""
    import mindspore  # pylint: disable=import-outside-toplevel

    return f"MindSpore {mindspore.__version__} runs Custom operators on Linux only ({error})"


def kernel_library_missing():
    """'' when the CPU kernels can run here, else why not. The first time it is not '' in a
    process, the reason is also logged once (WARNING, logger "ms_moe_ops")."""
    why = _unusable()
    if why and not _told:
        _told.append(why)
        _log.warning("ms_moe_ops: the CPU kernels are not used: %s. Every operator runs as a "
                     "composition of MindSpore ops (correct, slower); `python -m ms_moe_ops.info` "
                     "says what runs where.", why)
    return why


@functools.lru_cache(None)
def _unusable():
    if library_path() is None:
        record = build_record()
        reason = record.get("reason") if record.get("built") is False else None
        if reason:
            return f"the CPU kernel library was not built when the package was installed: {reason}"
        return ("the CPU kernel library was not built (no C++ compiler when the package was "
                "installed?); reinstall with one (`pip install -v .`) for the fast kernels")
    return custom_ops_refused()


def kernel_library():
    """Path of the compiled CPU kernels (built by `pip install`), its BLAS loaded first."""
    path = library_path()
    if path is None:
        raise RuntimeError(f"ms_moe_ops: {_unusable()}")
    _preload_blas()
    return path


@functools.lru_cache(None)
def _preload_blas():
    # The kernels link the BLAS by name; load it globally first so MindSpore's dlopen of the
    # kernel library finds it wherever pip put it (Windows has no run path at all).
    import ctypes  # pylint: disable=import-outside-toplevel
    import scipy_openblas32  # pylint: disable=import-outside-toplevel

    libdir = scipy_openblas32.get_lib_dir()
    suffix = {"darwin": ".dylib", "win32": ".dll"}.get(sys.platform, ".so")
    found = sorted(glob.glob(os.path.join(libdir, f"*scipy_openblas*{suffix}")))
    if found:
        ctypes.CDLL(found[0], mode=ctypes.RTLD_GLOBAL)
