"""The attention compositions the models and the decode_attention operator share: the rotary
embedding of a chunk of positions, a cache write at a slot, and grouped-query attention over
keys and values read as they are."""
import functools

import numpy as np
import mindspore as ms
from mindspore import Tensor, ops

from ._indexing import take_along


def rotate(x, cos, sin, interleave=False):
    """The rotary embedding on the last axis of x [..., S, d] (cos and sin [S, d], or
    [B, 1, S, d] for positions of each sequence): halves paired (rotate_half), or neighbouring
    dims paired (interleave; the rotated pairs come out as [evens | odds], as in transformers'
    DeepSeek-V3, which leaves every query-key product unchanged)."""
    d = x.shape[-1]
    if interleave:
        if x.shape[-2] == 1:  # one position: [evens | odds] and [odds | evens] by two gathers
            return (take_along(x, _split_pairs(d, 0), x.ndim - 1) * cos
                    + take_along(x, _split_pairs(d, 1), x.ndim - 1) * (sin * _half_signs(d)))
        half = cos.shape[-1] // 2
        cos, sin = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return ops.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    half = d // 2
    if x.shape[-2] == 1:  # one position (a decoding step): the halves swapped by one gather
        return x * cos + take_along(x, _swapped_halves(d), x.ndim - 1) * (sin * _half_signs(d))
    rotated = ops.cat((-x[..., half:], x[..., :half]), -1)
    return x * cos + rotated * sin


@functools.lru_cache(maxsize=None)  # one constant per size, not one per call
def _swapped_halves(d):
    """int32 [d]: the indices d/2 .. d-1, 0 .. d/2-1."""
    return Tensor(np.concatenate([np.arange(d // 2, d), np.arange(d // 2)]).astype(np.int32))


@functools.lru_cache(maxsize=None)  # one constant per size, not one per call
def _split_pairs(d, first):
    """int32 [d]: the indices of the even dims then the odd ones (first=0), or odd then even."""
    order = np.concatenate([np.arange(first, d, 2), np.arange(1 - first, d, 2)])
    return Tensor(order.astype(np.int32))


@functools.lru_cache(maxsize=None)  # one constant per size, not one per call
def _half_signs(d):
    """float32 [d]: -1 on the first half, +1 on the second; with _swapped_halves, rotate_half's
    (-x2, x1) as x[swapped] * signs (the same values: a sign flip is exact), in 3 kernels, not 5."""
    return Tensor(np.concatenate([-np.ones(d // 2), np.ones(d - d // 2)]).astype(np.float32))


def swap_halves(x):
    """x's last axis with its halves swapped (an even size)."""
    return take_along(x, _swapped_halves(x.shape[-1]), x.ndim - 1)


def half_signs(d):
    """float32 [d]: -1 on the first half, +1 on the second (rotate_half(x) = swap_halves(x) *
    half_signs)."""
    return _half_signs(d)


def write_cache(buffer, new, slot):
    """buffer [B, h, L, d] with new [B, h, S, d] written at slots slot .. slot + S - 1 (slot a
    scalar int Tensor, so one compiled graph serves every slot); exact. One new position (a
    decoding step) is a scatter of its B x h rows: a select over the whole cache reads and
    writes it three times over, 2.5x slower. bfloat16 (which the CPU's scatter and select
    lack) is written in float32."""
    if buffer.dtype == ms.bfloat16:  # (exact: every bfloat16 is a float32)
        return write_cache(buffer.astype(ms.float32), new.astype(ms.float32), slot).astype(
            ms.bfloat16)
    b, h, length = buffer.shape[0], buffer.shape[1], buffer.shape[2]
    s = new.shape[2]
    if s == 1:
        shape = (b, h, 1, 1)  # index (batch, head, slot) of each new row
        index = ops.cat((ops.broadcast_to(ops.arange(b, dtype=ms.int32).reshape(b, 1, 1, 1), shape),
                         ops.broadcast_to(ops.arange(h, dtype=ms.int32).reshape(1, h, 1, 1), shape),
                         ops.broadcast_to(slot.astype(ms.int32).reshape(1, 1, 1, 1), shape)), -1)
        return ops.tensor_scatter_update(buffer, index, new)
    # one-hot placement [L, S]: each filled slot takes exactly one new row (x * 1 + 0s)
    place = (ops.arange(length).reshape(-1, 1) == slot + ops.arange(s).reshape(1, -1))
    placed = ops.matmul(place.astype(new.dtype), new)
    filled = place.any(1).reshape(1, 1, length, 1)
    return ops.where(filled, placed, buffer)


# q k^T without transposing k: a transpose of the keys copies the whole cache at every
# decoding step (3.5 ms against 0.8 ms with [8, 4, 1024, 64] keys on the CPU)
SCORES = ops.BatchMatMul(transpose_b=True)


def attend(q, k, v, mask, scaling):
    """softmax(q k^T * scaling + mask) v over q [B, heads, S, d], mask [S, L], [B, 1, S, L] or
    [B, heads, S, L]. k and v [B, kv_heads, L, d] may have fewer heads (grouped-query
    attention: each serves heads / kv_heads consecutive query heads). They are read as they
    are: a key head's query heads are stacked as the rows of one product (copying the keys and
    values per query head would copy the whole cache at every decoding step)."""
    b, heads, s, d = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    if groups > 1:
        q = q.reshape(b, kv_heads, groups * s, d)
    scores = SCORES(q, k) * scaling
    if groups > 1:  # each query head's rows take the mask of its positions
        length = scores.shape[-1]
        if mask.ndim == 4:  # [B, 1 or heads, S, L] -> [B, 1 or kv_heads, 1 or groups, S, L]
            mask = (mask.expand_dims(2) if mask.shape[1] == 1 else
                    mask.reshape(mask.shape[0], kv_heads, groups, s, mask.shape[-1]))
        scores = scores.reshape(b, kv_heads, groups, s, length) + mask
        scores = scores.reshape(b, kv_heads, groups * s, length)
    else:
        scores = scores + mask
    if scores.dtype == ms.float32 and v.dtype == ms.float32:
        out = ops.matmul(ops.softmax(scores, -1), v)
    else:
        out = ops.matmul(ops.softmax(scores.astype(ms.float32), -1).astype(v.dtype), v)
    return out.reshape(b, heads, s, v.shape[-1]) if groups > 1 else out
