"""decode_attention: one new position of grouped-query attention over a KV cache, in float32: the
rotary embedding (halves paired, as Qwen3-MoE, Qwen2-MoE and Mixtral pair them) of the query
and the key, the key and the value written at the cache slot, then
`softmax(q k^T * scaling + mask) v` over every cached position. The attention of a decoding step
of the models' GQAttention (ms_moe_ops.models.layers).

Implementations: the CPU kernel; MindSpore ops everywhere else (on Ascend too: the fused
attention kernels there, aclnnIncreFlashAttention and aclnnFusedInferAttentionScore, neither
rotate nor write the cache). As MindSpore ops it is 15 kernels a layer, each launch costing the
CPU runtime about 10 microseconds on top of its work; the kernel is one.
"""
import mindspore as ms
from mindspore import ops

from ._attention import SCORES, attend, half_signs, rotate, swap_halves, write_cache
from ._checks import attr_error, check_dtype, check_shape, unknown_rank
from ._impls import composition, kernel
from ._op import Attr, OpDef

_OP = "decode_attention"
_INPUTS = ("query", "key", "value", "cos", "sin", "key_cache", "value_cache", "mask", "slot")


def _check_attrs(a):
    if not abs(a["scaling"]) < float("inf"):
        raise attr_error(_OP, "scaling", "finite", a["scaling"])


def _infer(a, query, key, value, cos, sin, key_cache, value_cache, mask, slot):
    if not (unknown_rank(query) or unknown_rank(key_cache)):
        if len(query) != 4 or query[2] not in (1, -1):
            raise ValueError(f"{_OP}: 'query' must be [B, heads, 1, D] (one position), got "
                             f"{list(query)}")
        check_shape(_OP, "key_cache", key_cache, [query[0], -1, -1, query[3]],
                    "[B, kv_heads, L, D]: query's B and D")
        kv_heads, length, d = key_cache[1:]
        heads = query[1]
        if heads >= 0 and kv_heads >= 0 and (kv_heads == 0 or heads % kv_heads):
            raise ValueError(f"{_OP}: the query heads ({heads}) must be a multiple of the key "
                             f"heads ({kv_heads})")
        if d >= 0 and d % 2:
            raise ValueError(f"{_OP}: the head size must be even (rotary halves), got {d}")
        b = query[0]
        for name, shape, want in (("key", key, [b, kv_heads, 1, d]),
                                  ("value", value, [b, kv_heads, 1, d]),
                                  ("cos", cos, [b, 1, 1, d]), ("sin", sin, [b, 1, 1, d]),
                                  ("value_cache", value_cache, [b, kv_heads, length, d]),
                                  ("mask", mask, [b, 1, 1, length])):
            check_shape(_OP, name, shape, want, "")
        check_shape(_OP, "slot", slot, [], "a scalar")
    return list(query), list(key_cache), list(value_cache)


def _infer_dtype(a, *dtypes):
    for name, dtype in zip(_INPUTS, dtypes):
        check_dtype(_OP, name, dtype, ("int32",) if name == "slot" else ("float32",))
    return ("float32",) * 3


def _attention(scaling, q, k, v, cos, sin, key_cache, value_cache, mask, slot):
    key_cache = write_cache(key_cache, rotate(k, cos, sin), slot)
    value_cache = write_cache(value_cache, v, slot)
    return attend(rotate(q, cos, sin), key_cache, value_cache, mask, scaling), key_cache, value_cache


def _composed(a):
    scaling = a["scaling"]

    def f(*inputs):
        return _attention(scaling, *inputs)

    return f


def _unrotate(dr, cos, sin):
    """The gradient of x from that of rotate(x, cos, sin) = x cos + swap_halves(x) signs sin
    (swap_halves is its own inverse): dr cos + swap_halves(dr signs sin)."""
    return dr * cos + swap_halves(dr * (sin * half_signs(dr.shape[-1])))


