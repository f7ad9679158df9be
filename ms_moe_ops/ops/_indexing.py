"""Index arithmetic of the compositions, from MindSpore operators every device runs in both modes.

No scatter with a reduction (Ascend's TensorScatterElements supports none) and none of the
scatters MindSpore 2.10 documents as deprecated (tensor_scatter_add, scatter_nd,
tensor_scatter_elements): sums at indices go through an index add, and a scatter to distinct
positions becomes a gather through the inverse permutation. The index add is MindSpore's
IndexAddExt on Ascend (mint.index_add: aclnnIndexAdd, a new output), and elsewhere the IndexAdd
primitive (the one with a CPU kernel; it writes its first input in place, and a zeros buffer of
a static shape may be folded into a constant of the graph, which a device must not write in
place; its functional form ops.index_add changes its signature after 2.9.0). Float sums at one index are of two terms at most in what the router produces
(distinct experts per row; a duplicated expert adds two terms, which commute exactly), so the
results do not depend on the device's accumulation order; counts are integers.
"""
import mindspore as ms
from mindspore import mint, ops

from .. import _compat
from . import _platform

_INDEX_ADD = ops.IndexAdd(axis=0)
# the Gather primitive: ops.gather changes its parameter order and semantics after 2.9.0
_GATHER = ops.Gather()


def take_rows(x, index):
    """x[index] along the first axis (index int32/int64 of any shape)."""
    return _GATHER(x, index, 0)


def _out_of_place(target, index, values):
    return mint.index_add(target, 0, index, values)


def _index_add_now():
    return _out_of_place if _platform.device_target() == "Ascend" else _INDEX_ADD


# chosen in Python while a graph is built (once per call in PyNative mode)
_index_add = _compat.run_at_compile_time(_index_add_now)


def add_at(target, index, values):
    """target (1-D or 2-D, zeros made for it) with values [n] (or [n, H]) added at rows index
    [n], duplicates summed. float16/float32/int32."""
    return _index_add()(target, index.astype(ms.int32), values)


def count(index, length):
    """int64 [length]: how often each value in [0, length) occurs in index (any shape, int32)."""
    flat = index.reshape(-1)
    ones = ops.ones_like(flat).astype(ms.int32)
    return add_at(ops.zeros((length,), dtype=ms.int32), flat, ones).astype(ms.int64)


def add_per_row(shape_like, index, values):
    """float32 zeros of shape_like's shape [M, N] with values [M, K] added at columns
    index [M, K] of their row (duplicates in a row summed): out[i, index[i, p]] += values[i, p]."""
    n = shape_like.shape[-1]
    rows = ops.cumsum(ops.ones_like(index[:, :1]), 0) - 1               # [M, 1]: 0, 1, ..
    flat = (rows * n + index).reshape(-1)
    target = ops.zeros_like(shape_like).astype(ms.float32).reshape(-1)
    return add_at(target, flat, values.astype(ms.float32).reshape(-1)).reshape(shape_like.shape)


def inverse_permutation(perm):
    """int32 inv with inv[perm[i]] = i, for a permutation perm of [0, n)."""
    position = ops.cumsum(ops.ones_like(perm).astype(ms.int32), 0) - 1
    return add_at(ops.zeros_like(perm).astype(ms.int32), perm, position)


def stable_order(keys):
    """int32 [n]: the positions of keys [n] (int32, >= 0) in ascending order, equal keys in
    position order (a stable sort, from a sort of unique int64 keys)."""
    n = keys.shape[0]
    position = ops.cumsum(ops.ones_like(keys).astype(ms.int64), 0) - 1
    _, order = ops.sort(keys.astype(ms.int64) * n + position)
    return order.astype(ms.int32)
