"""The operator pattern: one declaration per operator, one builder for every backend.

An `OpDef` holds everything about an operator once: inputs (optional ones marked), typed
attributes with defaults, outputs, shape/dtype inference with all validation, the CPU kernel
symbol, the Ascend binding (an aclnn kernel with its positional argument order, or a composition
of MindSpore ops) and the bprop. Calling an OpDef builds (once, cached) the primitive for the
current device target and applies it; nothing else in the package repeats a signature.
"""
import functools
import glob
import os
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import mindspore as ms
from mindspore import ops

from ._checks import dtype_name, to_mstype

_TYPES = {bool: "bool", int: "int", float: "float", str: "str"}


@dataclass(frozen=True)
class Attr:
    """A typed attribute. `kind` is bool, int, float or str; floats reach the kernel as float32."""
    name: str
    kind: type
    default: object

    def convert(self, op_name, value):
        kind = self.kind
        ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            ok = True
        if not ok:
            raise TypeError(f"{op_name}: attribute '{self.name}' must be {kind.__name__}, "
                            f"got {type(value).__name__} ({value!r})")
        return kind(value)


@dataclass(frozen=True)
class OpDef:
    """Declaration of one operator.

    infer(attrs, *shapes) -> tuple of output shapes and infer_dtype(attrs, *dtypes) -> tuple of
    output dtype names receive one entry per input (None for an absent optional input); dtypes
    are names such as "float32". They raise TypeError/ValueError for bad input. check_attrs(attrs)
    validates attribute values alone. bprop(attrs) returns the bprop function
    f(*inputs, out, dout) -> one gradient per input.
    """
    name: str
    inputs: Tuple[str, ...]
    outputs: Tuple[str, ...]
    infer: Callable
    infer_dtype: Callable
    cpu: str
    attrs: Tuple[Attr, ...] = ()
    optional: Tuple[str, ...] = ()
    check_attrs: Optional[Callable] = None
    bprop: Optional[Callable] = None
    # Ascend: the aclnn kernel and its positional order (input and attribute names), or a function
    # (attrs) -> f(*inputs) composed of MindSpore ops.
    aclnn: Optional[str] = None
    aclnn_args: Tuple[str, ...] = ()
    ascend: Optional[Callable] = None

    # -- attributes -------------------------------------------------------------------------
    def resolve(self, **kwargs):
        """Attribute dict with defaults filled in, types converted and values validated."""
        known = {a.name: a for a in self.attrs}
        for key in kwargs:
            if key not in known:
                raise TypeError(f"{self.name}: unknown attribute '{key}'")
        attrs = {a.name: a.convert(self.name, kwargs.get(a.name, a.default)) for a in self.attrs}
        if self.check_attrs is not None:
            self.check_attrs(attrs)
        return attrs

    # -- the primitive --------------------------------------------------------------------------
    def __post_init__(self):
        if self.aclnn is not None:
            # aclnn prototypes take the tensors first, then the scalars
            tensors = tuple(a for a in self.aclnn_args if a in self.inputs)
            assert tensors == self.inputs == self.aclnn_args[:len(tensors)], self.name
            assert set(self.aclnn_args[len(tensors):]) <= {a.name for a in self.attrs}, self.name

    def __call__(self, *inputs, **kwargs):
        """Applies the operator: inputs in declaration order (None for absent optional ones)."""
        prim, scalars = _bind(self, **kwargs)
        return prim(*inputs, *scalars)


@functools.lru_cache(None, typed=True)  # typed: k=2.0 must not hit the entry of k=2
def _bind(op, **kwargs):
    """(primitive, trailing scalar arguments) for a call. Cached, and being no plain function
    MindSpore's graph compiler evaluates it in Python while it builds the graph. The device
    target is read on the first call with these attributes (MindSpore fixes it per process)."""
    attrs = op.resolve(**kwargs)
    target = _device_target()
    scalars = tuple(attrs[a] for a in op.aclnn_args[len(op.inputs):]) if (
        target == "Ascend" and op.ascend is None) else ()
    return _build(op, tuple(attrs.items()), target), scalars


