"""The four kinds of implementation an OpDef declares, and how each is built.

- kernel(symbol): this package's C++ CPU kernel, a Custom AOT primitive with the OpDef's bprop.
- aclnn(name, args, socs, ...): a CANN aclnn kernel: through a Custom AOT primitive and its
  CustomRegOp in GRAPH mode, through the C++ extension (CustomOpBuilder) in PyNative mode (where
  MindSpore's custom path takes tensors only, at most 12) and for host arguments.
- builtin(build, socs, ...): a MindSpore built-in primitive for Ascend.
- composition(build): MindSpore ops only, so it runs on every device.
"""
import os
import shutil

from mindspore import ops
from mindspore.ops import DataType

from .. import _compat
from . import _cann, _extension, _platform
from ._checks import dtype_name, to_mstype
from ._library import kernel_library, kernel_library_missing  # noqa: F401 (also used from here)
from ._op import ABSENT, ACLNN, BUILTIN, COMPOSITION, HOST, KERNEL, AclnnBinding, Impl

_PY_KINDS = {"int": int, "bool": bool, "float": float, "double": float, "str": str}


def kernel(symbol):
    """The CPU kernel `symbol` of the compiled library."""
    def build(op, attrs):
        out_shape, out_dtype = infer_fns(op, attrs)
        prim = ops.Custom(f"{kernel_library()}:{symbol}", out_shape=out_shape, out_dtype=out_dtype,
                          func_type="aot", bprop=op.bprop(attrs) if op.bprop else None,
                          reg_info=kernel_reg_info(op))
        # Shapes come from the library's <symbol>InferShape (custom_aot/infer_shape.cc), which
        # MindSpore also calls at run time for dimensions unknown until then; out_shape still runs
        # (with out_dtype) while the graph is built.
        prim.add_prim_attr("cpp_infer_shape", True)
        for key, value in attrs.items():
            prim.add_prim_attr(key, value)
        return _star(prim)

    return Impl(KERNEL, build, target="CPU", grad="self", available=kernel_library_missing,
                about=f"this package's C++ kernel {symbol}", symbol=symbol)


def aclnn(name, args, socs, dtypes, supports=None, scalars=None, around=None, fixed=()):
    """An aclnn kernel, only when the installed CANN has it (symbol, header prototype, SoC):
    two implementations named "aclnn", one per route. GRAPH mode: an `ops.Custom` primitive and
    its CustomRegOp (MindSpore generates the call from the header). PyNative mode, and GRAPH too
    for a kernel with a `host` argument: the C++ extension generated from this declaration
    (`_extension`: CustomOpBuilder, `AclnnOpRunner` in PyNative, an `AclnnKernelMod` in GRAPH).

    args: the prototype's call arguments in order, outputs excluded: "x, bias, k:int, ...,
    eps:double". Unannotated names are the OpDef's tensor inputs (each once, in the kernel's
    order), `name?` an optional tensor argument this package leaves out (None), `name:host` an
    input the kernel takes as a host aclIntArray of its values (extension route only), `name:type`
    a scalar of that reg-info type (ACLNN_SCALARS): one of the OpDef's attributes, or a constant
    of `fixed` ({name: value}). Tensors come before scalars (MindSpore passes a registration's
    inputs before its attributes). dtypes: the dtype combinations the kernel is called with, one
    tuple of names per combination, the OpDef's inputs in its order then outputs (an absent
    optional input is added for each; None: always absent). scalars(attrs) -> {name: value}
    adjusts values for this kernel alone. around(attrs) -> f(call, inputs) -> outputs wraps the
    kernel call (e.g. dtype casts or masks the kernel needs).
    """
    binding = AclnnBinding(name, parse_args(args), tuple(tuple(row) for row in dtypes),
                           tuple(dict(fixed).items()))
    host = any(kind == HOST for _, kind in binding.args)

    def values_of(attrs):
        return dict(attrs, **dict(binding.fixed), **(scalars(attrs) if scalars else {}))

    def wrapped(call, attrs):
        if around is None:
            return call
        wrap = around(attrs)
        return lambda inputs: wrap(call, inputs)

    def build_custom(op, attrs):
        values = values_of(attrs)
        # No bprop on the primitive: MindSpore passes the registered attributes as inputs (after
        # the tensors, in registration order) and would hand a primitive's bprop all of them. The
        # resolver wraps the call in a Cell whose bprop is the OpDef's, on the tensor inputs.
        prim = ops.Custom(name, *infer_fns(op, attrs, binding.tensors,
                                           dtype_rows(op, binding.dtypes), name),
                          func_type="aot", reg_info=aclnn_reg_info(op, binding))
        # the registered attributes carry no value: MindSpore passes them as inputs, after
        # the tensors, in registration order
        trailing = tuple(_PY_KINDS[kind](values[arg]) for arg, kind in binding.scalars)
        order = [op.inputs.index(arg) if arg in op.inputs else None for arg in binding.tensors]

        def call(inputs):
            return prim(*[None if i is None else inputs[i] for i in order], *trailing)

        return wrapped(call, attrs)

    def build_extension(op, attrs):
        fn = _extension.function(op, binding, "Ascend")
        return wrapped(extension_call(op, binding, attrs, values_of(attrs), fn), attrs)

    def available():
        return _cann.unavailable(name, _extension.header_name(name), prototype_types(binding),
                                 _compat.ascend_soc_version() or "")

    def fits(static):
        def check(a, args_, soc):
            if static and any(d < 0 for info in args_.values() if info is not None for d in info.shape):
                return False, "the shape is only known at run time (the extension takes static shapes)"
            return supports(a, args_, soc) if supports else (True, "")
        return check

    ext = Impl(ACLNN, build_extension, target="Ascend", socs=tuple(socs),
               modes=(_platform.GRAPH, _platform.PYNATIVE) if host else (_platform.PYNATIVE,),
               supports=fits(True), binding=binding, available=lambda: available() or extension_missing(),
               about=name, route="extension", host_values=host)
    if host:
        return (ext,)
    custom = Impl(ACLNN, build_custom, target="Ascend", socs=tuple(socs), modes=(_platform.GRAPH,),
                  supports=supports, binding=binding, available=available, about=name)
    return (custom, ext)


