"""The C++ extension route: aclnn kernels bound through MindSpore's CustomOpBuilder.

`ops.Custom` has two limits in MindSpore 2.10 that this route does not: its PyNative path takes
tensors only (mindspore/ops/operations/custom_ops.py, `Custom.__call__` -> `pyboost_custom_ext`),
and its infer (`AGCustomInfer`) declares no value-depend input, so a host `aclIntArray` can only
be a constant of the graph. Here every operator with an aclnn binding gets, generated from its
OpDef and AclnnBinding alone (nothing per operator is written by hand):

- an op_def YAML (MindSpore's own format: `ops_generate/gen_custom_ops.py` turns it into the
  registered op definition and the primitive `Custom_<name>`): the OpDef's inputs, its attributes
  (values adjusted for the kernel, as the Custom route passes them) and `out_spec`, the output
  shapes and dtypes the declaration's own inference computed (a constant of the graph);
- C++ (`ms_moe_ops/ascend/binding.h` holds what every binding shares): the PyNative entry
  (Ascend: `AclnnOpRunner` + `LAUNCH_ACLNN_FUNC` in the prototype's order, a host copy of each
  `host` argument; CPU: this package's CPU kernel through its AOT ABI), the GRAPH-mode output
  inference (`OpFuncImpl`, host arguments value-depend) and kernel (`AclnnKernelMod`), the
  registration (`MS_CUSTOM_OPS_REGISTER`), and a compile-time check of the binding against the
  installed aclnn header (`MOE_CHECK_PROTOTYPE`: a header that disagrees fails the build, and the
  resolver then passes the implementation over, saying why).

Built on first use (CustomOpBuilder + ninja, about a minute) into a cache directory keyed by a
digest of the generated text (C++ and YAML), the shared headers, MindSpore's version, the backend
and, for Ascend, the installed CANN (its version files and the aclnn headers compiled against),
and reused from then on. Processes that build the same extension at once (msrun's workers) take
turns under an exclusive file lock held from writing the sources to loading the module:
MindSpore's own builder regenerates the op definitions (deleting the previous ones) outside its
lock, and its lock file outlives a killed build.
"""
import contextlib
import functools
import hashlib
import os

from .._compat import run_at_compile_time
from . import _cann
from ._checks import dtype_name
from ._library import kernel_library
from ._op import ABSENT, HOST, AclnnBinding

# out_spec dtype codes: binding.h's DtypeOf reads them in this order
DTYPE_CODES = ("float32", "float16", "bfloat16", "int8", "int32", "int64", "uint64", "bool", "uint8")
CACHE_ENV = "MS_MOE_OPS_EXTENSION_CACHE"
_HERE = os.path.dirname(os.path.abspath(__file__))
BINDING_DIR = os.path.join(os.path.dirname(_HERE), "ascend")

# the C type of each binding argument kind in the aclnn prototype (up to const)
C_TYPES = {"tensor": "aclTensor *", ABSENT: "aclTensor *", HOST: "aclIntArray *",
           "int": "int64_t", "bool": "bool", "float": "float", "double": "double", "str": "char *"}
# attribute kind -> (YAML dtype, pybind parameter, GRAPH-mode value type)
_ATTR = {int: ("int", "int64_t", "int64_t"), bool: ("bool", "bool", "bool"),
         float: ("float", "double", "float"), str: ("str", "std::string", "std::string")}
_CAST = {"int": "int64_t", "bool": "bool", "float": "float", "double": "double"}


def op_name(binding):
    """The YAML / Python name of a binding's operator: aclnnMoeFFN -> aclnn_moe_ffn."""
    out = ""
    for i, c in enumerate(binding.kernel):
        prev = binding.kernel[i - 1] if i else ""
        nxt = binding.kernel[i + 1] if i + 1 < len(binding.kernel) else ""
        if c.isupper() and i and (prev.islower() or (nxt.islower() and prev.isupper())):
            out += "_"
        out += c.lower()
    return out


