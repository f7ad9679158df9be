"""What this installation runs here: `python -m ms_moe_ops.info`.

Prints the versions, the CPU kernel library (what setup.py built, with which compiler and
instruction-set paths, or why it was not built), whether MindSpore can run it on this platform,
which instruction-set path a kernel call takes now (and which ones this CPU offers), the BLAS, and
for every operator the implementation the resolver picks on this device in each execution mode,
with the reasons the ones before it were passed over. (An implementation may also refuse a
particular call, e.g. an Ascend kernel beyond its size limits: the resolver then takes the next.)
"""
import ctypes
import os
import platform
import sys


def _isa():
    """(paths this CPU runs, path a call takes now or why none, paths built)."""
    from .ops._library import kernel_library  # pylint: disable=import-outside-toplevel

    lib = ctypes.CDLL(kernel_library())
    lib.MsMoeOpsIsaPaths.restype = ctypes.c_char_p
    here = lib.MsMoeOpsIsaPaths().decode().split()
    built = here
    if hasattr(lib, "MsMoeOpsIsaBuilt"):
        lib.MsMoeOpsIsaBuilt.restype = ctypes.c_char_p
        built = lib.MsMoeOpsIsaBuilt().decode().split()
    want = os.environ.get("MS_MOE_OPS_ISA", "")
    if not want:
        now = f"{here[-1]} (the best this CPU offers)"
    elif want in here:
        now = f"{want} (forced by MS_MOE_OPS_ISA)"
    else:
        now = f"none: MS_MOE_OPS_ISA={want} is not a path this CPU runs, every kernel call fails"
    return here, now, built


def _blas():
    try:
        import scipy_openblas32 as blas  # pylint: disable=import-outside-toplevel

        from .ops._library import _preload_blas  # pylint: disable=import-outside-toplevel
        _preload_blas()
        lib = next((ctypes.CDLL(os.path.join(blas.get_lib_dir(), f)) for f in
                    sorted(os.listdir(blas.get_lib_dir())) if "scipy_openblas" in f and
                    f.endswith((".so", ".dylib", ".dll"))), None)
        core = ""
        if lib is not None and hasattr(lib, "scipy_openblas_get_corename"):
            lib.scipy_openblas_get_corename.restype = ctypes.c_char_p
            core = f", kernels for {lib.scipy_openblas_get_corename().decode()}"
        return f"scipy-openblas32 {blas.__version__}{core}"
    except Exception as error:  # pylint: disable=broad-except
        return f"not loadable ({error})"


def _products():
    """What the matrix products of each dtype run on the path a call takes now (oneDNN's
    bfloat16 dot product, or float32 products), or why that is unknown."""
    from .ops._library import kernel_library  # pylint: disable=import-outside-toplevel

    lib = ctypes.CDLL(kernel_library())
    if not hasattr(lib, "MsMoeOpsProducts"):
        return "unknown (a library built before the report said it)"
    lib.MsMoeOpsProducts.restype = ctypes.c_char_p
    return lib.MsMoeOpsProducts().decode()


def resolution(op, target, soc, mode):
    """(implementation name, [passed over: 'name (why)']) the resolver's rule gives for a call
    every implementation accepts; (None, reasons) when none runs here."""
    passed = []
    for impl in op.impls:
        why = impl.unavailable(target, soc, mode)
        if not why:
            return impl.name, passed
        if impl.target in (None, target):  # another device's implementation is no fallback
            passed.append(f"{impl.name} ({why})")
    return None, passed


def report():
    """The report, as lines."""
    import mindspore  # pylint: disable=import-outside-toplevel

    from . import __version__  # pylint: disable=import-outside-toplevel
    from .ops import OPERATORS, _platform  # pylint: disable=import-outside-toplevel
    from .ops._library import (build_record, custom_ops_refused,  # pylint: disable=import-outside-toplevel
                               kernel_library_missing, library_path)

    lines = [f"ms_moe_ops {__version__}, MindSpore {mindspore.__version__}, Python "
             f"{platform.python_version()}, {platform.system()} {platform.machine()}"]
    record, path = build_record(), library_path()
    if path:
        built = (f" (built by {record['compiler']} for {record['target']}; paths "
                 f"{' '.join(record['paths'])}; OpenMP: {record['openmp']})" if record.get("built")
                 else "")
        lines.append(f"CPU kernel library: {path}{built}")
    elif record.get("built") is False:
        lines.append(f"CPU kernel library: not built: {record['reason']}")
    else:
        lines.append("CPU kernel library: not built (no record of the build)")
    refused = custom_ops_refused()
    why = kernel_library_missing()
    lines.append(f"MindSpore runs it here: {'yes' if not why else 'no: ' + (refused or why)}")
    if path and not refused:
        here, now, built_paths = _isa()
        lines.append(f"instruction-set paths: built {' '.join(built_paths)}; this CPU runs "
                     f"{' '.join(here)}; a kernel call takes {now}")
        lines.append(f"BLAS: {_blas()}")
        lines.append(f"matrix products: {_products()}")
    target = _platform.device_target()
    soc = _platform.soc_family(target)
    forced = _platform.forced_impl()
    lines.append(f"device target {target}{' ' + soc if soc else ''}"
                 f"{f'; {_platform.IMPL_ENV}={forced} forces that implementation where an operator has it' if forced else ''}")
    notes = []  # reasons, numbered once

    def cell(name, passed):
        marks = []
        for reason in passed:
            if reason not in notes:
                notes.append(reason)
            marks.append(f"[{notes.index(reason) + 1}]")
        return (name or "none") + (f" ({', '.join(marks)} passed over)" if marks else "")

    rows = []
    for op in OPERATORS:
        if forced and op.impl(forced) is not None:
            rows.append((op.name, f"{forced} (forced)", f"{forced} (forced)"))
            continue
        rows.append((op.name, *(cell(*resolution(op, target, soc, mode))
                                for mode in (_platform.GRAPH, _platform.PYNATIVE))))
    width = max(len(r[0]) for r in rows)
    middle = max(len(r[1]) for r in rows)
    lines.append(f"{'operator':{width}}  {'GRAPH mode':{middle}}  PyNative mode")
    lines += [f"{n:{width}}  {g:{middle}}  {p}" for n, g, p in rows]
    lines += [f"[{i + 1}] {reason}" for i, reason in enumerate(notes)]
    return lines


def main():
    print("\n".join(report()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
