"""Builds custom_aot/ into ms_moe_ops/_kernels*, the CPU kernels of every operator.

The library follows MindSpore's AOT ABI; it is not a Python extension module, but building it as
a setuptools Extension makes `pip install .` and `pip install -e .` compile it with no extra step.

Every kernel source (custom_aot/*.cc) is compiled once per instruction-set path, each with its own
-march, and the exported entry points pick a path at run time (custom_aot/isa.h). The target is
the compiler's (`$CXX -dumpmachine`), so a cross compiler builds for its target:
- x86-64: generic (any x86-64 CPU), avx2 (x86-64-v3), avxvnni (x86-64-v3 with AVX-VNNI), avx512
  (x86-64-v4 with AVX-512 VNNI); aarch64: generic (ARMv8-A, NEON), dotprod (ARMv8.2-A with the
  dot product); other targets: generic.
- Linux (GCC or Clang): lib `_kernels<EXT_SUFFIX>`, run path $ORIGIN-relative; macOS (Apple
  Clang, Clang; OpenMP from libomp when it is installed, else serial loops): `_kernels.dylib`,
  run path @loader_path-relative; Windows (MinGW-w64 GCC): `_kernels.dll`, exports marked
  dllexport, C++ runtime and OpenMP linked statically. docs/hosts.md says what MindSpore loads
  where (in 2.10: Linux only).

No compiler, a compiler that cannot build the kernels (MSVC, a GCC older than 11), or a failed
build: the install goes on without the library, says why, and records it in
ms_moe_ops/_kernels_build.json (next to where the library would be), which the package reads to
say why every operator runs as a composition of MindSpore ops. MS_MOE_OPS_REQUIRE_KERNELS=1 makes
any of these an error instead (CI builds with it). A successful build records what was built.

Build overrides (environment): CXX (the compiler command, e.g. `python -m ziglang c++ -target
aarch64-macos` for a cross build); MS_MOE_OPS_MARCH sets the -march of the generic path (for
example `native`); MS_MOE_OPS_BLAS_DIR is the scipy_openblas32 package directory to build
against (for a cross build; default: the installed package); MS_MOE_OPS_SANITIZE=address,undefined
builds with those sanitizers, for tools/fuzz_kernels.py (into a build directory of its own: such
a library only loads into a process that has the sanitizer runtime); MS_MOE_OPS_OPT replaces -O3
(tools/check_hosts.py builds the cross checks at -O1, in a third of the time).
"""
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

RECORD = "_kernels_build.json"
SOURCES = sorted(glob.glob("custom_aot/*.cc"))
HEADERS = sorted(glob.glob("custom_aot/*.h"))
# custom_aot/dispatch/*.cc (the choice of path) is compiled once, with the baseline flags.
DISPATCH = sorted(glob.glob("custom_aot/dispatch/*.cc"))
# a checking build (tools/fuzz_kernels.py): every bad access or undefined operation aborts
SANITIZE = os.environ.get("MS_MOE_OPS_SANITIZE", "")
# (at -O1, as the sanitizers recommend: a third of the -O3 build time; the instruction-set paths
# and their intrinsics are the same code)
SANITIZE_FLAGS = [f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all", "-fno-omit-frame-pointer",
                  "-g", "-O1"] if SANITIZE else []
# MindSpore's wheel uses the pre-C++11 std::string ABI: the AotExtra attribute getters crash
# without -D_GLIBCXX_USE_CXX11_ABI=0 (libc++ ignores it).
FLAGS = ["-std=c++17", os.environ.get("MS_MOE_OPS_OPT", "-O3"), "-D_GLIBCXX_USE_CXX11_ABI=0", "-Wall", "-Wno-unused-function",
         "-Icustom_aot"]


class NotBuilt(Exception):
    """Why the kernel library cannot be built here (the install goes on without it)."""


# -- the toolchain --------------------------------------------------------------------------------