def _device_target():
    return ms.get_context("device_target")


# ---------------------------------------------------------------------------------------------
# Kernel library

def kernel_library():
    """Path of the compiled CPU kernels (built by `pip install`)."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    found = sorted(glob.glob(os.path.join(here, "_kernels*.so")))
    if not found:
        raise RuntimeError("ms_moe_ops: the CPU kernel library is missing; reinstall the package "
                           "with `pip install .` (or `pip install -e .`) so it is compiled")
    _preload_blas()
    return found[0]


@functools.lru_cache(None)
def _preload_blas():
    # The kernels link libscipy_openblas by name; load it globally first so MindSpore's dlopen
    # of the kernel library finds it wherever pip put it.
    import ctypes
    import scipy_openblas32

    libdir = scipy_openblas32.get_lib_dir()
    name = scipy_openblas32.get_library()
    ctypes.CDLL(os.path.join(libdir, f"lib{name}.so"), mode=ctypes.RTLD_GLOBAL)


# ---------------------------------------------------------------------------------------------
# Builders

def _infer_fns(op, attrs):
    """out_shape/out_dtype callables: pick the tensor inputs, run the declared inference."""
    n = len(op.inputs)

    def pick(args):
        if len(args) < n:
            raise TypeError(f"{op.name}: expected {n} inputs {op.inputs}, got {len(args)}")
        for name, value in zip(op.inputs, args):
            if value is None and name not in op.optional:
                raise ValueError(f"{op.name}: input '{name}' is required, got None")
        return list(args[:n])

    def out_shape(*shapes):
        res = op.infer(attrs, *pick(shapes))
        return list(res[0]) if len(op.outputs) == 1 else tuple(list(s) for s in res)

    def out_dtype(*dtypes):
        names = [None if d is None else dtype_name(d) for d in pick(dtypes)]
        res = op.infer_dtype(attrs, *names)
        return to_mstype(res[0]) if len(op.outputs) == 1 else tuple(to_mstype(d) for d in res)

    return out_shape, out_dtype


def _bprop(op, attrs):
    return op.bprop(attrs) if op.bprop is not None else None


@functools.lru_cache(None)
def _build(op, attr_items, target):
    attrs = dict(attr_items)
    if target == "Ascend":
        if op.ascend is not None:
            return op.ascend(attrs)
        return _build_aclnn(op, attrs)
    out_shape, out_dtype = _infer_fns(op, attrs)
    prim = ops.Custom(f"{kernel_library()}:{op.cpu}", out_shape=out_shape, out_dtype=out_dtype,
                      func_type="aot", bprop=_bprop(op, attrs))
    for key, value in attrs.items():
        prim.add_prim_attr(key, value)
    return prim


def aclnn_reg_info(op, attrs):
    """CustomRegOp registration of an aclnn kernel, arguments in the aclnn prototype's order."""
    reg = ops.CustomRegOp(op.aclnn)
    i = 0
    for name in op.aclnn_args:
        if name in op.inputs:
            reg = reg.input(i, name, "optional" if name in op.optional else "required")
            i += 1
    kinds = {a.name: a.kind for a in op.attrs}
    for name in op.aclnn_args:
        if name not in op.inputs:
            reg = reg.attr(name, "required", _TYPES[kinds[name]], value=attrs[name])
    for j, name in enumerate(op.outputs):
        reg = reg.output(j, name, "required")
    return reg.target("Ascend").get_op_info()


def _build_aclnn(op, attrs):
    if op.aclnn is None:
        raise NotImplementedError(f"{op.name}: no Ascend binding")
    out_shape, out_dtype = _infer_fns(op, attrs)
    prim = ops.Custom(op.aclnn, out_shape=out_shape, out_dtype=out_dtype, func_type="aot",
                      bprop=_bprop(op, attrs), reg_info=aclnn_reg_info(op, attrs))
    return prim
