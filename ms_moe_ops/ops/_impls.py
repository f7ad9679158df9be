"""The four kinds of implementation an OpDef declares, and how each is built.

- kernel(symbol): this package's C++ CPU kernel, a Custom AOT primitive with the OpDef's bprop.
- aclnn(name, args, socs, ...): a CANN aclnn kernel through a Custom AOT primitive and its
  CustomRegOp (GRAPH mode only: MindSpore's PyNative custom path takes tensors only, at most 12).
- builtin(build, socs, ...): a MindSpore built-in primitive for Ascend.
- composition(build): MindSpore ops only, so it runs on every device.
"""
from mindspore import ops
from mindspore.ops import DataType

from . import _platform
from ._checks import dtype_name, to_mstype
from ._library import kernel_library, kernel_library_missing  # noqa: F401 (also used from here)
from ._op import ACLNN, BUILTIN, COMPOSITION, KERNEL, AclnnBinding, Impl

_PY_KINDS = {"int": int, "bool": bool, "float": float, "double": float}


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

    return Impl(KERNEL, build, target="CPU", grad="self", available=kernel_library_missing)


def aclnn(name, args, socs, dtypes, supports=None, scalars=None, around=None):
    """An aclnn kernel called through ops.Custom.

    args: the prototype's call arguments in order, outputs excluded: "x, bias, k:int, ...,
    eps:double". Unannotated names are the OpDef's tensor inputs (same order as its inputs);
    `name:type` is one of its attributes passed as a scalar of that reg-info type
    (ACLNN_SCALARS). dtypes: the dtype combinations the kernel is called with, one tuple of
    names per combination, inputs then outputs (an absent optional input is added for each).
    scalars(attrs) -> {name: value} adjusts values for this kernel alone. around(call, inputs)
    -> outputs wraps the kernel call (e.g. dtype casts the kernel needs).
    """
    binding = AclnnBinding(name, parse_args(args), tuple(tuple(row) for row in dtypes))

    def build(op, attrs):
        values = dict(attrs, **(scalars(attrs) if scalars else {}))
        prim = ops.Custom(name, *infer_fns(op, attrs), func_type="aot",
                          bprop=op.bprop(attrs) if op.bprop else None,
                          reg_info=aclnn_reg_info(op, binding))
        # the registered attributes carry no value: MindSpore passes them as inputs, after
        # the tensors, in registration order
        trailing = tuple(_PY_KINDS[kind](values[arg]) for arg, kind in binding.args
                         if kind != "tensor")

        def call(inputs):
            return prim(*inputs, *trailing)

        if around is None:
            return call

        def wrapped(inputs):
            return around(call, inputs)

        return wrapped

    return Impl(ACLNN, build, target="Ascend", socs=tuple(socs), modes=(_platform.GRAPH,),
                supports=supports, grad="self", binding=binding)


def builtin(build, socs, supports=None, grad="op"):
    """A MindSpore built-in primitive: build(attrs) -> f(*inputs)."""
    return Impl(BUILTIN, lambda op, attrs: _star(build(attrs)), target="Ascend", socs=tuple(socs),
                supports=supports, grad=grad)


def composition(build, supports=None, grad="op"):
    """MindSpore ops only, runnable on every device: build(attrs) -> f(*inputs)."""
    return Impl(COMPOSITION, lambda op, attrs: _star(build(attrs)), supports=supports, grad=grad)


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
    """"x, k:int" -> (("x", "tensor"), ("k", "int"))."""
    out = []
    for item in text.split(","):
        arg, _, kind = item.strip().partition(":")
        out.append((arg, kind or "tensor"))
    return tuple(out)


def aclnn_reg_info(op, binding):
    """CustomRegOp registration of an aclnn kernel, arguments in the prototype's order; one
    dtype_format row per dtype combination (MindSpore refuses a registration without them), with
    the variants where optional inputs are absent."""
    reg = ops.CustomRegOp(binding.kernel)
    for i, arg in enumerate(op.inputs):
        reg = reg.input(i, arg, "optional" if arg in op.optional else "required")
    for arg, kind in binding.args[len(op.inputs):]:
        reg = reg.attr(arg, "required", kind)
    for j, arg in enumerate(op.outputs):
        reg = reg.output(j, arg, "required")
    for row in dtype_rows(op, binding.dtypes):
        reg = reg.dtype_format(*[getattr(DataType, _DATA_TYPES[d]) for d in row])
    return reg.target("Ascend").get_op_info()


_DATA_TYPES = {"float16": "F16_Default", "bfloat16": "BF16_Default", "float32": "F32_Default",
               "int32": "I32_Default", "int64": "I64_Default", None: "None_None"}


def dtype_rows(op, dtypes):
    """Every dtype combination with each subset of its optional inputs absent (None)."""
    rows = []
    for row in dtypes:
        variants = [()]
        for arg, dtype in zip(op.inputs, row):
            options = (dtype, None) if arg in op.optional else (dtype,)
            variants = [v + (o,) for v in variants for o in options]
        rows += [v + tuple(row[len(op.inputs):]) for v in variants]
    return rows


# -- inference for Custom primitives --------------------------------------------------------------

def infer_fns(op, attrs):
    """out_shape/out_dtype callables: pick the tensor inputs, run the declared inference."""
    n = len(op.inputs)

    def pick(args):
        if len(args) < n:
            raise TypeError(f"{op.name}: expected {n} inputs {op.inputs}, got {len(args)}")
        for arg, value in zip(op.inputs, args):
            if value is None and arg not in op.optional:
                raise ValueError(f"{op.name}: input '{arg}' is required, got None")
        return list(args[:n])

    def out_shape(*shapes):
        res = op.infer(attrs, *pick(shapes))
        return list(res[0]) if len(op.outputs) == 1 else tuple(list(s) for s in res)

    def out_dtype(*dtypes):
        names = [None if d is None else dtype_name(d) for d in pick(dtypes)]
        res = op.infer_dtype(attrs, *names)
        return to_mstype(res[0]) if len(op.outputs) == 1 else tuple(to_mstype(d) for d in res)

    return out_shape, out_dtype
