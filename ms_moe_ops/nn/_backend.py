"""Operations of the Cells written around limits of MindSpore's backend (CPU, 2.10)."""
import mindspore as ms
from mindspore import ops

from .. import ops as moe_ops
from ._precision import SelfCastingCell

def rows_of(x):
    """int64 [1] holding x's row count: the one group of a grouped_matmul over all of x."""
    return ops.full((1,), x.shape[0], dtype=ms.int64)


def reshape(x, shape):
    """x.reshape(shape); bfloat16 through float32 (exact), as MindSpore's CPU backend has no
    bfloat16 Reshape in GRAPH mode."""
    if x.dtype == ms.bfloat16:
        return moe_ops.cast(moe_ops.cast(x, ms.float32).reshape(shape), ms.bfloat16)
    return x.reshape(shape)


def project(x, weight):
    """x [T, H] @ weight[O, H].T -> [T, O] as one group of grouped_matmul: MindSpore's MatMul
    backward refuses zero tokens in a dynamic-shape graph, this package's kernels take them; the
    weight is read where it is (a reshape of a parameter is a copy on every call in a graph)."""
    return moe_ops.grouped_matmul(x, weight, rows_of(x), transpose_weight=True)


class Fork(SelfCastingCell):
    """construct(x) -> (x, x, ...) n times; the n gradients add up in this order, ((d0 + d1) + d2)
    + ...: GRAPH mode sums the gradients of a tensor's consumers in an order of its own, which
    differs between graphs of the same maths (the local and the expert-parallel layer)."""

    def __init__(self, n):
        super().__init__()
        self.n = n

    def construct(self, x):
        return (x,) * self.n

    def bprop(self, x, out, dout):
        total = dout[0]
        for d in dout[1:]:
            total = total + d
        return (total,)