class Toolchain:
    """The C++ compiler command and what it builds for: arch (x86_64, aarch64, ...), system
    (linux, darwin, windows), kind (gcc, clang, zig) and its version line."""

    def __init__(self, command):
        self.command = command
        if shutil.which(command[0]) is None:
            raise NotBuilt(f"no C++ compiler found ('{shlex.join(command)}'); install one (Linux: "
                           "g++ or clang++; macOS: the Xcode command line tools; Windows: MinGW-w64) "
                           "and reinstall for the fast CPU kernels")
        triple = self.ask("-dumpmachine").lower()
        arch = triple.split("-")[0]
        self.triple = triple
        self.arch = {"amd64": "x86_64", "arm64": "aarch64"}.get(arch, arch)
        self.system = ("darwin" if any(w in triple for w in ("darwin", "macos", "apple")) else
                       "windows" if any(w in triple for w in ("mingw", "windows", "cygwin")) else
                       "linux")
        self.version = self.ask("--version").splitlines()[0]
        self.kind = ("zig" if any("zig" in part for part in command) else
                     "clang" if "clang" in self.version.lower() else "gcc")

    def ask(self, *args):
        try:  # (in a scratch directory: zig's driver leaves an empty a.o behind)
            with tempfile.TemporaryDirectory() as tmp:
                done = subprocess.run(self.command + list(args), capture_output=True, text=True,
                                      timeout=120, cwd=tmp)
        except (OSError, subprocess.SubprocessError) as e:
            raise NotBuilt(f"the C++ compiler '{shlex.join(self.command)}' does not run: {e}")
        if done.returncode != 0 or not done.stdout.strip():
            said = (done.stderr or done.stdout).strip()[:300]
            raise NotBuilt(f"the C++ compiler does not work: `{shlex.join(self.command + list(args))}` "
                           f"{'said: ' + said if said else f'exited with status {done.returncode}'}")
        return done.stdout.strip()

    def native(self):
        """True when the library runs on the machine that builds it."""
        host = {"amd64": "x86_64", "arm64": "aarch64"}.get(sysconfig.get_platform().split("-")[-1],
                                                           sysconfig.get_platform().split("-")[-1])
        here = "darwin" if sys.platform == "darwin" else "windows" if os.name == "nt" else "linux"
        return self.arch == host and self.system == here

    def target_flag(self, cpu, features=()):
        """-march for a CPU name and extra features ("x86-64-v3", ["avxvnni"]). zig's driver
        takes them as -mcpu=x86_64_v3+avxvnni."""
        if self.kind == "zig":
            return [f"-mcpu={cpu.replace('-', '_')}" + "".join(f"+{f}" for f in features)]
        if self.arch == "aarch64":
            return [f"-march={cpu}" + "".join(f"+{f}" for f in features)]
        return [f"-march={cpu}"] + [f"-m{f}" for f in features]

    def isa_paths(self):
        """(name, flags) of every instruction-set path, the baseline first: it defines the exported
        entry points and runs on any CPU of the target; its objects come first in the link, so
        wherever compiles share an inline function of the C++ library, the linker keeps the
        baseline's copy."""
        march = os.environ.get("MS_MOE_OPS_MARCH")
        if self.arch == "x86_64":
            generic = [f"-march={march}"] if march else self.target_flag("x86-64")
            return [("generic", generic + ["-DMOE_X86_PATHS"] + (["-mtune=generic"] if self.kind != "zig" else [])),
                    ("avx2", ["-DMOE_ISA=avx2"] + self.target_flag("x86-64-v3")),
                    ("avxvnni", ["-DMOE_ISA=avxvnni"] + self.target_flag("x86-64-v3", ["avxvnni"])),
                    ("avx512", ["-DMOE_ISA=avx512"] + self.target_flag("x86-64-v4", ["avx512vnni"]))]
        if self.arch == "aarch64":
            base = "generic" if self.kind == "zig" else "armv8-a"
            generic = [f"-march={march}"] if march else self.target_flag(base)
            return [("generic", generic + ["-DMOE_ARM_PATHS"]),
                    ("dotprod", ["-DMOE_ISA=dotprod"] +
                     self.target_flag("generic" if self.kind == "zig" else "armv8.2-a", ["dotprod"]))]
        return [("generic", [f"-march={march}"] if march else [])]

    def works(self, source, flags, link_flags=()):
        """True when `source` compiles and links into a program with these flags."""
        with tempfile.TemporaryDirectory() as tmp:
            src, exe = os.path.join(tmp, "probe.cc"), os.path.join(tmp, "probe")
            with open(src, "w") as f:
                f.write(source)
            try:
                done = subprocess.run(self.command + [*flags, src, "-o", exe, *link_flags],
                                      capture_output=True, timeout=300, cwd=tmp)
            except (OSError, subprocess.SubprocessError):
                return False
            return done.returncode == 0

    def openmp(self):
        """(compile flags, link flags, description) of OpenMP, or ([], [], why not): Apple Clang
        needs libomp (Homebrew's), zig has none; the kernels then run their loops serially."""
        probe = "#include <omp.h>\nint main() { return omp_get_max_threads() > 0 ? 0 : 1; }\n"
        candidates = [(["-fopenmp"], ["-fopenmp"], "-fopenmp")]
        if self.system == "darwin":
            for prefix in (os.environ.get("MS_MOE_OPS_LIBOMP"), "/opt/homebrew/opt/libomp",
                           "/usr/local/opt/libomp"):
                if prefix and os.path.isdir(prefix):
                    lib = os.path.join(prefix, "lib")
                    candidates.append((["-Xpreprocessor", "-fopenmp", f"-I{prefix}/include"],
                                       [f"-L{lib}", "-lomp", f"-Wl,-rpath,{lib}"], f"libomp ({prefix})"))
        if self.system == "windows":  # (the static runtime: no libgomp DLL to ship)
            candidates = [(["-fopenmp"], ["-fopenmp", "-static"], "-fopenmp (static)")]
        for compile_flags, link_flags, what in candidates:
            if self.works(probe, compile_flags, link_flags):
                return compile_flags, link_flags, what
        return [], [], "none: the compiler has no OpenMP (loops run on one thread)"


