"""Every kernel on every instruction-set path this CPU runs, side by side in one run.

Builds custom_aot/harness/time_kernels.cc and times the package's kernel library on each path
(MS_MOE_OPS_ISA per call), the paths in turns within one process so that a change in the
machine's load hits all alike: SwiGLU forward/backward (float32, bfloat16; T=8192, H=2048), the
router forward/backward (M=16384, N=256, K=8), MoeFFN float32 and int8 forward (M=4096, H=1024,
F=2048, E=8, and M=1024, H=512, F=1024, E=8: benchmarks/bench_ffn_int8.py's shape; int8 weights
in [-127, 127] as quantize_moe_ffn makes them, and at M=1024 also over all of int8, whose -128
the avx2 path multiplies more slowly), the activation backward, token permute and weighted unpermute (T=8192, H=2048, K=8, E=64). Prints
each case's median per path and its ratio to the best path, then the int8 FFN's speed over the
float32 FFN on each path; writes the medians to a CSV; `--table` prints the README's table from
such a CSV without timing anything.

    python benchmarks/bench_isa.py [--rounds 5] [--threads N] [--csv benchmarks/isa_paths.csv]
    python benchmarks/bench_isa.py --table benchmarks/isa_paths.csv

The float32 products go through OpenBLAS, which picks its own kernels for the CPU whatever the
path (OPENBLAS_CORETYPE forces one); they differ between paths only in the code around them.
"""
import argparse
import csv
import ctypes
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
SOURCE = os.path.join(ROOT, "custom_aot", "harness", "time_kernels.cc")
# what bounds each case: memory (one pass over the tensors) or arithmetic
BOUND = {"swiglu": "memory", "router": "compute", "moe_ffn": "compute", "activation": "memory",
         "permute": "memory", "unpermute": "memory"}


def library_and_paths():
    from ms_moe_ops.ops._library import kernel_library  # pylint: disable=import-outside-toplevel

    path = kernel_library()
    lib = ctypes.CDLL(path)
    lib.MsMoeOpsIsaPaths.restype = ctypes.c_char_p
    return path, lib.MsMoeOpsIsaPaths().decode().split()


def build(out_dir):
    exe = os.path.join(out_dir, "time_kernels")
    headers = [os.path.join(ROOT, "custom_aot", "harness", "aot_call.h"), SOURCE]
    if not os.path.exists(exe) or any(os.path.getmtime(h) > os.path.getmtime(exe) for h in headers):
        subprocess.run(["g++", "-std=c++17", "-O2", "-D_GLIBCXX_USE_CXX11_ABI=0",
                        "-I" + os.path.join(ROOT, "custom_aot"), SOURCE, "-o", exe, "-ldl"],
                       check=True)
    return exe


def read(path):
    """{case: {path: ms}} in the CSV's order."""
    rows = {}
    with open(path) as f:
        for row in csv.DictReader(f):
            rows.setdefault(row["case"], {})[row["contender"]] = float(row["median_ms"])
    return rows


def table(rows):
    """The README's table (markdown) of a run: ms per path, each path's time over the best's."""
    paths = list(next(iter(rows.values())))
    best = paths[-1]
    lines = ["| kernel (time per call) | " + " | ".join(paths) + " |",
             "|---|" + "---|" * len(paths)]
    for case, times in rows.items():
        cells = [f"{times[p]:.1f} ms" + ("" if p == best else f" ({times[p] / times[best]:.2f}x)")
                 for p in paths]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    for size in sorted({c.split("M=")[1] for c in rows if c.startswith("moe_ffn int8")}, key=int):
        f32, i8 = rows[f"moe_ffn float32 M={size}"], rows[f"moe_ffn int8 M={size}"]
        lines.append(f"| int8 FFN speed over float32, M={size} | " +
                     " | ".join(f"{f32[p] / i8[p]:.2f}x" for p in paths) + " |")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, help="OMP_NUM_THREADS (default: as set)")
    parser.add_argument("--only", default="", help="cases whose name holds this")
    parser.add_argument("--csv", default=os.path.join(ROOT, "benchmarks", "isa_paths.csv"))
    parser.add_argument("--table", metavar="CSV", help="print the table of an earlier run")
    args = parser.parse_args()
    if args.table:
        print(table(read(args.table)))
        return 0
    library, paths = library_and_paths()
    out_dir = os.path.join(ROOT, "build", "bench")
    os.makedirs(out_dir, exist_ok=True)
    exe = build(out_dir)
    import scipy_openblas32  # pylint: disable=import-outside-toplevel

    env = dict(os.environ, LD_LIBRARY_PATH=scipy_openblas32.get_lib_dir())
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [exe, "--rounds", str(args.rounds), "--only", args.only, "--csv", args.csv]
    cmd += [f"{p}={library}:{p}" for p in reversed(paths)]  # (the best first: ratios to it)
    print(f"paths {' '.join(paths)}; {env.get('OMP_NUM_THREADS', 'all')} threads; "
          f"median of {args.rounds} rounds, the paths in turns")
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(done.stdout, done.stderr, file=sys.stderr)
        return 1
    rows = {case: {p: times[p] for p in paths} for case, times in read(args.csv).items()}
    with open(args.csv, "w", newline="") as f:  # paths lowest first, as the table shows them
        w = csv.writer(f)
        w.writerow(["case", "contender", "median_ms"])
        for case, times in rows.items():
            for p, ms in times.items():
                w.writerow([case, p, f"{ms:.4f}"])
    print(table(rows))
    memory = [(c, p, t[p] / t[paths[-1]]) for c, t in rows.items() for p in paths[1:-1]
              if BOUND.get(c.split()[0]) == "memory"]
    if memory:
        worst = max(memory, key=lambda x: x[2])
        print(f"memory-bound kernels: the slowest path below {paths[-1]} takes {worst[2]:.2f}x "
              f"its time ({worst[0]}, {worst[1]})")
    print(f"written: {args.csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
