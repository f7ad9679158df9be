"""Builds custom_aot/*.cc into ms_moe_ops/_kernels*.so, the CPU kernels of every operator.

The library follows MindSpore's AOT ABI; it is not a Python extension module, but building it as
a setuptools Extension makes `pip install .` and `pip install -e .` compile it with no extra step.
"""
import glob
import os
import shutil
import sysconfig

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _blas():
    """Include dir, lib dir and library name of the BLAS the kernels link against."""
    import scipy_openblas32 as blas

    return blas.get_include_dir(), blas.get_lib_dir(), blas.get_library()


class BuildKernels(build_ext):
    def build_extensions(self):
        cxx = self.compiler.compiler_cxx[0] if getattr(self.compiler, "compiler_cxx", None) else "c++"
        if shutil.which(cxx) is None:
            raise RuntimeError(
                f"ms_moe_ops: no C++ compiler found ('{cxx}'); install g++ (for example "
                "`apt-get install g++`) and retry: the CPU kernels are compiled at install time.")
        # C++ sources go through the C++ driver, and the Python-module link flags are not needed.
        self.compiler.compiler_so = [cxx] + self.compiler.compiler_so[1:]
        self.compiler.linker_so = [cxx] + self.compiler.linker_so[1:]
        super().build_extensions()

    def copy_file(self, src, dst, *args, **kwargs):
        # Replace the library atomically: a running process keeps its mapping of the old file.
        if os.path.isdir(dst):
            dst = os.path.join(dst, os.path.basename(src))
        tmp = f"{dst}.tmp{os.getpid()}"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        return dst, True


inc, libdir, lib = _blas()
march = os.environ.get("MS_MOE_OPS_MARCH", "native")
kernels = Extension(
    "ms_moe_ops._kernels",
    sources=sorted(glob.glob("custom_aot/*.cc")),
    depends=sorted(glob.glob("custom_aot/*.h")),
    include_dirs=["custom_aot", inc],
    library_dirs=[libdir],
    libraries=[lib],
    # MindSpore's wheel uses the pre-C++11 std::string ABI: the AotExtra attribute getters crash
    # without -D_GLIBCXX_USE_CXX11_ABI=0.
    extra_compile_args=["-std=c++17", "-O3", "-fopenmp", f"-march={march}", "-D_GLIBCXX_USE_CXX11_ABI=0",
                        "-fvisibility=hidden", "-Wall", "-Wno-unused-function"],
    extra_link_args=["-fopenmp"],
    language="c++",
)

setup(ext_modules=[kernels], cmdclass={"build_ext": BuildKernels})