def _blas():
    """Include dir, lib dir and library name of the BLAS the kernels link against."""
    root = os.environ.get("MS_MOE_OPS_BLAS_DIR")
    if root:
        return os.path.join(root, "include"), os.path.join(root, "lib"), "scipy_openblas"
    try:
        import scipy_openblas32 as blas
    except ImportError:
        raise NotBuilt("the BLAS the kernels link against (the scipy-openblas32 package) is not "
                       "installed in the build environment") from None
    return blas.get_include_dir(), blas.get_lib_dir(), blas.get_library()


def _blas_rpath(tc, build_libdir):
    """Where the kernel library looks for the BLAS at run time, first match wins: next to an
    installed package, then (native builds) the site-packages of the environment being installed
    into (editable installs: pip builds in an isolated environment that is deleted afterwards, but
    with the target's interpreter), or where it was at build time. Windows has no run path: the
    package loads the BLAS first (ms_moe_ops.ops._library)."""
    if tc.system == "windows":
        return []
    origin = "@loader_path" if tc.system == "darwin" else "$ORIGIN"
    dirs = [f"{origin}/../scipy_openblas32/lib"]
    if tc.native():
        site = {sysconfig.get_path("purelib"), sysconfig.get_path("platlib")}
        dirs += [os.path.join(d, "scipy_openblas32", "lib") for d in sorted(site)]
        dirs.append(build_libdir)
    return list(dict.fromkeys(dirs))


def _dl(tc):
    """The dynamic loader's library on Linux (custom_aot/dispatch/onednn.cc looks for oneDNN in
    the process with dlopen; glibc before 2.34 keeps dlopen in libdl)."""
    return ["-ldl"] if tc.system == "linux" else []


# -- the build ------------------------------------------------------------------------------------

