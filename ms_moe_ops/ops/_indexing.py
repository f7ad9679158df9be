"""Index arithmetic of the compositions and Cells, from MindSpore operators every device runs in
both modes: counts, inverse permutations, sums at indices, rows at indices.

None of the scatters MindSpore 2.10 documents as deprecated (tensor_scatter_add, scatter_nd,
tensor_scatter_elements, whose reduction Ascend does not support and whose CPU kernel loses
concurrent updates), and no IndexAdd: it writes into its first input, and in a GRAPH-mode graph
MindSpore folds equal zero buffers into one constant, so two index adds into "fresh" zeros of one
shape came out added together. Counts and inverses come from sorts (exact integers); a sum at
indices is IndexAddExt on Ascend (aclnnIndexAdd, int64 indices, a new output) and a one-hot
product elsewhere (its CPU has no IndexAddExt kernel; CPU compositions run only without this
package's kernels, on small batches).
"""
import functools

import mindspore as ms
from mindspore import ops

from .. import _compat
from . import _platform

# the Gather primitive: ops.gather changes its parameter order and semantics after 2.9.0
_GATHER = ops.Gather()


def take_along(x, index, axis):
    """x's slices at index along axis (MindSpore's Gather)."""
    return _GATHER(x, index, axis)


def take_rows(x, index):
    """x[index] along the first axis (index int32/int64 of any shape)."""
    return _GATHER(x, index, 0)


# at most this many index x value pairs, count compares each index with each value (3 kernels);
# past it, it sorts (7 kernels, O(n log n) work and O(n) memory)
_ONE_HOT_COUNT = 1 << 14


def count(index, length):
    """int64 [length]: how often each value in [0, length) occurs in index (int, any shape, also
    empty; length may be known only at run time): for a few known sizes (a decoding step's) a
    one-hot sum, else the edges of each value in the sorted index, a sentinel (length, after
    every value) keeping the sort non-empty."""
    if (_compat.is_constant(index.size) and isinstance(length, int)
            and 0 < index.size * length <= _ONE_HOT_COUNT):
        hits = index.reshape(-1, 1).astype(ms.int32) == ops.arange(length, dtype=ms.int32)
        return hits.astype(ms.int64).sum(0)
    flat = ops.concat((index.reshape(-1).astype(ms.int32),
                       ops.full((1,), length, dtype=ms.int32)))
    ordered, _ = ops.sort(flat)
    edges = ops.searchsorted(ordered, ops.arange(length + 1, dtype=ms.int32))
    return (edges[1:] - edges[:-1]).astype(ms.int64)


def inverse_permutation(perm):
    """int32 inv with inv[perm[i]] = i, for a permutation perm of [0, n): its argsort."""
    _, inverse = ops.sort(perm.astype(ms.int32))
    return inverse.astype(ms.int32)


def inverse_index(index, rows):
    """For index [n] mapping output rows to distinct source rows in [0, rows) or to `rows`
    (padding): int64 [rows] mapping each source row back to the output row that read it, or to
    `rows` when none did."""
    _, order = ops.sort(index.astype(ms.int32))
    ordered = take_rows(index.astype(ms.int32), order)
    sources = ops.arange(rows, dtype=ms.int32)
    at = ops.minimum(ops.searchsorted(ordered, sources), index.shape[0] - 1)
    found = take_rows(ordered, at) == sources
    return ops.where(found, take_rows(order, at).astype(ms.int64),
                     ops.full((rows,), rows, dtype=ms.int64))


def stable_order(keys):
    """int32 [n]: the positions of keys [n] (int32, >= 0) in ascending order, equal keys in
    position order (a stable sort, from a sort of unique int64 keys)."""
    n = keys.shape[0]
    position = ops.cumsum(ops.ones_like(keys).astype(ms.int64), 0) - 1
    _, order = ops.sort(keys.astype(ms.int64) * n + position)
    return order.astype(ms.int32)


def _index_add_per_row(shape_like, index, values):
    n = shape_like.shape[-1]
    rows = ops.cumsum(ops.ones_like(index[:, :1]).astype(ms.int64), 0) - 1  # [M, 1]: 0, 1, ..
    # int64: rows * n + index passes 2^31 once M * N does (aclnnIndexAdd takes int64 indices)
    flat = (rows * n + index.astype(ms.int64)).reshape(-1)
    target = ops.zeros_like(shape_like).astype(ms.float32).reshape(-1)
    return _index_add()(target, 0, flat, values.reshape(-1), 1).reshape(shape_like.shape)


@functools.lru_cache(maxsize=None)
def _index_add():
    """IndexAddExt (aclnnIndexAdd: int64 indices), not mint.index_add, which on CPU picks the
    legacy IndexAdd (int32 indices only)."""
    return _compat.auto_generate("IndexAddExt")()


def _one_hot_per_row(shape_like, index, values):
    columns = ops.arange(shape_like.shape[-1], dtype=index.dtype).reshape(1, 1, -1)
    hits = (index.expand_dims(-1) == columns).astype(ms.float32)           # [M, K, N]
    return (values.expand_dims(-1) * hits).sum(1)


def _per_row_now():
    return _index_add_per_row if _platform.device_target() == "Ascend" else _one_hot_per_row


# chosen in Python while a graph is built (at every call in PyNative mode)
_per_row = _compat.run_at_compile_time(_per_row_now)


def add_per_row(shape_like, index, values):
    """float32 zeros of shape_like's shape [M, N] with values [M, K] added at columns
    index [M, K] of their row (duplicates in a row summed): out[i, index[i, p]] += values[i, p].
    IndexAddExt on Ascend; elsewhere a one-hot product ([M, K, N] floats)."""
    return _per_row()(shape_like, index, values.astype(ms.float32))
