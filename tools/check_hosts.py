"""Builds the CPU kernels for the hosts MindSpore runs on, runs them on those this machine can
emulate, and compares every output with the native x86-64 build.

Host groups (--hosts, default all):
- x86: the native library under every instruction-set path this CPU has (the reference is the
  best), and under qemu-x86_64 as an Opteron (SSE2 only: it must choose generic and execute
  nothing newer) and a Haswell (AVX2: it must choose avx2).
- aarch64: cross-compiled through setup.py with g++-aarch64-linux-gnu against the aarch64
  scipy-openblas32 wheel, run under qemu-aarch64 as a Cortex-A72 (ARMv8.0: no dot product, it
  must choose generic, NEON) and a Neoverse N1 (ARMv8.2 with the dot product, like Kunpeng 920
  and Graviton 2: it must choose dotprod), and on the N1 with generic forced.
- windows: cross-compiled through setup.py with MinGW-w64 (x86_64-w64-mingw32-g++-posix) against
  the win_amd64 scipy-openblas32 wheel, a PE DLL whose exports are checked; the harness, built
  with the same compiler, runs under Wine (LoadLibrary/GetProcAddress), best and generic path.
- macos: cross-compiled and linked through setup.py with zig's clang (`python -m ziglang c++
  -target aarch64-macos`, then x86_64-macos; the ziglang package bundles libc++ and the macOS
  SDK's headers) against the macOS scipy-openblas32 wheels; checked without running (nothing
  here runs a Mach-O file): the exports, the install name @rpath/_kernels.dylib, the run path
  @loader_path/../scipy_openblas32/lib and the BLAS referenced through it, no undefined symbol.

Every library's exported symbols must be exactly the kernels, their InferShape functions and the
MsMoeOps* queries (plus the C++ runtime's operator new/delete where a toolchain links it in).
Outputs compare (custom_aot/harness/kernel_cases.cc writes them):
- bitwise: integer outputs, token permutation (row copies), pure float16/bfloat16 rounding, the
  int8 FFN with relu (integer products, then exactly specified float operations), dequantize (one
  product per element), messages;
- int8 FFN with exp-based activations: within one requantisation step per element;
- float outputs: float32 within 2^-20 of the output's largest magnitude (FMA contraction and the
  BLAS's summation order differ between paths); float16/bfloat16 within one unit in the last
  place of each element, or that bound.

Cross builds are at -O1 (-O0 for macOS, which is linked, not run; MS_MOE_OPS_OPT) with
MS_MOE_OPS_REQUIRE_KERNELS=1, cached in --work.
Prerequisites: the package built in place, g++, pip access to PyPI, and per group:
qemu-user (x86, aarch64), g++-aarch64-linux-gnu (aarch64), g++-mingw-w64-x86-64 and wine64
(windows), the ziglang package and llvm (llvm-nm, llvm-objdump) (macos).
Exit status: 0 all agree, 1 a disagreement or a failed run, 3 a missing prerequisite (named).

    python tools/check_hosts.py [--hosts x86,aarch64,windows,macos] [--work build/hosts]
"""
import argparse
import glob
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "custom_aot", "harness", "kernel_cases.cc")
HARNESS_FLAGS = ["-std=c++17", "-O1", "-ffp-contract=off", "-D_GLIBCXX_USE_CXX11_ABI=0", "-Wall",
                 "-I" + os.path.join(ROOT, "custom_aot")]
AARCH64_SYSROOT = "/usr/aarch64-linux-gnu"
WINE = shutil.which("wine64") or "/usr/lib/wine/wine64"
# (Debian keeps it beside wine64, off the PATH; None: no waiting for it)
WINESERVER = next((p for p in (shutil.which("wineserver"),
                               os.path.join(os.path.dirname(os.path.realpath(WINE)), "wineserver"),
                               "/usr/lib/wine/wineserver") if p and os.path.exists(p)), None)