class BuildKernels(build_ext):
    def toolchain(self):
        """The compiler (cached): CXX, else Python's own C++ compiler (sysconfig), else c++;
        on Windows CXX, else g++ (MinGW-w64) when there is one."""
        if not hasattr(self, "_toolchain"):
            self._toolchain, self._toolchain_error = None, ""
            command = shlex.split(os.environ.get("CXX", ""))
            if not command and os.name == "nt":
                command = ["g++"] if shutil.which("g++") else []
                if not command:
                    self._toolchain_error = (
                        "no MinGW-w64 g++ found (the kernels are built with GCC or Clang, not MSVC); "
                        "install MinGW-w64 and set CXX=g++ for the CPU kernels")
                    return None
            command = command or shlex.split(sysconfig.get_config_var("CXX") or "") or ["c++"]
            try:
                self._toolchain = Toolchain(command)
            except NotBuilt as e:
                self._toolchain_error = str(e)
        return self._toolchain

    def get_ext_filename(self, fullname):
        # the platform's own name for a shared library on macOS and Windows (it is no Python
        # module); on Linux the usual extension name
        tc = self.toolchain()
        base = super().get_ext_filename(fullname)
        if tc is None or (tc.system == "linux" and tc.native()):
            return base
        suffix = {"darwin": ".dylib", "windows": ".dll"}.get(tc.system, ".so")
        return os.path.join(os.path.dirname(base), fullname.rpartition(".")[2] + suffix)

    def build_extensions(self):
        for ext in self.extensions:
            self.build_extension(ext)

    def build_extension(self, ext):
        out = self.get_ext_fullpath(ext.name)
        record = os.path.join(os.path.dirname(out), RECORD)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        try:
            tc = self.toolchain()
            if tc is None:
                raise NotBuilt(self._toolchain_error)
            info = self.build_library(tc, out)
        except NotBuilt as e:
            self.not_built(out, record, str(e))
            return
        except Exception as e:  # a compile or link error: say which, go on without the library
            self.not_built(out, record, f"the build failed: {e}")
            return
        write_json(record, info)

    def not_built(self, out, record, reason):
        if os.environ.get("MS_MOE_OPS_REQUIRE_KERNELS") == "1":
            raise RuntimeError(f"ms_moe_ops: the CPU kernel library was not built: {reason}")
        if os.path.exists(out):  # a library from other sources is no library of these
            os.remove(out)
        write_json(record, {"built": False, "reason": reason})
        bar = "*" * 78
        print(f"{bar}\nms_moe_ops: the CPU kernels are NOT built: {reason}.\nThe package works: "
              "every operator runs as a composition of MindSpore ops (correct, slower).\n"
              f"`python -m ms_moe_ops.info` tells what runs where.\n{bar}", file=sys.stderr)

    def build_library(self, tc, out):
        inc, libdir, lib = _blas()
        paths = tc.isa_paths()
        inputs = SOURCES + HEADERS + DISPATCH + [__file__]  # the flags live here
        record = os.path.join(os.path.dirname(out), RECORD)
        if not self.force and os.path.exists(out) and os.path.exists(record) and all(
                os.path.getmtime(f) <= os.path.getmtime(out) for f in inputs):
            with open(record) as f:
                return json.load(f)
        omp_compile, omp_link, omp_what = tc.openmp()
        flags = FLAGS + [f"-I{inc}"] + omp_compile + SANITIZE_FLAGS
        if not omp_compile:
            flags.append("-Wno-unknown-pragmas")
        if tc.system != "windows":
            flags += ["-fPIC", "-fvisibility=hidden"]
        jobs = []  # (source, object, flags), baseline first
        for i, (name, path_flags) in enumerate(paths):
            for src in SOURCES + (DISPATCH if i == 0 else []):
                obj = os.path.join(self.build_temp, name, os.path.splitext(src)[0] + ".o")
                jobs.append((src, obj, flags + path_flags))

        def compile_one(job):
            src, obj, job_flags = job
            os.makedirs(os.path.dirname(obj), exist_ok=True)
            run(tc.command + job_flags + ["-c", src, "-o", obj])
            return obj

        with ThreadPoolExecutor(os.cpu_count() or 1) as pool:
            objects = list(pool.map(compile_one, jobs))
        link = tc.command + objects + ["-o", out] + omp_link + SANITIZE_FLAGS[:1]
        if tc.system == "darwin":
            link += ["-dynamiclib", "-install_name", f"@rpath/{os.path.basename(out)}",
                     f"-L{libdir}", f"-l{lib}"]
        elif tc.system == "windows":
            # the BLAS by its DLL; the C++ and OpenMP runtimes inside (nothing else to ship)
            dlls = glob.glob(os.path.join(libdir, "*scipy_openblas*.dll"))
            if not dlls:
                raise NotBuilt(f"no scipy_openblas DLL in {libdir}")
            link += ["-shared", "-static-libgcc", "-static-libstdc++", "-static", dlls[0]]
        else:
            link += ["-shared", f"-L{libdir}", f"-l{lib}"] + _dl(tc)
        link += [f"-Wl,-rpath,{d}" for d in _blas_rpath(tc, libdir)]
        run(link)
        return {"built": True, "library": os.path.basename(out), "compiler": tc.version,
                "target": tc.triple, "system": tc.system, "arch": tc.arch,
                "paths": [name for name, _ in paths], "openmp": omp_what,
                "sanitize": SANITIZE or None}

    def copy_extensions_to_source(self):
        # the record goes where the library goes (it says why there is none)
        super().copy_extensions_to_source()
        build_py = self.get_finalized_command("build_py")
        for ext in self.extensions:
            inplace, regular = self._get_inplace_equivalent(build_py, ext)
            src = os.path.join(os.path.dirname(regular), RECORD)
            if os.path.exists(src):
                self.copy_file(src, os.path.join(os.path.dirname(inplace), RECORD))
            if not os.path.exists(regular) and os.path.exists(inplace):
                os.remove(inplace)  # a library of earlier sources

    def get_outputs(self):
        outputs = [o for o in super().get_outputs() if os.path.exists(o)]
        return outputs + [os.path.join(os.path.dirname(self.get_ext_fullpath(e.name)), RECORD)
                          for e in self.extensions]

    def copy_file(self, src, dst, *args, **kwargs):
        # Replace the library atomically: a running process keeps its mapping of the old file.
        if os.path.isdir(dst):
            dst = os.path.join(dst, os.path.basename(src))
        tmp = f"{dst}.tmp{os.getpid()}"
        shutil.copyfile(src, tmp)
        os.replace(tmp, dst)
        return dst, True


def run(cmd):
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd[:4])} ... failed:\n{(done.stderr or done.stdout)[-3000:]}")


def write_json(path, data):
    with open(path, "w") as f:
        json.dump(data, f, indent=1)
        f.write("\n")


kernels = Extension("ms_moe_ops._kernels", sources=SOURCES, depends=HEADERS, optional=True)
setup(ext_modules=[kernels], cmdclass={"build_ext": BuildKernels})