def prototype_types(binding):
    """The C types a binding's call passes (outputs, workspace size and executor included)."""
    return tuple(_extension.C_TYPES[k] for _, k in binding.args) + \
        ("aclTensor *",) * binding.outputs + ("uint64_t *", "aclOpExecutor **")


def extension_missing():
    """'' when MindSpore can build the C++ extension here, else why not."""
    if not os.environ.get("ASCEND_OPP_PATH"):
        return "ASCEND_OPP_PATH is not set (source CANN's set_env.sh): CustomOpBuilder needs it"
    if shutil.which("ninja") is None:
        return "ninja is not installed (pip install ninja): CustomOpBuilder builds with it"
    return ""


def extension_call(op, binding, attrs, values, fn):
    """f(inputs) calling an extension function: the OpDef's inputs, its attributes and fixed
    values (as the kernel takes them), and the output shapes and dtypes its inference gives."""
    # evaluated in Python while a graph is built (a constant of the graph, as static shapes are)
    spec_of = _extension.out_spec(*infer_fns(op, attrs, op.inputs,
                                             dtype_rows(op, binding.dtypes), binding.kernel))
    trailing = tuple(values[n] for n, kind in _extension.arguments(op, binding)
                     if kind not in ("tensor", "optional", "spec"))

    def call(inputs):
        shapes = [None if x is None else x.shape for x in inputs]
        dtypes = [None if x is None else x.dtype for x in inputs]
        return fn(spec_of(shapes, dtypes), *trailing, *inputs)

    return call


def builtin(build, socs, primitive, kernel, supports=None, grad="op"):
    """A MindSpore built-in primitive for Ascend: build(attrs) -> f(*inputs); primitive: its
    name, kernel: the aclnn kernel it calls (the installed CANN must have it)."""
    return Impl(BUILTIN, lambda op, attrs: _star(build(attrs)), target="Ascend", socs=tuple(socs),
                supports=supports, grad=grad, about=f"{primitive}: {kernel}",
                available=lambda: _cann.kernel_missing(kernel))


def composition(build, supports=None, grad="op", warn=""):
    """MindSpore ops only, runnable on every device: build(attrs) -> f(*inputs). warn: its cost,
    logged at WARNING whenever the resolver chooses it by itself."""
    return Impl(COMPOSITION, lambda op, attrs: _star(build(attrs)), supports=supports, grad=grad,
                warn=warn, about="MindSpore ops")


