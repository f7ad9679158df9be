"""Two operations of the Cells written around limits of MindSpore's backend (CPU, 2.10)."""
import mindspore as ms
from mindspore import ops

from .. import ops as moe_ops


def reshape(x, shape):
    """x.reshape(shape); bfloat16 through float32 (exact), as MindSpore's CPU backend has no
    bfloat16 Reshape in GRAPH mode."""
    if x.dtype == ms.bfloat16:
        return x.astype(ms.float32).reshape(shape).astype(ms.bfloat16)
    return x.reshape(shape)


def project(x, weight):
    """x [T, H] @ weight[O, H].T -> [T, O] as one group of grouped_matmul: MindSpore's MatMul
    backward refuses zero tokens in a dynamic-shape graph, this package's kernels take them."""
    rows = ops.fill(ms.int64, (1,), x.shape[0])
    return moe_ops.grouped_matmul(x, weight.expand_dims(0), rows, transpose_weight=True)
