"""rms_norm: y = weight * (x / sqrt(mean(x^2) + eps)) over the last axis, in float32: the models'
RMSNorm (ms_moe_ops.models.layers), which transformers' MoE families put before every attention
and MoE block, on the attention's queries and keys (Qwen3-MoE) and on MLA's latents.
add_rms_norm: the same of x + residual, with the sum (a residual connection, then the next
block's norm: a decoding step's, MindSpore's AddRmsNorm, aclnnAddRmsNorm, on Ascend).

Implementations: the CPU kernel; MindSpore's RmsNorm (aclnnRmsNorm) on Ascend; MindSpore ops
everywhere else. As MindSpore ops a norm is six kernels (square, mean, add, rsqrt, two products):
54 of the 160 kernels of a 2-layer Qwen3-MoE decoding step, each launch costing the CPU runtime
about 10 microseconds on top of its work; the kernel is one.
"""
import mindspore as ms
from mindspore import ops

from ._checks import attr_error, check_dtype, check_shape, unknown_rank
from ._impls import builtin, composition, kernel
from ._op import Attr, OpDef
from ._platform import A2, A3, ASCEND_950

_OP = "rms_norm"


def _eps_at_least_zero(op):
    """The attribute check of op (rms_norm, add_rms_norm): eps >= 0."""
    def check(a):
        if not a["eps"] >= 0:
            raise attr_error(op, "eps", ">= 0", a["eps"])
    return check


def _infer(a, x, weight):
    if not unknown_rank(x):
        if len(x) < 1:
            raise ValueError(f"{_OP}: 'x' must have at least one axis, got a scalar")
        check_shape(_OP, "weight", weight, [x[-1]], "[H]: one scale per element of x's last axis")
    return (list(x),)


def _infer_dtype(a, x, weight):
    check_dtype(_OP, "x", x, ("float32",))
    check_dtype(_OP, "weight", weight, ("float32",))
    return ("float32",)


def _inverse_rms(x, eps):
    return ops.rsqrt((x * x).mean(-1, keep_dims=True) + eps)


def _composed(a):
    eps = a["eps"]

    def f(x, weight):
        return weight * (x * _inverse_rms(x, eps))

    return f


def _builtin_fits(a, args, soc):
    return (0 < a["eps"] <= 1,
            f"MindSpore's RmsNorm and AddRmsNorm take eps in (0, 1], got {a['eps']}")


def _builtin(a):
    eps = a["eps"]

    def f(x, weight):
        return ops.rms_norm(x, weight, eps)[0]

    return f


def _bprop(a):
    eps = a["eps"]

    def bprop(x, weight, out, dout):
        # n = x r with r = (mean(x^2) + eps)^-1/2: dx = r (g - n mean(g n)), g = dout * weight
        r = _inverse_rms(x, eps)
        n = x * r
        g = dout * weight
        dx = r * (g - n * (g * n).mean(-1, keep_dims=True))
        dweight = (dout * n).reshape(-1, x.shape[-1]).sum(0)
        return dx, dweight

    return bprop


RMS_NORM = OpDef(
    name=_OP,
    inputs=("x", "weight"),
    outputs=("y",),
    attrs=(Attr("eps", float, 1e-6),),
    check_attrs=_eps_at_least_zero(_OP),
    infer=_infer,
    infer_dtype=_infer_dtype,
    impls=(kernel("RmsNorm"),
           builtin(_builtin, socs=(A2, A3, ASCEND_950), primitive="rms_norm", kernel="aclnnRmsNorm",
                   supports=_builtin_fits),
           composition(_composed)),
    bprop=_bprop,
)


_ADD_OP = "add_rms_norm"


def _add_infer(a, x, residual, weight):
    (y,) = _infer(a, x, weight)
    check_shape(_ADD_OP, "residual", residual, x, "x's shape")
    return y, list(x)


def _add_infer_dtype(a, x, residual, weight):
    check_dtype(_ADD_OP, "residual", residual, ("float32",))
    return _infer_dtype(a, x, weight) * 2


def _add_composed(a):
    norm = _composed(a)

    def f(x, residual, weight):
        total = x + residual
        return norm(total, weight), total

    return f


def _add_builtin(a):
    eps = a["eps"]

    def f(x, residual, weight):
        y, _, total = ops.add_rms_norm(x, residual, weight, eps)
        return y, total

    return f


def _add_bprop(a):
    norm_bprop = _bprop(a)

    def bprop(x, residual, weight, out, dout):
        dy, dtotal = dout
        dx, dweight = norm_bprop(x + residual, weight, out[0], dy)
        dx = dx + dtotal
        return dx, dx, dweight

    return bprop


ADD_RMS_NORM = OpDef(
    name=_ADD_OP,
    inputs=("x", "residual", "weight"),
    outputs=("y", "sum"),
    attrs=(Attr("eps", float, 1e-6),),
    check_attrs=_eps_at_least_zero(_ADD_OP),
    infer=_add_infer,
    infer_dtype=_add_infer_dtype,
    impls=(kernel("AddRmsNorm"),
           builtin(_add_builtin, socs=(A2, A3, ASCEND_950), primitive="add_rms_norm",
                   kernel="aclnnAddRmsNorm", supports=_builtin_fits),
           composition(_add_composed)),
    bprop=_add_bprop,
)


def rms_norm(x, weight, eps=1e-6):
    """x float32 [..., H], weight float32 [H] -> float32 [..., H]:
    `weight * (x / sqrt(mean(x^2, -1) + eps))`. Differentiable in x and weight."""
    return RMS_NORM(x, weight, eps=eps)


def add_rms_norm(x, residual, weight, eps=1e-6):
    """x, residual float32 [..., H], weight float32 [H] -> (y, sum) float32 [..., H]: sum = x +
    residual and y = rms_norm(sum, weight, eps). Differentiable in x, residual and weight."""
    return ADD_RMS_NORM(x, residual, weight, eps=eps)