def _d_sin(x, dr):
    """sin's gradient (summed over the heads) from that of rotate(x, cos, sin)."""
    return (swap_halves(x) * half_signs(x.shape[-1]) * dr).sum(1, keepdims=True)


def _bprop(a):
    scaling = a["scaling"]

    def bprop(q, k, v, cos, sin, key_cache, value_cache, mask, slot, out, dout):
        d_out, d_keys, d_values = dout
        b, heads, _, d = q.shape
        kv_heads, length = key_cache.shape[1], key_cache.shape[2]
        groups = heads // kv_heads
        q_rot, k_rot = rotate(q, cos, sin), rotate(k, cos, sin)
        keys, values = write_cache(key_cache, k_rot, slot), write_cache(value_cache, v, slot)
        rows = q_rot.reshape(b, kv_heads, groups, d)
        scores = SCORES(rows, keys) * scaling + mask
        probs = ops.softmax(scores, -1)  # [B, kv_heads, groups, L]
        d_rows = d_out.reshape(b, kv_heads, groups, d)
        d_values = d_values + ops.matmul(probs.swapaxes(-1, -2), d_rows)
        d_probs = SCORES(d_rows, values)
        d_scores = probs * (d_probs - (d_probs * probs).sum(-1, keepdims=True))
        d_mask = d_scores.sum((1, 2), keepdims=True).reshape(b, 1, 1, length)
        d_scores = d_scores * scaling
        d_q_rot = ops.matmul(d_scores, keys).reshape(b, heads, 1, d)
        d_keys = d_keys + ops.matmul(d_scores.swapaxes(-1, -2), rows)
        # the slot's rows came from k and v; the others from the caches
        at = (ops.arange(length, dtype=ms.int32) == slot).astype(ms.float32).reshape(1, 1, -1, 1)
        d_k_rot = (d_keys * at).sum(2, keepdims=True)
        d_v = (d_values * at).sum(2, keepdims=True)
        d_cos = ((d_q_rot * q).sum(1, keepdims=True) + (d_k_rot * k).sum(1, keepdims=True))
        d_sin = _d_sin(q, d_q_rot) + _d_sin(k, d_k_rot)
        return (_unrotate(d_q_rot, cos, sin), _unrotate(d_k_rot, cos, sin), d_v, d_cos, d_sin,
                d_keys * (1 - at), d_values * (1 - at), d_mask, ops.zeros_like(slot))

    return bprop


DECODE_ATTENTION = OpDef(
    name=_OP,
    inputs=_INPUTS,
    outputs=("out", "key_cache_out", "value_cache_out"),
    attrs=(Attr("scaling", float, 1.0),),
    check_attrs=_check_attrs,
    infer=_infer,
    infer_dtype=_infer_dtype,
    impls=(kernel("DecodeAttention"), composition(_composed)),
    bprop=_bprop,
)


def decode_attention(query, key, value, cos, sin, key_cache, value_cache, mask, slot,
                     scaling=1.0):
    """One new position of grouped-query attention over a KV cache, float32:

    query [B, N, 1, D], key and value [B, Nkv, 1, D] (N a multiple of Nkv, D even), cos and sin
    [B, 1, 1, D] (each sequence's rotary position), key_cache and value_cache [B, Nkv, L, D],
    mask [B, 1, 1, L] (added to the scores: 0 where a position may be attended, a large
    negative number elsewhere), slot an int32 scalar in [0, L) ->
    (out [B, N, 1, D], key_cache_out, value_cache_out): the caches with the rotated key and the
    value written at `slot`, and `softmax(rotate(q) k^T * scaling + mask) v` over them, each key
    head serving N / Nkv consecutive query heads. rotate: `x * cos + rotate_half(x) * sin`.
    Differentiable in every float input."""
    return DECODE_ATTENTION(query, key, value, cos, sin, key_cache, value_cache, mask, slot,
                            scaling=scaling)
