"""Builds custom_aot/ into ms_moe_ops/_kernels*.so, the CPU kernels of every operator.

The library follows MindSpore's AOT ABI; it is not a Python extension module, but building it as
a setuptools Extension makes `pip install .` and `pip install -e .` compile it with no extra step.

Every kernel source (custom_aot/*.cc) is compiled once per instruction-set path, each with its own
-march, and the exported entry points pick a path at run time (custom_aot/isa.h): on x86-64 the
generic path runs on any x86-64 CPU, avx2 needs x86-64-v3, avx512 needs x86-64-v4 with VNNI; other
targets (aarch64) build the generic path only. The target is the compiler's (`$CXX -dumpmachine`),
so a cross compiler (CXX=aarch64-linux-gnu-g++) builds for its target.

Build overrides (environment): MS_MOE_OPS_MARCH sets the -march of the generic path (for example
`native`); MS_MOE_OPS_BLAS_DIR is the scipy_openblas32 package directory to build against (for a
cross build; default: the installed package); MS_MOE_OPS_SANITIZE=address,undefined builds with
those sanitizers, for tools/fuzz_kernels.py (into a build directory of its own: such a library
only loads into a process that has the sanitizer runtime).
"""
import glob
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext


def _blas():
    """Include dir, lib dir and library name of the BLAS the kernels link against."""
    root = os.environ.get("MS_MOE_OPS_BLAS_DIR")
    if root:
        return os.path.join(root, "include"), os.path.join(root, "lib"), "scipy_openblas"
    import scipy_openblas32 as blas

    return blas.get_include_dir(), blas.get_lib_dir(), blas.get_library()


def _blas_rpath(build_libdir):
    """Where the kernel library looks for the BLAS at run time, first match wins."""
    site = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
    dirs = ["$ORIGIN/../scipy_openblas32/lib"]
    dirs += [os.path.join(d, "scipy_openblas32", "lib") for d in sorted(site)]
    dirs.append(build_libdir)
    return list(dict.fromkeys(dirs))


def isa_paths(machine):
    """(name, compile flags) of every instruction-set path built for the target `machine`. The
    first is the baseline: it defines the exported entry points and runs on any CPU of the
    target; its objects come first in the link, so wherever compiles share an inline function
    of the C++ library, the linker keeps the baseline's copy."""
    march = os.environ.get("MS_MOE_OPS_MARCH")
    if machine in ("x86_64", "amd64"):
        return [("generic", [f"-march={march or 'x86-64'}", "-mtune=generic", "-DMOE_X86_PATHS"]),
                ("avx2", ["-DMOE_ISA=avx2", "-march=x86-64-v3"]),
                ("avx512", ["-DMOE_ISA=avx512", "-march=x86-64-v4", "-mavx512vnni"])]
    return [("generic", [f"-march={march}"] if march else [])]


def target_machine(cxx):
    """The compiler's target architecture (x86_64, aarch64, ...)."""
    triple = subprocess.run([cxx, "-dumpmachine"], capture_output=True, text=True, check=True)
    return triple.stdout.strip().split("-")[0]


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
        self.machine = target_machine(cxx)
        super().build_extensions()

    def build_extension(self, ext):
        out = self.get_ext_fullpath(ext.name)
        inputs = ext.sources + ext.depends + DISPATCH + [__file__]  # the flags live here
        if not self.force and os.path.exists(out) and all(
                os.path.getmtime(f) <= os.path.getmtime(out) for f in inputs):
            return
        jobs = []  # (sources, object dir, flags), baseline first
        for i, (name, flags) in enumerate(isa_paths(self.machine)):
            sources = ext.sources + (DISPATCH if i == 0 else [])
            jobs += [([src], os.path.join(self.build_temp, name), flags) for src in sources]

        def compile_one(job):
            sources, out_dir, flags = job
            return self.compiler.compile(sources, output_dir=out_dir, include_dirs=ext.include_dirs,
                                         extra_postargs=ext.extra_compile_args + flags,
                                         depends=ext.depends)

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            objects = [o for objs in pool.map(compile_one, jobs) for o in objs]
        self.compiler.link_shared_object(
            objects, out, libraries=ext.libraries, library_dirs=ext.library_dirs,
            extra_postargs=ext.extra_link_args, build_temp=self.build_temp, target_lang="c++")

    def copy_file(self, src, dst, *args, **kwargs):
        # Replace the library atomically: a running process keeps its mapping of the old file.
        if os.path.isdir(dst):
            dst = os.path.join(dst, os.path.basename(src))
        tmp = f"{dst}.tmp{os.getpid()}"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        return dst, True


inc, libdir, lib = _blas()
# custom_aot/dispatch/*.cc (the choice of path) is compiled once, with the baseline flags.
DISPATCH = sorted(glob.glob("custom_aot/dispatch/*.cc"))
# a checking build (tools/fuzz_kernels.py): every bad access or undefined operation aborts
SANITIZE = os.environ.get("MS_MOE_OPS_SANITIZE", "")
# (at -O1, as the sanitizers recommend: a third of the -O3 build time; the instruction-set paths
# and their intrinsics are the same code)
SANITIZE_FLAGS = [f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                  "-g", "-O1"] if SANITIZE else []
kernels = Extension(
    "ms_moe_ops._kernels",
    sources=sorted(glob.glob("custom_aot/*.cc")),
    depends=sorted(glob.glob("custom_aot/*.h")),
    include_dirs=["custom_aot", inc],
    library_dirs=[libdir],
    libraries=[lib],
    # MindSpore's wheel uses the pre-C++11 std::string ABI: the AotExtra attribute getters crash
    # without -D_GLIBCXX_USE_CXX11_ABI=0.
    extra_compile_args=["-std=c++17", "-O3", "-fopenmp", "-D_GLIBCXX_USE_CXX11_ABI=0",
                        "-fvisibility=hidden", "-Wall", "-Wno-unused-function"] + SANITIZE_FLAGS,
    # Find the BLAS without help (e.g. when MindSpore loads a MINDIR with these kernels): next to
    # an installed package ($ORIGIN/../scipy_openblas32/lib), in the site-packages of the
    # environment being installed into (editable installs: pip builds in an isolated environment
    # that is deleted afterwards, but with the target's interpreter), or where it was at build time.
    extra_link_args=["-fopenmp"] + [f"-Wl,-rpath,{d}" for d in _blas_rpath(libdir)]
    + SANITIZE_FLAGS[:1],
    language="c++",
)

setup(ext_modules=[kernels], cmdclass={"build_ext": BuildKernels})
