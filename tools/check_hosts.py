"""Runs the CPU kernels on the hosts this machine can emulate and compares every output with the
native x86-64 build.

1. Builds custom_aot/harness/kernel_cases.cc (every kernel called through MindSpore's AOT ABI on
   seeded inputs) and runs it against the package's kernel library under every instruction-set
   path this CPU has (MS_MOE_OPS_ISA=generic|avx2|avx512).
2. aarch64: cross-compiles custom_aot through setup.py with g++-aarch64-linux-gnu against the
   aarch64 scipy-openblas32 wheel of the installed version, cross-compiles the harness and runs it
   under qemu-aarch64 (-cpu neoverse-n1, an ARMv8.2 server core like Kunpeng 920's).
3. Older x86-64 CPUs: runs the native library under qemu-x86_64 as an Opteron (SSE2 only: the
   library must choose its generic path and never execute a newer instruction) and as a Haswell
   (AVX2: it must choose avx2).
4. Compares every output of every run with the native best path's:
   - bitwise: integer outputs, token permutation (row copies), pure float16/bfloat16 rounding,
     and the int8 FFN with relu (integer products, then exactly specified float operations);
   - int8 FFN with exp-based activations: within one requantisation step per element (the
     activation's last bit may differ between paths and move a value across a rounding edge);
   - float outputs: float32 within 2^-20 of the output's largest magnitude (FMA contraction and
     the BLAS's summation order differ between paths); float16/bfloat16 within one unit in the
     last place of each element, or that bound.

Prerequisites: the package built in place (`python setup.py build_ext --inplace`), g++,
g++-aarch64-linux-gnu, qemu-user (qemu-aarch64, qemu-x86_64) and pip access to PyPI. Exit status:
0 all outputs agree, 1 a disagreement or a failed run, 3 a missing prerequisite (named on stderr).

    python tools/check_hosts.py [--work build/hosts]
"""
import argparse
import glob
import importlib.metadata
import os
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
# Emulated x86-64 CPUs and the path the library must choose on each.
OLD_X86 = {"Opteron_G1": "generic", "Haswell": "generic avx2"}
INT8_STEP = 128 * 1.5 / 2048  # largest |weight2| x largest deq_scale2 in kernel_cases.cc


class Missing(Exception):
    """A prerequisite is not there (exit status 3)."""


def run(cmd, env=None, **kw):
    """Runs cmd; returns its stdout; raises with its stderr on failure."""
    full_env = dict(os.environ, **(env or {}))
    done = subprocess.run(cmd, env=full_env, capture_output=True, text=True, **kw)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return done.stdout


def need(*tools):
    for tool in tools:
        if shutil.which(tool) is None:
            raise Missing(f"{tool} not found (Debian: apt-get install g++-aarch64-linux-gnu qemu-user)")


# -- inputs -----------------------------------------------------------------------------------

def native_library():
    found = sorted(glob.glob(os.path.join(ROOT, "ms_moe_ops", "_kernels*.so")))
    if not found:
        raise Missing("ms_moe_ops/_kernels*.so not built: run `python setup.py build_ext --inplace`")
    return found[0]


def native_blas_dir():
    import scipy_openblas32

    return scipy_openblas32.get_lib_dir()


def aarch64_blas(work):
    """The scipy_openblas32 package directory of the aarch64 wheel (same version as installed)."""
    version = importlib.metadata.version("scipy-openblas32")
    root = os.path.join(work, f"scipy_openblas32-{version}-aarch64")
    package = os.path.join(root, "scipy_openblas32")
    if not os.path.isdir(package):
        wheels = os.path.join(work, "wheels")
        cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--platform", "manylinux2014_aarch64", "--platform", "manylinux_2_28_aarch64",
               f"scipy-openblas32=={version}", "-d", wheels]
        try:
            run(cmd, timeout=300)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            raise Missing(f"cannot download the aarch64 scipy-openblas32 {version} wheel: {e}")
        wheel = glob.glob(os.path.join(wheels, f"scipy_openblas32-{version}-*aarch64*.whl"))[0]
        with zipfile.ZipFile(wheel) as z:
            z.extractall(root)
    return package


# -- builds -----------------------------------------------------------------------------------