MINGW = "x86_64-w64-mingw32-g++-posix"  # (the posix thread model has OpenMP)
# Emulated CPUs, the paths the library must offer on each, and the OpenBLAS core to force (its
# own detection takes qemu's Opteron for a Haswell and then executes AVX: a BLAS matter, the
# library's generic path executes nothing newer than SSE2, tools/check_baseline.py proves it).
OLD_X86 = {"Opteron_G1": ("generic", "Prescott"), "Haswell": ("generic avx2", None)}
AARCH64 = {"cortex-a72": "generic", "neoverse-n1": "generic dotprod"}
INT8_STEP = 128 * 1.5 / 2048  # largest |weight2| x largest deq_scale2 in kernel_cases.cc
GROUPS = ("x86", "aarch64", "windows", "macos")
# wheel platform tags of scipy-openblas32 per target, newest first
WHEELS = {"aarch64-linux": ["manylinux2014_aarch64", "manylinux_2_28_aarch64"],
          "x86_64-windows": ["win_amd64"],
          "aarch64-darwin": ["macosx_11_0_arm64", "macosx_14_0_arm64"],
          "x86_64-darwin": ["macosx_10_9_x86_64", "macosx_11_0_x86_64", "macosx_10_13_x86_64"]}


class Missing(Exception):
    """A prerequisite is not there (exit status 3)."""


class Disagree(Exception):
    """A check failed (exit status 1)."""


class CommandFailed(RuntimeError):
    """A command that exited with an error; `stderr` holds what it wrote there."""

    def __init__(self, message, stderr):
        super().__init__(message)
        self.stderr = stderr


def run(cmd, env=None, **kw):
    """Runs cmd; returns its stdout; raises CommandFailed with its stderr on failure."""
    full_env = dict(os.environ, **(env or {}))
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise CommandFailed(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}"
                            f"\nstdout:\n{done.stdout[-2000:]}", done.stderr)
    return done.stdout


def need(*tools, how):
    for tool in tools:
        if shutil.which(tool) is None and not os.path.exists(tool):
            raise Missing(f"{tool} not found ({how})")


# -- inputs -----------------------------------------------------------------------------------

def native_library():
    found = sorted(p for p in glob.glob(os.path.join(ROOT, "ms_moe_ops", "_kernels*"))
                   if p.endswith((".so", ".dylib", ".dll")))
    if not found:
        raise Missing("the kernel library is not built in place: run `python setup.py build_ext --inplace`")
    return found[0]


def native_blas_dir():
    import scipy_openblas32  # pylint: disable=import-outside-toplevel

    return scipy_openblas32.get_lib_dir()


def foreign_blas(work, target):
    """The scipy_openblas32 package directory of the wheel for `target` (arch-system): the
    installed version, else the newest that has such a wheel (same symbols)."""
    installed = importlib.metadata.version("scipy-openblas32")
    root = os.path.join(work, f"scipy_openblas32-{target}")
    package = os.path.join(root, "scipy_openblas32")
    if os.path.isdir(package):
        return package
    wheels = os.path.join(work, "wheels", target)
    platforms = [a for p in WHEELS[target] for a in ("--platform", p)]
    for spec in (f"scipy-openblas32=={installed}", "scipy-openblas32"):
        done = subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                               "--only-binary=:all:", *platforms, spec, "-d", wheels],
                              capture_output=True, text=True, timeout=600)
        found = glob.glob(os.path.join(wheels, "scipy_openblas32-*.whl"))
        if done.returncode == 0 and found:
            with zipfile.ZipFile(found[0]) as z:
                z.extractall(root)
            return package
    raise Missing(f"cannot download a scipy-openblas32 wheel for {target}: {done.stderr[-500:]}")


# -- builds -----------------------------------------------------------------------------------

def cross_library(work, name, cxx, blas, opt="-O1"):
    """custom_aot built through setup.py for another host (the same build as `pip install`
    there, at -O1, or -O0 for a build that is only linked); returns the library's path."""
    out = os.path.join(work, name)
    env = {"CXX": cxx, "MS_MOE_OPS_BLAS_DIR": blas, "MS_MOE_OPS_OPT": opt,
           "MS_MOE_OPS_REQUIRE_KERNELS": "1"}
    run([sys.executable, "setup.py", "-q", "build_ext", "--build-lib", out + "/lib",
         "--build-temp", out + "/temp"], env=env, cwd=ROOT)
    found = [p for p in glob.glob(os.path.join(out, "lib", "ms_moe_ops", "_kernels*"))
             if not p.endswith(".json")]
    return found[0]


def build_harness(cxx, out, *extra):
    run([*cxx, *HARNESS_FLAGS, HARNESS, "-o", out, *extra])
    return out


# -- exported symbols ---------------------------------------------------------------------------

def expected_exports():
    """The C names every library must export: the kernels (MOE_KERNEL), their InferShape
    functions and the queries (MOE_EXPORT)."""
    names = set()
    for path in glob.glob(os.path.join(ROOT, "custom_aot", "*.cc")) + \
            glob.glob(os.path.join(ROOT, "custom_aot", "dispatch", "*.cc")):
        text = open(path).read()
        names |= set(re.findall(r"^MOE_KERNEL\((\w+)\)", text, re.M))
        names |= set(re.findall(r"^MOE_EXPORT [^(]*?\b(\w+)\(", text, re.M))
    return names


