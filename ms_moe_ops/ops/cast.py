"""cast: float32/float16/bfloat16 to another of them, rounded to nearest-even: the dtype changes
the Cells make under mixed precision (tokens, weights, and their gradients back).

Implementations: the CPU kernel; MindSpore's Cast everywhere else. On the CPU, MindSpore 2.10's
Cast of bfloat16 takes 3 to 14 ns per element (27 ms for [4096, 512] bfloat16 to float32 on the
development machine), which made the casts of a bfloat16 training step cost as much as its matrix
products; the kernel converts at memory speed.
"""
from ._checks import FLOATS, attr_error, check_dtype, to_mstype
from ._impls import composition, kernel
from ._op import Attr, OpDef

_OP = "cast"


def _check_attrs(a):
    if a["dtype"] not in FLOATS:
        raise attr_error(_OP, "dtype", " or ".join(FLOATS), a["dtype"])


def _infer(a, x):
    return (list(x),)


def _infer_dtype(a, x):
    check_dtype(_OP, "x", x, FLOATS)
    return (a["dtype"],)


def _bprop(a):
    def bprop(x, out, dout):
        return (cast(dout, x.dtype),)

    return bprop


def _composed(a):
    dtype = to_mstype(a["dtype"])

    def f(x):
        return x.astype(dtype)

    return f


CAST = OpDef(
    name=_OP,
    inputs=("x",),
    outputs=("y",),
    attrs=(Attr("dtype", str, "float32"),),
    check_attrs=_check_attrs,
    infer=_infer,
    infer_dtype=_infer_dtype,
    impls=(kernel("Cast"), composition(_composed)),
    bprop=_bprop,
)


def cast(x, dtype):
    """x in `dtype` (float32, float16 or bfloat16; a name or a MindSpore dtype), each element
    rounded to nearest-even; x itself when it already has that dtype. Differentiable (the
    gradient is cast back to x's dtype)."""
    if x.dtype == dtype:
        return x
    return CAST(x, dtype=dtype)