def build_aarch64_library(work, blas):
    """custom_aot cross-compiled through setup.py (the same build as `pip install` on aarch64)."""
    out = os.path.join(work, "aarch64")
    env = {"CC": "aarch64-linux-gnu-gcc", "CXX": "aarch64-linux-gnu-g++", "MS_MOE_OPS_BLAS_DIR": blas}
    run([sys.executable, "setup.py", "-q", "build_ext", "--force", "--build-lib", out + "/lib",
         "--build-temp", out + "/temp"], env=env, cwd=ROOT)
    return glob.glob(os.path.join(out, "lib", "ms_moe_ops", "_kernels*.so"))[0]


def build_harness(cxx, out):
    run([cxx, *HARNESS_FLAGS, HARNESS, "-o", out, "-ldl"])
    return out


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
             or name.startswith(("rounding_", "moe_ffn_int8_relu")))
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


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--work", default=os.path.join(ROOT, "build", "hosts"),
                        help="directory for builds, the downloaded wheel and outputs")
    parser.add_argument("--no-old-x86", action="store_true", help="skip the emulated x86-64 CPUs")
    args = parser.parse_args(argv)
    try:
        need("g++", "aarch64-linux-gnu-g++", "qemu-aarch64", *([] if args.no_old_x86 else ["qemu-x86_64"]))
        library = native_library()
        os.makedirs(args.work, exist_ok=True)
        blas_a64 = aarch64_blas(args.work)
    except Missing as e:
        print(f"check_hosts: missing prerequisite: {e}", file=sys.stderr)
        return 3

    work = args.work
    native_env = {"LD_LIBRARY_PATH": native_blas_dir()}
    cases_x86 = build_harness("g++", os.path.join(work, "kernel_cases_x86_64"))
    runs = []  # (name, output file, paths reported, expected paths or None, seconds)
    paths_here, _ = run_cases([], cases_x86, library, os.path.join(work, "probe.bin"), native_env)
    for isa in paths_here.split():
        out = os.path.join(work, f"x86_64_{isa}.bin")
        paths, secs = run_cases([], cases_x86, library, out, dict(native_env, MS_MOE_OPS_ISA=isa))
        runs.append((f"x86-64 {isa}", out, paths, None, secs))
    reference = runs[-1]  # the best path this CPU has

    start = time.time()
    library_a64 = build_aarch64_library(work, blas_a64)
    cases_a64 = build_harness("aarch64-linux-gnu-g++", os.path.join(work, "kernel_cases_aarch64"))
    build_secs = time.time() - start
    out = os.path.join(work, "aarch64.bin")
    qemu = ["qemu-aarch64", "-cpu", "neoverse-n1", "-L", AARCH64_SYSROOT,
            "-E", f"LD_LIBRARY_PATH={os.path.join(blas_a64, 'lib')}"]
    paths, secs = run_cases(qemu, cases_a64, library_a64, out, {})
    runs.append(("aarch64 (qemu neoverse-n1)", out, paths, "generic", secs))

    if not args.no_old_x86:
        for cpu, expected in OLD_X86.items():
            out = os.path.join(work, f"x86_64_{cpu}.bin")
            qemu = ["qemu-x86_64", "-cpu", cpu, "-E", f"LD_LIBRARY_PATH={native_blas_dir()}"]
            paths, secs = run_cases(qemu, cases_x86, library, out, {})
            runs.append((f"x86-64 {cpu} (qemu)", out, paths, expected, secs))

    print(f"reference: {reference[0]}; aarch64 cross-build {build_secs:.0f} s")
    print(f"{'run':30s} {'paths':22s} {'bitwise equal':>14s} {'seconds':>8s}")
    failures = []
    for name, out, paths, expected, secs in runs:
        bitwise, total, bad = compare(name, out, reference[1])
        print(f"{name:30s} {paths:22s} {bitwise:>7d} of {total:<4d} {secs:8.1f}")
        failures += bad
        if expected is not None and paths != expected:
            failures.append(f"{name}: the library offers paths '{paths}', expected '{expected}'")
    for line in failures:
        print("DISAGREE", line)
    print("all outputs agree" if not failures else f"{len(failures)} disagreement(s)")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