def kernel_reg_info(op):
    """A named registration of a CPU kernel (any dtype): MindSpore needs one to infer shapes at
    run time (without it: "The pointer[value] is null")."""
    reg = ops.CustomRegOp(op.name)
    for i, arg in enumerate(op.inputs):
        reg = reg.input(i, arg, "optional" if arg in op.optional else "required")
    for j, arg in enumerate(op.outputs):
        reg = reg.output(j, arg, "required")
    reg = reg.dtype_format(*[DataType.None_None] * (len(op.inputs) + len(op.outputs)))
    return reg.target("CPU").get_op_info()


def _star(fn):
    def call(inputs):
        return fn(*inputs)
    return call


# -- aclnn bindings ---------------------------------------------------------------------------

def parse_args(text):
    """"x, w?, k:int" -> (("x", "tensor"), ("w", ABSENT), ("k", "int"))."""
    out = []
    for item in text.split(","):
        arg, _, kind = item.strip().partition(":")
        if arg.endswith("?"):
            arg, kind = arg[:-1], ABSENT
        out.append((arg, kind or "tensor"))
    return tuple(out)


def aclnn_reg_info(op, binding):
    """CustomRegOp registration of an aclnn kernel, arguments in the prototype's order; one
    dtype_format row per dtype combination (MindSpore refuses a registration without them), with
    the variants where optional inputs are absent."""
    reg = ops.CustomRegOp(binding.kernel)
    for i, arg in enumerate(binding.tensors):
        required = arg in op.inputs and arg not in op.optional
        reg = reg.input(i, arg, "required" if required else "optional")
    for arg, kind in binding.scalars:
        reg = reg.attr(arg, "required", kind)
    for j, arg in enumerate(op.outputs):
        reg = reg.output(j, arg, "required")
    for row in dtype_rows(op, binding.dtypes):
        by_name = dict(zip(op.inputs, row))
        kernel_row = [by_name.get(arg) for arg in binding.tensors] + list(row[len(op.inputs):])
        reg = reg.dtype_format(*[getattr(DataType, _DATA_TYPES[d]) for d in kernel_row])
    return reg.target("Ascend").get_op_info()


_DATA_TYPES = {"float16": "F16_Default", "bfloat16": "BF16_Default", "float32": "F32_Default",
               "int8": "I8_Default", "int32": "I32_Default", "int64": "I64_Default",
               "uint64": "U64_Default", None: "None_None"}


def dtype_rows(op, dtypes):
    """Every dtype combination with each subset of its optional inputs absent (None)."""
    rows = []
    for row in dtypes:
        variants = [()]
        for arg, dtype in zip(op.inputs, row):
            options = (dtype, None) if arg in op.optional and dtype is not None else (dtype,)
            variants = [v + (o,) for v in variants for o in options]
        rows += [v + tuple(row[len(op.inputs):]) for v in variants]
    return rows


# -- inference for Custom primitives --------------------------------------------------------------

def infer_fns(op, attrs, order=None, rows=None, kernel=""):
    """out_shape/out_dtype callables: pick the OpDef's inputs (passed in `order`, the names of a
    kernel's tensor arguments, when given; scalars passed as inputs after them), run the declared
    inference. With `rows` (a kernel's registered dtype combinations: the OpDef's inputs, then
    outputs) the output dtypes are those of the row of the call's input dtypes: a kernel may be
    called with other dtypes than the operator's (a float32 bias for a bfloat16 product)."""
    order = tuple(order or op.inputs)

    def pick(args):
        if len(args) < len(order):
            raise TypeError(f"{op.name}: expected {len(order)} inputs {order}, got {len(args)}")
        by_name = dict(zip(order, args))
        for arg in op.inputs:
            if by_name[arg] is None and arg not in op.optional:
                raise ValueError(f"{op.name}: input '{arg}' is required, got None")
        return [by_name[arg] for arg in op.inputs]

    def out_shape(*shapes):
        res = op.infer(attrs, *pick(shapes))
        return list(res[0]) if len(op.outputs) == 1 else tuple(list(s) for s in res)

    def out_dtype(*dtypes):
        names = [None if d is None else dtype_name(d) for d in pick(dtypes)]
        if rows is None:
            res = op.infer_dtype(attrs, *names)
        else:
            res = next((row[len(names):] for row in rows if list(row[:len(names)]) == names), None)
            if res is None:
                raise TypeError(f"{op.name}: {kernel} is not registered for the input dtypes "
                                f"{dict(zip(op.inputs, names))}")
        return to_mstype(res[0]) if len(op.outputs) == 1 else tuple(to_mstype(d) for d in res)

    return out_shape, out_dtype
