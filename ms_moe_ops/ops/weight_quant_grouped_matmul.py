"""weight_quant_grouped_matmul: the products of weight-only int8 experts (ms_moe_ops.quantize's),
y[rows of e] = (x[rows of e] @ float(weight[e])) * scale[e], the int8 weights read as they are
(Ascend's weight-quantised grouped product, GroupedMatmul's antiquant scale, has this form).

Implementations: the CPU kernel, made for the few rows per expert of a decoding step: it reads
each int8 weight once, where dequantize then grouped_matmul write and read it again as float32
(9 bytes of memory traffic per weight instead of 1). MindSpore ops everywhere else: dequantize
and grouped_matmul.
"""
import mindspore as ms
from mindspore import ops

from ._checks import check_dtype, check_shape, dims, known
from ._impls import composition, kernel
from ._op import Attr, OpDef
from .dequantize import dequantize
from .grouped_matmul import grouped_matmul

_OP = "weight_quant_grouped_matmul"


def _infer(a, x, weight, scale, group_list):
    m, k = dims(_OP, "x", x, 2)
    e, _, n = dims(_OP, "weight", weight, 3)
    if known(e) and e < 1:
        raise ValueError(f"{_OP}: 'weight' must hold at least one expert, got shape {list(weight)}")
    check_shape(_OP, "weight", weight, [e, k, n], "[E, K, N] with K = x.shape[1]")
    check_shape(_OP, "scale", scale, [e, n], "[E, N]: one step per expert and output channel")
    check_shape(_OP, "group_list", group_list, [e], "[E]: rows per expert")
    return ([m, n],)


def _infer_dtype(a, x, weight, scale, group_list):
    check_dtype(_OP, "x", x, ("float32",))
    check_dtype(_OP, "weight", weight, ("int8",))
    check_dtype(_OP, "scale", scale, ("float32",))
    check_dtype(_OP, "group_list", group_list, ("int64",))
    return ("float32",)


def _every_expert(weight):
    return ops.arange(weight.shape[0], dtype=ms.int32)


def _composed(a):
    def f(x, weight, scale, group_list):
        return grouped_matmul(x, dequantize(weight, scale, _every_expert(weight)), group_list,
                              padded=a["padded"])

    return f


def _bprop(a):
    def bprop(x, weight, scale, group_list, out, dout):
        p = a["padded"]
        w = dequantize(weight, scale, _every_expert(weight))
        dx = grouped_matmul(dout, w, group_list, transpose_weight=True, padded=p)
        # d scale[e, n] = sum over e's rows and k of dout[row, n] * x[row, k] * weight[e, k, n]
        dw = grouped_matmul(x, dout, group_list, transpose_x=True, padded=p)  # [E, K, N]
        dscale = (dw * weight.astype(ms.float32)).sum(1)
        return dx, ops.zeros_like(weight), dscale, ops.zeros_like(group_list)

    return bprop


WEIGHT_QUANT_GROUPED_MATMUL = OpDef(
    name=_OP,
    inputs=("x", "weight", "scale", "group_list"),
    outputs=("y",),
    infer=_infer,
    infer_dtype=_infer_dtype,
    impls=(kernel("WeightQuantGroupedMatmul"), composition(_composed)),
    attrs=(Attr("padded", bool, True),),
    bprop=_bprop,
)


def weight_quant_grouped_matmul(x, weight, scale, group_list, padded=True):
    """x float32 [M, K], weight int8 [E, K, N], scale float32 [E, N], group_list int64 [E] (rows
    per expert, expert 0's first) -> float32 [M, N]: y[rows of e] = (x[rows of e] @ weight[e]) *
    scale[e]. padded (as grouped_matmul's): the counts may add up to fewer than M rows, the rest
    zero rows; False: they must add up to M. Counts that do not fit raise RuntimeError.
    Differentiable in x and scale."""
    return WEIGHT_QUANT_GROUPED_MATMUL(x, weight, scale, group_list, padded=padded)
