"""dequantize: the float32 weights of quantised experts, float(weight[index[g]]) * scale[index[g]]
per output channel, for the experts `index` names (ms_moe_ops.quantize's int8 experts, whose
weights are dequantised on every call: only those of the experts that have rows, when decoding).

Implementations: the CPU kernel; MindSpore ops everywhere else (a gather, a cast and a product).
On the CPU those took 1.4 ns per element, 8 of the 12 ms of a quantised model's decoding step
at hidden 1024; the kernel reads each int8 weight once.
"""
import mindspore as ms
from mindspore import ops

from ._checks import check_dtype, check_shape, dims
from ._impls import composition, kernel
from ._indexing import take_rows
from ._op import OpDef

_OP = "dequantize"


def _infer(a, weight, scale, index):
    e, k, n = dims(_OP, "weight", weight, 3)
    check_shape(_OP, "scale", scale, [e, n], "[E, N]: one step per expert and output channel")
    (g,) = dims(_OP, "index", index, 1)
    return ([g, k, n],)


def _infer_dtype(a, weight, scale, index):
    check_dtype(_OP, "weight", weight, ("int8",))
    check_dtype(_OP, "scale", scale, ("float32",))
    check_dtype(_OP, "index", index, ("int32",))
    return ("float32",)


def _composed(a):
    def f(weight, scale, index):
        w, s = take_rows(weight, index), take_rows(scale, index)
        g, k, n = w.shape
        # (the step tiled to the weight's shape: MindSpore's CPU Mul broadcasting [G, 1, N] runs
        # at a third of its speed on equal shapes)
        return w.astype(ms.float32) * ops.tile(s.reshape(g, 1, n), (1, k, 1))

    return f


def _bprop(a):
    def bprop(weight, scale, index, out, dout):
        # d scale[e, n] = the sum over k of dout * weight, over every g with index[g] = e
        per_row = (dout * take_rows(weight, index).astype(ms.float32)).sum(1)  # [G, N]
        hits = index.reshape(-1, 1) == ops.arange(scale.shape[0], dtype=index.dtype).reshape(1, -1)
        dscale = ops.matmul(hits.astype(ms.float32).swapaxes(0, 1), per_row)
        return ops.zeros_like(weight), dscale, ops.zeros_like(index)

    return bprop


DEQUANTIZE = OpDef(
    name=_OP,
    inputs=("weight", "scale", "index"),
    outputs=("y",),
    infer=_infer,
    infer_dtype=_infer_dtype,
    impls=(kernel("Dequantize"), composition(_composed)),
    bprop=_bprop,
)


def dequantize(weight, scale, index):
    """weight int8 [E, K, N], scale float32 [E, N], index int32 [G] (expert numbers in [0, E))
    -> float32 [G, K, N]: y[g] = weight[index[g]] * scale[index[g]] (the step broadcast over K).
    Differentiable in scale."""
    return DEQUANTIZE(weight, scale, index)