def runtime_symbol(name):
    """A symbol of the C++ runtime a toolchain may export from a shared library (operator
    new/delete, which zig's static libc++ defines weakly; std:: template instances and their
    statics on ELF, whose std namespace has default visibility). Nothing of moe:: may appear."""
    return bool(re.match(r"^_Z(n[wa]|d[la])", name) or re.match(r"^_Z+N?K?S[tsabiod]", name)
                or name in ("__dso_handle", "_mh_dylib_header", "_init", "_fini"))


def exports(library):
    """The names a shared library exports (ELF, Mach-O: leading underscore removed; PE)."""
    with open(library, "rb") as f:
        magic = f.read(4)
    if magic[:2] == b"MZ":
        table = run(["llvm-objdump", "-p", library]).split("Export Table:", 1)[-1]
        return set(re.findall(r"^\s+\d+\s+0x[0-9a-f]+\s+(\w+)$", table, re.M))
    if magic == b"\x7fELF":
        listing = run(["llvm-nm", "-D", "--defined-only", library])
    else:
        listing = run(["llvm-nm", "-g", "--defined-only", library])
    names = {line.split()[-1] for line in listing.splitlines() if line.strip()}
    return {n[1:] for n in names} if magic != b"\x7fELF" else names


def check_exports(name, library):
    """[] or the problems of a library's export list."""
    got, want = exports(library), expected_exports()
    problems = []
    if want - got:
        problems.append(f"{name}: missing exports {sorted(want - got)}")
    extra = sorted(n for n in got - want if not runtime_symbol(n))
    if extra:
        problems.append(f"{name}: unexpected exports {extra[:10]}")
    return problems


def check_macho(name, library):
    """[] or the problems of a macOS dylib's load commands."""
    text = run(["llvm-objdump", "--macho", "--private-headers", library])
    problems = []
    if not re.search(r"cmd LC_ID_DYLIB\s.*?name @rpath/_kernels\.dylib", text, re.S):
        problems.append(f"{name}: install name is not @rpath/_kernels.dylib")
    if "path @loader_path/../scipy_openblas32/lib" not in text:
        problems.append(f"{name}: no run path @loader_path/../scipy_openblas32/lib")
    if "name @rpath/libscipy_openblas.dylib" not in text:
        problems.append(f"{name}: the BLAS is not referenced through the run path")
    header = run(["llvm-objdump", "--macho", "--private-header", library])
    if "NOUNDEFS" not in header:
        problems.append(f"{name}: undefined symbols left to the loader")
    return problems


# -- runs -------------------------------------------------------------------------------------

def run_cases(prefix, harness, library, out, env):
    """Runs the harness (under an emulator prefix, or none); returns (paths it reported, seconds)."""
    start = time.time()
    stdout = run([*prefix, harness, library, out], env=env)
    paths = next((line.split(":", 1)[1].strip() for line in stdout.splitlines()
                  if line.startswith("paths:")), "")
    return paths, time.time() - start


def load(path):
    """{record name: (dtype, raw bytes)} of a harness output file."""
    records = {}
    with open(path, "rb") as f:
        while True:
            header = f.readline()
            if not header:
                return records
            name, dtype, _dims, nbytes = header.decode().split()
            records[name] = (dtype, f.read(int(nbytes)))