def arguments(op, binding):
    """The operator's arguments, in order: ((name, kind)), kind "spec", an attribute's type,
    "tensor" or "optional" (the inputs last: MindSpore's generated Python function gives the
    optional ones a default, and every argument after one must have one too)."""
    args = [("out_spec", "spec")] + [(a.name, a.kind) for a in op.attrs]
    args += [(name, type(value)) for name, value in binding.fixed]
    return tuple(args) + tuple((name, "optional" if name in op.optional else "tensor")
                               for name in op.inputs)


def op_yaml(op, binding):
    """MindSpore's op_def YAML of one binding."""
    lines = [f"{op_name(binding)}:", "  args:"]
    defaults = False
    for name, kind in arguments(op, binding):
        if kind == "spec":
            dtype = "tuple[int]"
        elif kind in ("tensor", "optional"):
            dtype = "tensor"
        else:
            dtype = _ATTR[kind][0]
        lines += [f"    {name}:", f"      dtype: {dtype}"]
        defaults = defaults or kind == "optional"
        if defaults:  # always passed: the default only keeps the generated signature valid
            lines.append("      default: None")
    lines.append("  returns:")
    for name in op.outputs:
        lines += [f"    {name}:", "      dtype: tensor"]
    return "\n".join(lines) + "\n"


def _pybind_params(op, binding):
    out = []
    for name, kind in arguments(op, binding):
        if kind == "spec":
            out.append(f"const std::vector<int64_t> &{name}")
        elif kind == "tensor" and name not in _after_optional(op):
            out.append(f"const ms::Tensor &{name}")
        elif kind in ("tensor", "optional"):
            out.append(f"const std::optional<ms::Tensor> &{name}")
        else:
            out.append(f"{_ATTR[kind][1]} {name}")
    return out


def _after_optional(op):
    """The inputs from the first optional one on (each an std::optional in C++)."""
    first = min([op.inputs.index(n) for n in op.optional] or [len(op.inputs)])
    return op.inputs[first:]


def _kernel_args(op, binding, graph):
    """The aclnn call's arguments in the prototype's order, outputs excluded (C++ expressions)."""
    index = {name: i for i, (name, _) in enumerate(arguments(op, binding))}
    kinds = dict(arguments(op, binding))
    out = []
    for name, kind in binding.args:
        if kind == ABSENT:
            out.append("static_cast<mindspore::kernel::KernelTensor *>(nullptr)" if graph
                       else "std::optional<ms::Tensor>()")
        elif kind == "tensor":
            out.append(f"in[{index[name]}]" if graph else name)
        elif kind == HOST:
            value = f"*{name}" if name in _after_optional(op) else name
            out.append(f"in[{index[name]}]->GetValueWithCheck<std::vector<int64_t>>()" if graph
                       else f"moe_ext::HostValues({value})")
        elif kind == "str":
            out.append(f"in[{index[name]}]->GetValueWithCheck<std::string>()" if graph else name)
        else:
            value = (f"in[{index[name]}]->GetValueWithCheck<{_ATTR[kinds[name]][2]}>()" if graph
                     else name)
            out.append(f"static_cast<{_CAST[kind]}>({value})")
    return out


