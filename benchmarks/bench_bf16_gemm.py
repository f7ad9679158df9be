"""The bfloat16 GEMM candidates of the CPU kernels, side by side on this machine, one thread each,
at the MoE layer's product shapes: OpenBLAS's float32 sgemm (what the kernels ran before),
oneDNN's sgemm and bfloat16 GEMM (MindSpore's own libdnnl), MKL's cblas_gemm_bf16bf16f32 and its
packed form, and a hand-written AVX512-BF16 micro-kernel (bf16_gemm_candidates.cc, which this
script compiles with g++ against scipy-openblas32).

    python benchmarks/bench_bf16_gemm.py                    # MKL from sys.prefix/lib if installed
    python benchmarks/bench_bf16_gemm.py --mkl /path/to/libmkl_rt.so.3

MKL is not a dependency of the package: `pip install mkl` (or `pip download mkl` and unpack the
wheel) provides libmkl_rt.so.3 for this comparison.
"""
import argparse
import glob
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    ap.add_argument("--dnnl", default=None, help="libdnnl.so.3 (default: MindSpore's)")
    ap.add_argument("--mkl", default=None, help="libmkl_rt.so.3 (default: sys.prefix/lib's)")
    args = ap.parse_args()
    import scipy_openblas32 as blas  # pylint: disable=import-outside-toplevel

    dnnl = args.dnnl
    if dnnl is None:
        import mindspore  # pylint: disable=import-outside-toplevel
        dnnl = os.path.join(os.path.dirname(mindspore.__file__), "lib", "libdnnl.so.3")
    mkl = args.mkl or next(iter(sorted(glob.glob(os.path.join(sys.prefix, "lib", "libmkl_rt.so*")))),
                           None)
    with tempfile.TemporaryDirectory() as tmp:
        exe = os.path.join(tmp, "bf16_gemm_candidates")
        subprocess.run(["g++", "-std=c++17", "-O3", "-march=x86-64-v3",
                        os.path.join(HERE, "bf16_gemm_candidates.cc"), "-o", exe,
                        f"-I{blas.get_include_dir()}", f"-L{blas.get_lib_dir()}",
                        f"-l{blas.get_library()}", f"-Wl,-rpath,{blas.get_lib_dir()}", "-ldl"],
                       check=True)
        print(f"load average {os.getloadavg()[0]:.2f}; oneDNN: {dnnl}; MKL: {mkl or 'not found'}",
              flush=True)
        subprocess.run([exe, dnnl] + ([mkl] if mkl else []), check=True)
    print(f"load average {os.getloadavg()[0]:.2f} at the end")


if __name__ == "__main__":
    main()