def as_float(dtype, raw):
    if dtype == "float32":
        return np.frombuffer(raw, np.float32).astype(np.float64)
    if dtype == "float16":
        return np.frombuffer(raw, np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return None


def ulp16(dtype, values):
    """One unit in the last place of each value in a 16-bit float dtype."""
    mantissa_bits = 10 if dtype == "float16" else 7
    exponent = np.floor(np.log2(np.maximum(np.abs(values), 2.0 ** -24)))
    return 2.0 ** (exponent - mantissa_bits)


def disagreement(name, dtype, raw, ref_raw):
    """None when an output agrees with the reference under its class (see the module doc), else a
    description of the largest disagreement."""
    if raw == ref_raw:
        return None
    exact = (dtype not in ("float32", "float16", "bfloat16") or name.endswith("/permuted")
             or name.startswith(("rounding_", "moe_ffn_int8_relu", "dequantize")))
    if exact:
        return "not bitwise equal"
    a, b = as_float(dtype, raw), as_float(dtype, ref_raw)
    if np.array_equal(np.isnan(a), np.isnan(b)) and np.all((a == b) | np.isnan(a)):
        return None  # equal values (signs of zero aside)
    scale = float(np.nanmax(np.abs(b), initial=0.0))
    if name.startswith("moe_ffn_int8_"):
        bound = np.full_like(b, INT8_STEP)
    elif dtype == "float32":
        bound = np.full_like(b, 2.0 ** -20 * scale)
    else:
        bound = np.maximum(ulp16(dtype, b), 2.0 ** -20 * scale)
    err = np.abs(a - b)
    worst = int(np.nanargmax(err - bound))
    if err[worst] <= bound[worst]:
        return None
    return f"element {worst}: {a[worst]!r} vs {b[worst]!r} (bound {bound[worst]:.3g})"


def compare(run_name, out, ref):
    """(outputs bitwise equal, outputs, list of disagreements) of one run against the reference."""
    got, want = load(out), load(ref)
    if set(got) != set(want):
        return 0, len(want), [f"{run_name}: outputs differ in names: {sorted(set(got) ^ set(want))[:5]}"]
    bitwise, bad = 0, []
    for name, (dtype, raw) in want.items():
        bitwise += got[name][1] == raw
        why = disagreement(name, dtype, got[name][1], raw)
        if why:
            bad.append(f"{run_name}: {name} ({dtype}): {why}")
    return bitwise, len(want), bad


# -- host groups ----------------------------------------------------------------------------------
# Each returns [(run name, output file or None, paths reported, expected paths or None, seconds,
# problems)]; a build-only check has no output file.

def group_x86(work, ctx):
    runs = []
    for cpu, (expected, blas_core) in OLD_X86.items():
        out = os.path.join(work, f"x86_64_{cpu}.bin")
        qemu = ["qemu-x86_64", "-cpu", cpu, "-E", f"LD_LIBRARY_PATH={native_blas_dir()}"]
        if blas_core:
            qemu += ["-E", f"OPENBLAS_CORETYPE={blas_core}"]
        paths, secs = run_cases(qemu, ctx["harness"], ctx["library"], out, {})
        runs.append((f"x86-64 {cpu} (qemu)", out, paths, expected, secs, []))
    return runs


def group_aarch64(work, ctx):
    need("aarch64-linux-gnu-g++", "qemu-aarch64",
         how="apt-get install g++-aarch64-linux-gnu qemu-user")
    blas = foreign_blas(work, "aarch64-linux")
    start = time.time()
    library = cross_library(work, "aarch64", "aarch64-linux-gnu-g++", blas)
    harness = build_harness(["aarch64-linux-gnu-g++"], os.path.join(work, "kernel_cases_aarch64"), "-ldl")
    build = time.time() - start
    runs = []
    for cpu, expected in AARCH64.items():
        for forced in ([None, "generic"] if "dotprod" in expected else [None]):
            out = os.path.join(work, f"aarch64_{cpu}_{forced or 'best'}.bin")
            qemu = ["qemu-aarch64", "-cpu", cpu, "-L", AARCH64_SYSROOT,
                    "-E", f"LD_LIBRARY_PATH={os.path.join(blas, 'lib')}"]
            if forced:
                qemu += ["-E", f"MS_MOE_OPS_ISA={forced}"]
            paths, secs = run_cases(qemu, harness, library, out, {})
            name = f"aarch64 {cpu} (qemu){' ' + forced + ' forced' if forced else ''}"
            runs.append((name, out, paths, expected, secs, check_exports(name, library)))
    print(f"aarch64 cross build: {build:.0f} s")
    return runs


def wait_for_wineserver(env):
    """Until the prefix's wineserver has exited (it lingers a few seconds after its last run)."""
    if WINESERVER:
        run([WINESERVER, "-w"], env=env, timeout=120)


def group_windows(work, ctx):
    need(MINGW, WINE, how="apt-get install g++-mingw-w64-x86-64 wine64")
    blas = foreign_blas(work, "x86_64-windows")
    start = time.time()
    library = cross_library(work, "windows", MINGW, blas)
    harness = build_harness([MINGW], os.path.join(work, "kernel_cases.exe"), "-static")
    build = time.time() - start
    prefix = os.path.join(work, "wineprefix")
    env = {"WINEPREFIX": prefix, "WINEDEBUG": "-all", "WINEDLLOVERRIDES": "mscoree,mshtml=",
           "WINEPATH": "Z:" + os.path.join(blas, "lib").replace("/", "\\")}
    runs = []
    for forced in (None, "generic"):
        out = os.path.join(work, f"windows_{forced or 'best'}.bin")
        run_env = dict(env, **({"MS_MOE_OPS_ISA": forced} if forced else {}))
        try:
            paths, secs = run_cases([WINE], harness, library, out, run_env)
        except CommandFailed as e:
            # The harness names each failure of its own on stderr; a run that failed without a
            # word is Wine's (seen once, under load, the run before's wineserver maybe still
            # going): once more, after that server has gone
            if e.stderr.strip():
                raise
            print(f"windows: Wine failed without a message, once more: {e}", file=sys.stderr)
            wait_for_wineserver(env)
            paths, secs = run_cases([WINE], harness, library, out, run_env)
        wait_for_wineserver(env)  # (each run starts with a server of its own)
        name = f"windows x86-64 (wine){' generic forced' if forced else ''}"
        runs.append((name, out, paths, ctx["paths"], secs, check_exports(name, library)))
    print(f"windows cross build: {build:.0f} s")
    return runs


def group_macos(work, ctx):
    need("llvm-nm", "llvm-objdump", how="apt-get install llvm")
    try:
        run([sys.executable, "-m", "ziglang", "version"])
    except RuntimeError:
        raise Missing("the ziglang package is not installed (pip install ziglang)") from None
    runs = []
    for arch in ("aarch64", "x86_64"):
        blas = foreign_blas(work, f"{arch}-darwin")
        start = time.time()
        library = cross_library(work, f"macos_{arch}", f"{sys.executable} -m ziglang c++ -target "
                                f"{arch}-macos", blas, opt="-O0")
        name = f"macos {arch} (zig, link only)"
        problems = check_exports(name, library) + check_macho(name, library)
        runs.append((name, None, "", None, time.time() - start, problems))
    return runs


GROUP_FNS = {"x86": group_x86, "aarch64": group_aarch64, "windows": group_windows, "macos": group_macos}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hosts", default=",".join(GROUPS),
                        help=f"comma-separated host groups out of {', '.join(GROUPS)}")
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "hosts"),
                        help="directory for builds, the downloaded wheels and outputs")
    args = parser.parse_args(argv)
    groups = [g.strip() for g in args.hosts.split(",") if g.strip()]
    if set(groups) - set(GROUPS):
        parser.error(f"unknown host groups {sorted(set(groups) - set(GROUPS))}")
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    try:
        need("g++", "llvm-nm", "llvm-objdump", how="apt-get install g++ llvm")
        if "x86" in groups:
            need("qemu-x86_64", how="apt-get install qemu-user")
        library = native_library()
        harness = build_harness(["g++"], os.path.join(work, "kernel_cases_x86_64"), "-ldl")
        native_env = {"LD_LIBRARY_PATH": native_blas_dir()}
        here, _ = run_cases([], harness, library, os.path.join(work, "probe.bin"), native_env)
        runs = []
        for isa in here.split():
            out = os.path.join(work, f"x86_64_{isa}.bin")
            paths, secs = run_cases([], harness, library, out, dict(native_env, MS_MOE_OPS_ISA=isa))
            runs.append((f"x86-64 {isa}", out, paths, None, secs,
                         check_exports("x86-64 native", library) if isa == "generic" else []))
        reference = runs[-1]  # the best path this CPU has
        ctx = {"library": library, "harness": harness, "paths": here}
        for group in groups:
            runs += GROUP_FNS[group](work, ctx)
    except Missing as e:
        print(f"check_hosts: missing prerequisite: {e}", file=sys.stderr)
        return 3

    print(f"reference: {reference[0]}")
    print(f"{'run':44s} {'paths':30s} {'bitwise equal':>14s} {'seconds':>8s}")
    failures = []
    for name, out, paths, expected, secs, problems in runs:
        failures += problems
        if out is None:
            print(f"{name:44s} {'(built, not run)':30s} {'':>14s} {secs:8.1f}")
            continue
        bitwise, total, bad = compare(name, out, reference[1])
        print(f"{name:44s} {paths:30s} {bitwise:>7d} of {total:<4d} {secs:8.1f}")
        failures += bad
        if expected is not None and paths != expected:
            failures.append(f"{name}: the library offers paths '{paths}', expected '{expected}'")
    for line in failures:
        print("DISAGREE", line)
    print("all outputs agree" if not failures else f"{len(failures)} disagreement(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