def cpp_source(entries, backend):
    """The C++ of one extension: entries are (op, binding, cpu_symbol)."""
    ascend = backend == "Ascend"
    text = ['// Generated by ms_moe_ops/ops/_extension.py from the operators\' declarations.',
            '#include "binding.h"']
    if ascend:
        text += ['#include "kernel/ascend/aclnn/kernel_mod_impl/aclnn_kernel_mod.h"']
        # by bare name: found in the first of header_folders() (custom-installed kernels first)
        text += [f'#include "{header_name(b.kernel)}"' for _, b, _ in entries]
    defs = []
    for op, binding, symbol in entries:
        name = op_name(binding)
        args = arguments(op, binding)
        params = _pybind_params(op, binding)
        names = [n for n, _ in args]
        n_out = len(op.outputs)
        ret = "ms::Tensor" if n_out == 1 else "std::vector<ms::Tensor>"
        outs = [f"out[{k}]" for k in range(n_out)]
        present = [n for n, k in args if k in ("tensor", "optional")]
        body = [f"static {ret} {name}_run({', '.join(params)}) {{",
                "  auto out = moe_ext::Outputs(out_spec);"]
        if ascend:
            body += [f'  auto runner = std::make_shared<ms::pynative::AclnnOpRunner>("{binding.kernel}");',
                     f"  runner->SetLaunchFunc(LAUNCH_ACLNN_FUNC({binding.kernel}, "
                     f"{', '.join(_kernel_args(op, binding, False) + outs)}));",
                     f"  runner->Run(moe_ext::Present({{{', '.join(present)}}}), out);"]
        else:
            body.append("  moe_ext::Attrs attrs;")
            body += [f'  attrs.Set("{n}", {n});' for n, k in args
                     if k not in ("tensor", "optional", "spec")]
            body.append(f'  moe_ext::CpuKernelRunner::Launch("{symbol}", {{{", ".join(present)}}}, '
                        f"out, attrs);")
        body += ["  return out;" if n_out > 1 else "  return out[0];", "}",
                 f"static py::object {name}({', '.join(params)}) {{",
                 f"  return ms::pynative::PyboostRunner::Call<{n_out}>({name}_run, "
                 f"{', '.join(names)});", "}"]
        host = [str(names.index(a)) for a, k in binding.args if k == HOST]
        spec = "0"
        body.append(f"using {name}_infer = moe_ext::SpecFuncImpl<{', '.join([spec] + host)}>;")
        if ascend:
            call = ", ".join(_kernel_args(op, binding, True) + [f"out[{k}]" for k in range(n_out)])
            body += [prototype_check(binding, n_out),
                     "namespace mindspore::kernel {",
                     f"class {name}_kernel : public mindspore::kernel::AclnnKernelMod {{",
                     " public:",
                     f'  {name}_kernel() : AclnnKernelMod("{binding.kernel}") {{}}',
                     "  void GetWorkSpaceInfo(const std::vector<mindspore::kernel::KernelTensor *> &in,",
                     "                        const std::vector<mindspore::kernel::KernelTensor *> &out)"
                     " override {",
                     f"    GetWorkspaceForResize({call});", "  }",
                     "  bool Launch(const std::vector<mindspore::kernel::KernelTensor *> &in,",
                     "              const std::vector<mindspore::kernel::KernelTensor *> &workspace,",
                     "              const std::vector<mindspore::kernel::KernelTensor *> &out,"
                     " void *stream) override {",
                     f"    RunOp(stream, workspace, {call});", "    return true;", "  }",
                     " private:", "  DEFINE_GET_WORKSPACE_FOR_RESIZE()", "};",
                     "}  // namespace mindspore::kernel",
                     # MS_CUSTOM_OPS_REGISTER expanded: its kernel-factory half names its flag
                     # g_custom_kernel_reg_##__COUNTER__, which pastes the token instead of a
                     # number (MindSpore 2.10 custom_kernel_factory.h), so a second registration
                     # in one file redefines the first
                     f"namespace mindspore::ops {{ DECLARE_CUSTOM_OP_IMPL({name}, ::{name}_infer); }}",
                     f"namespace mindspore::kernel {{ static const bool {name}_registered = "
                     f'CustomKernelFactory::Instance().Register("Custom_{name}", '
                     f"[]() {{ return std::make_shared<{name}_kernel>(); }}); }}"]
        else:
            # CPU: MindSpore's kernel factory for these ops is Ascend's (libmindspore_ops_ascend),
            # so only the inference is registered; GRAPH mode stops at kernel selection
            body.append(f"namespace mindspore::ops {{ DECLARE_CUSTOM_OP_IMPL({name}, ::{name}_infer); }}")
        text += [""] + body
        defs.append(f'  m.def("{name}", &{name});')
    if not ascend:
        defs.append('  m.def("set_kernel_library", &moe_ext::SetKernelLibrary);')
    text += ["", "PYBIND11_MODULE(MS_EXTENSION_NAME, m) {"] + defs + ["}", ""]
    return "\n".join(text)


def prototype_check(binding, n_out):
    """MOE_CHECK_PROTOTYPE of a binding (ms_moe_ops/ascend/prototype.h): the C types its call
    passes, then its outputs, workspace size and executor."""
    types = [C_TYPES[k] for _, k in binding.args] + ["aclTensor *"] * n_out
    return (f"MOE_CHECK_PROTOTYPE({binding.kernel}, "
            f"{', '.join(types + ['uint64_t *', 'aclOpExecutor **'])});")


def prototype_source(entries):
    """A translation unit that checks every binding against its header and nothing else."""
    lines = ['#include "prototype.h"']
    lines += [f'#include "{header_name(b.kernel)}"' for _, b, _ in entries]
    lines += [prototype_check(b, len(op.outputs)) for op, b, _ in entries]
    return "\n".join(lines) + "\n"


def header_name(kernel):
    """CANN's header of an aclnn kernel: aclnnMoeGatingTopK -> aclnn_moe_gating_top_k.h,
    aclnnFFNV3 -> aclnn_ffn_v3.h (a version suffix is its own word)."""
    name = op_name(AclnnBinding(kernel, (), ()))
    stem = name.rstrip("0123456789")
    if stem != name and stem.endswith("v") and not stem.endswith("_v"):
        name = stem[:-1] + "_v" + name[len(stem):]
    return name + ".h"


# -- building ----------------------------------------------------------------------------------

def cache_root():
    return os.environ.get(CACHE_ENV) or os.path.join(
        os.path.expanduser("~"), ".cache", "ms_moe_ops", "extensions")


def cann_fingerprint(entries):
    """What of the installed CANN an Ascend build depends on: its version files and the aclnn
    headers of `entries` it would compile against (a CANN upgrade rebuilds)."""
    parts = []
    for root in _cann.roots():
        for name in ("version.cfg", "version.info", os.path.join("opp", "version.info"),
                     os.path.join("compiler", "version.info")):
            parts.append(_read(os.path.join(root, name)))
    for _, binding, _ in entries:
        paths = _cann.header_paths(binding.kernel, header_name(binding.kernel))
        parts.append(_read(paths[0]) if paths else "")
    return "\0".join(parts)


def _read(path):
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f"{path}\n{f.read()}"
    except OSError:
        return ""


def _write(path, text):
    """Writes text unless the file already holds it (a built extension's sources keep their
    time stamps), through a temporary file (no reader sees half a file)."""
    if _read(path) == f"{path}\n{text}":
        return
    partial = f"{path}.{os.getpid()}.tmp"
    with open(partial, "w") as f:
        f.write(text)
    os.replace(partial, path)


def module_name(entries, backend):
    """The extension's module name: a digest of everything its build depends on."""
    import mindspore  # pylint: disable=import-outside-toplevel

    shared = "".join(_read(os.path.join(BINDING_DIR, h)) for h in ("binding.h", "prototype.h"))
    cann = cann_fingerprint(entries) if backend == "Ascend" else ""
    digest = hashlib.sha256("\0".join(
        [mindspore.__version__, backend, cpp_source(entries, backend), shared, cann] +
        sorted(op_yaml(op, b) for op, b, _ in entries)).encode()).hexdigest()[:16]
    return f"ms_moe_ops_{backend.lower()}_{digest}"


@contextlib.contextmanager
def build_lock(folder):
    """An exclusive lock on an extension's folder, between processes (released when its holder
    exits, however it exits)."""
    import fcntl  # pylint: disable=import-outside-toplevel  # Linux only, as MindSpore's Custom ops

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "ms_moe_ops.lock"), "a") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            # under this lock no other process builds here: a MindSpore lock file left over is
            # from a build that was killed, and would make MindSpore wait for ever
            stale = os.path.join(folder, "build", "build.lock")
            if os.path.exists(stale):
                os.remove(stale)
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def write_sources(entries, backend, directory):
    """Writes the YAML files and the C++ source; returns (module name, source, yaml paths)."""
    module = module_name(entries, backend)
    folder = os.path.join(directory, module)
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "binding.cc")
    _write(path, cpp_source(entries, backend))
    paths = []
    for op, binding, _ in entries:
        paths.append(os.path.join(folder, f"{op_name(binding)}_op.yaml"))
        _write(paths[-1], op_yaml(op, binding))
    return module, path, paths


def include_folders(backend):
    """Include folders of a build besides MindSpore's own: this package's shared headers, and
    for Ascend every folder of aclnn headers, custom-installed kernels' (opp/vendors/*/op_api/
    include, $ASCEND_CUSTOM_OPP_PATH) before the toolkit's include/aclnnop."""
    folders = [BINDING_DIR]
    if backend == "Ascend":
        folders += _cann.header_folders()
    return folders


def builder(entries, backend, directory=None, include_paths=()):
    """The CustomOpBuilder of an extension (not built yet)."""
    from mindspore.ops import CustomOpBuilder  # pylint: disable=import-outside-toplevel

    directory = directory or cache_root()
    module, source, yamls = write_sources(entries, backend, directory)
    return CustomOpBuilder(module, [source], backend=backend,
                           include_paths=include_folders(backend) + list(include_paths),
                           build_dir=os.path.join(directory, module, "build"), op_def=yamls)


@functools.lru_cache(maxsize=None)
def load(entries, backend):
    """The loaded extension of `entries` (built on first use, then from the cache)."""
    directory = cache_root()
    with build_lock(os.path.join(directory, module_name(entries, backend))):
        mod = builder(entries, backend, directory).load()
    if backend == "CPU":
        mod.so_module.set_kernel_library(kernel_library())
    return mod


def function(op, binding, backend="Ascend", symbol=""):
    """The extension's function of one binding (built on first use)."""
    return getattr(load(((op, binding, symbol),), backend), op_name(binding))


def _out_spec_now(shape_of, dtype_of, in_shapes, in_dtypes):
    """out_spec of a call from the declaration's inference (shape_of/dtype_of: infer_fns)."""
    shapes, dtypes = shape_of(*in_shapes), dtype_of(*in_dtypes)
    if not isinstance(dtypes, tuple):
        shapes, dtypes = (shapes,), (dtypes,)
    return encode_spec(shapes, dtypes)


def encode_spec(shapes, dtypes):
    spec = [len(shapes)]
    for shape, dtype in zip(shapes, dtypes):
        spec += [DTYPE_CODES.index(dtype_name(dtype)), len(shape)] + list(shape)
    return tuple(spec)


def out_spec(shape_of, dtype_of):
    """f(input shapes, input dtypes) -> out_spec, run in Python while a graph is built (a constant
    of the graph, as static shapes are) and at every call in PyNative mode."""
    return run_at_compile_time(functools.partial(_out_spec_now, shape_of, dtype_of))


def every_binding(operators):
    """(op, binding, CPU kernel symbol) of every aclnn binding of `operators`, once each."""
    found = {}
    for op in operators:
        cpu = next((impl.symbol for impl in op.impls if impl.symbol), "")
        for impl in op.impls:
            if impl.binding is not None:
                found.setdefault(impl.binding, (op, impl.binding, cpu))
    return tuple(found.values())
