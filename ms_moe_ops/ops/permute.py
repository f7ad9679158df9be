"""Token permutation for the MoE layer (SPEC §5): moe_token_permute groups the (token, slot) pairs
by expert, moe_token_unpermute brings the expert outputs back and merges them per token.

`sorted_index[t * K + k]` is the row of the permuted tensor that holds slot k of token t (the
destination map, as returned by Ascend's moe_token_permute). Rows of one expert keep the token
order (a stable sort), so expert e owns rows [sum(counts[:e]), sum(counts[:e + 1])).

Implementations: the CPU kernels; on Atlas A2/A3 and Ascend 950 MindSpore's moe_token_permute /
moe_token_unpermute (top-k <= 512; CANN documents aclnnMoeTokenPermute/Unpermute on all three);
compositions of MindSpore ops everywhere else.
"""
import mindspore as ms
from mindspore import ops

from ._checks import FLOATS, check_dtype, check_shape, differ, dims, known, product, unknown_rank
from ._impls import builtin, composition, kernel
from ._indexing import count, inverse_permutation, stable_order, take_rows
from ._op import Attr, OpDef
from ._platform import A2, A3, ASCEND_950

BUILTIN_MAX_TOP_K = 512  # MindSpore's moe_token_permute / unpermute on Ascend


def _top_k_within(k):
    if k < 0:
        return False, "top-k is only known at run time"
    if k > BUILTIN_MAX_TOP_K:
        return False, f"top-k {k} > {BUILTIN_MAX_TOP_K}"
    return True, ""

_INT32_ROWS = 2 ** 31 - 1  # sorted_index is int32

# -- moe_token_permute -----------------------------------------------------------------------------

_PERMUTE = "moe_token_permute"


def _check_permute_attrs(a):
    if a["num_experts"] < 1:
        raise ValueError(f"{_PERMUTE}: attribute 'num_experts' must be >= 1, got {a['num_experts']}")


def _infer_permute(a, x, expert_idx):
    t, h = dims(_PERMUTE, "x", x, 2)
    rows, k = dims(_PERMUTE, "expert_idx", expert_idx, 2)
    if differ(rows, t):
        raise ValueError(f"{_PERMUTE}: 'expert_idx' must have T={t} rows like 'x', got shape "
                         f"{list(expert_idx)}")
    n = product(t, k)
    if n > _INT32_ROWS:
        raise ValueError(f"{_PERMUTE}: T*K must fit in int32 (sorted_index), got {n}")
    return [n, h], [n], [a["num_experts"]]


def _infer_permute_dtype(a, x, expert_idx):
    check_dtype(_PERMUTE, "x", x, FLOATS)
    check_dtype(_PERMUTE, "expert_idx", expert_idx, ("int32",))
    return x, "int32", "int64"


def _permute_bprop(a):
    def bprop(x, expert_idx, out, dout):
        _, sorted_index, _ = out
        d_permuted = dout[0]
        # x[t] went to K rows: its gradient is their sum, an unweighted unpermute
        dx = UNPERMUTE(d_permuted, sorted_index, None, top_k=expert_idx.shape[1])
        return dx, ops.zeros_like(expert_idx)

    return bprop


def _permute_builtin(a):
    num_experts = a["num_experts"]

    def permute(x, expert_idx):
        permuted, sorted_index = ops.moe_token_permute(x, expert_idx)
        return permuted, sorted_index, count(expert_idx, num_experts)

    return permute


def _permute_composed(a):
    """The stable sort of the (token, slot) pairs by expert from MindSpore ops: O(T*K) memory,
    O(T*K log T*K) work (a sort, no [T*K, E] one-hot)."""
    num_experts = a["num_experts"]

    def permute(x, expert_idx):
        k = expert_idx.shape[1]
        source = stable_order(expert_idx.reshape(-1))                          # row -> pair
        # float32 rows: exact, and MindSpore's CPU Gather has no bfloat16 kernel
        permuted = take_rows(x.astype(ms.float32), source // k).astype(x.dtype)
        return permuted, inverse_permutation(source), count(expert_idx, num_experts)

    return permute


PERMUTE = OpDef(
    name=_PERMUTE,
    inputs=("x", "expert_idx"),
    outputs=("permuted", "sorted_index", "counts"),
    attrs=(Attr("num_experts", int, 1),),
    check_attrs=_check_permute_attrs,
    infer=_infer_permute,
    infer_dtype=_infer_permute_dtype,
    impls=(
        kernel("MoeTokenPermute"),
        builtin(_permute_builtin, socs=(A2, A3, ASCEND_950),
                primitive="moe_token_permute", kernel="aclnnMoeTokenPermute",
                supports=lambda a, args, soc: _top_k_within(args["expert_idx"].shape[-1])),
        composition(_permute_composed),
    ),
    bprop=_permute_bprop,
)


def moe_token_permute(x, expert_idx, num_experts):
    """Groups the rows of x by expert: a stable counting sort of the T*K (token, slot) pairs.

    Args:
        x: [T, H] float32/float16/bfloat16 tokens.
        expert_idx: [T, K] int32, the experts of each token (e.g. from moe_gating_top_k). An index
            outside [0, num_experts) is a RuntimeError raised before anything is written.
        num_experts: E, the number of experts.

    Returns:
        (permuted [T*K, H] dtype of x, sorted_index [T*K] int32, counts [E] int64):
        `permuted[sorted_index[t*K + k]] == x[t]` (bitwise), rows grouped by expert in ascending
        order and, within an expert, in token order; `counts[e]` rows for expert e (0 allowed).
        Differentiable with respect to x (the gradient sums the K rows of each token).
    """
    return PERMUTE(x, expert_idx, num_experts=num_experts)


# -- moe_token_unpermute ------------------------------------------------------------------------

_UNPERMUTE = "moe_token_unpermute"
_UNPERMUTE_BWD = "moe_token_unpermute_backward"


def _check_top_k(op):
    def check(a):
        if a["top_k"] < 0:
            raise ValueError(f"{op}: attribute 'top_k' must be >= 0 (0: probs.shape[1], or 1 "
                             f"without probs), got {a['top_k']}")

    return check


def _unpermute_shapes(op, a, permuted, sorted_index, probs):
    """(T, K, H) after validating the unpermute inputs."""
    if a["with_probs"] != (probs is not None):
        given = "None" if probs is None else "a tensor"
        raise ValueError(f"{op}: attribute 'with_probs' must say whether 'probs' is given, got "
                         f"with_probs={a['with_probs']} and probs={given}")
    n, h = dims(op, "permuted", permuted, 2)
    check_shape(op, "sorted_index", sorted_index, [n], "one entry per permuted row")
    if probs is not None:
        t, k = dims(op, "probs", probs, 2)
        if differ(product(t, k), n):
            raise ValueError(f"{op}: 'probs' [T, K] must have T*K = {n} (the permuted rows), got "
                             f"shape {list(probs)}")
        if known(k) and a["top_k"] not in (0, k):
            raise ValueError(f"{op}: attribute 'top_k' must be 0 or probs.shape[1]={k}, got "
                             f"{a['top_k']}")
        if not known(t) and known(k) and k > 0 and known(n):  # T from the T*K rows (as in C++)
            t = n // k
        return t, k, h
    k = a["top_k"] or 1
    if known(n) and n % k:
        raise ValueError(f"{op}: the permuted rows ({n}) must be a multiple of attribute "
                         f"'top_k', got top_k={k}")
    return (n // k if known(n) else -1), k, h


def _unpermute_dtypes(op, permuted, sorted_index, probs):
    check_dtype(op, "permuted", permuted, FLOATS)
    check_dtype(op, "sorted_index", sorted_index, ("int32",))
    if probs is not None:
        check_dtype(op, "probs", probs, tuple(dict.fromkeys(("float32", permuted))))


def _infer_unpermute(a, permuted, sorted_index, probs):
    t, _, h = _unpermute_shapes(_UNPERMUTE, a, permuted, sorted_index, probs)
    return ([t, h],)


def _infer_unpermute_dtype(a, permuted, sorted_index, probs):
    _unpermute_dtypes(_UNPERMUTE, permuted, sorted_index, probs)
    return (permuted,)


def _unpermute_bprop(a):
    def bprop(permuted, sorted_index, probs, out, dout):
        d_permuted, d_probs = UNPERMUTE_BACKWARD(permuted, sorted_index, probs, dout,
                                                 top_k=a["top_k"], with_probs=a["with_probs"])
        return d_permuted, ops.zeros_like(sorted_index), (None if probs is None else d_probs)

    return bprop


def _unpermute_composed(a):
    top_k = a["top_k"]

    def unpermute(permuted, sorted_index, probs):
        k = probs.shape[1] if probs is not None else (top_k or 1)
        rows = take_rows(permuted.astype(ms.float32), sorted_index)
        rows = rows.reshape(permuted.shape[0] // k, k, permuted.shape[1])  # H may be 0
        if probs is not None:
            rows = rows * probs.astype(ms.float32).expand_dims(-1)
        return rows.sum(1).astype(permuted.dtype)

    return unpermute


def _unpermute_top_k(a, args):
    probs = args["probs"]
    return probs.shape[-1] if probs is not None else (a["top_k"] or 1)


def _unpermute_builtin(a):
    top_k = a["top_k"]

    def unpermute(permuted, sorted_index, probs):
        if probs is None and top_k > 1:
            # Ascend takes K from probs; unit weights give the plain sum over the K slots
            probs = ops.ones((permuted.shape[0] // top_k, top_k), dtype=permuted.dtype)
        if probs is not None:
            probs = probs.astype(permuted.dtype)
        return ops.moe_token_unpermute(permuted, sorted_index, probs)

    return unpermute


UNPERMUTE = OpDef(
    name=_UNPERMUTE,
    inputs=("permuted", "sorted_index", "probs"),
    optional=("probs",),
    outputs=("out",),
    attrs=(Attr("top_k", int, 0), Attr("with_probs", bool, False)),
    check_attrs=_check_top_k(_UNPERMUTE),
    infer=_infer_unpermute,
    infer_dtype=_infer_unpermute_dtype,
    impls=(
        kernel("MoeTokenUnpermute"),
        builtin(_unpermute_builtin, socs=(A2, A3, ASCEND_950),
                primitive="moe_token_unpermute", kernel="aclnnMoeTokenUnpermute",
                supports=lambda a, args, soc: _top_k_within(_unpermute_top_k(a, args))),
        composition(_unpermute_composed),
    ),
    bprop=_unpermute_bprop,
)


def moe_token_unpermute(permuted, sorted_index, probs=None, top_k=0):
    """Merges the expert rows back per token: out[t] = sum_k probs[t,k] * permuted[sorted_index[t*K+k]].

    Args:
        permuted: [T*K, H] float32/float16/bfloat16 (e.g. expert outputs in moe_token_permute's
            order).
        sorted_index: [T*K] int32 from moe_token_permute; it must be a permutation of
            [0, T*K) (anything else is a RuntimeError raised before anything is written).
        probs: [T, K] float32 or dtype of permuted, the weights; None means weight 1.
        top_k: K when probs is None (default 1, as on Ascend); 0 or probs.shape[1] otherwise.

    Returns:
        [T, H] dtype of permuted, summed in float32. Differentiable with respect to permuted and
        probs.
    """
    return UNPERMUTE(permuted, sorted_index, probs, top_k=top_k, with_probs=probs is not None)


def _infer_unpermute_backward(a, permuted, sorted_index, probs, grad_out):
    t, k, h = _unpermute_shapes(_UNPERMUTE_BWD, a, permuted, sorted_index, probs)
    check_shape(_UNPERMUTE_BWD, "grad_out", grad_out, [t, h], "the forward's output shape")
    if not known(t) and not unknown_rank(grad_out):  # T from grad_out's rows then (as in C++)
        t = dims(_UNPERMUTE_BWD, "grad_out", grad_out, 2)[0]
    return list(permuted), [t, k]


def _infer_unpermute_backward_dtype(a, permuted, sorted_index, probs, grad_out):
    _unpermute_dtypes(_UNPERMUTE_BWD, permuted, sorted_index, probs)
    check_dtype(_UNPERMUTE_BWD, "grad_out", grad_out, (permuted,))
    return permuted, (probs or "float32")


def _unpermute_backward_composed(a):
    """The gradients from MindSpore ops (MindSpore's own unpermute gradient is undocumented)."""
    top_k = a["top_k"]

    def backward(permuted, sorted_index, probs, grad_out):
        t, h = grad_out.shape
        k = probs.shape[1] if probs is not None else (top_k or 1)
        rows = ops.broadcast_to(grad_out.reshape(t, 1, h), (t, k, h)).astype(ms.float32)
        if probs is not None:
            rows = rows * probs.astype(ms.float32).reshape(t, k, 1)
        # row sorted_index[j] of d_permuted is (token, slot) j's
        d_permuted = take_rows(rows.reshape(t * k, h), inverse_permutation(sorted_index))
        if probs is None:
            return d_permuted.astype(permuted.dtype), ops.zeros((t, k), dtype=ms.float32)
        if h == 0:  # the empty sum: MindSpore's ReduceSum skips an empty input (output unset)
            return d_permuted.astype(permuted.dtype), ops.zeros((t, k), dtype=probs.dtype)
        mine = take_rows(permuted.astype(ms.float32), sorted_index).reshape(t, k, h)
        d_probs = (mine * grad_out.astype(ms.float32).reshape(t, 1, h)).sum(axis=-1)
        return d_permuted.astype(permuted.dtype), d_probs.astype(probs.dtype)

    return backward


UNPERMUTE_BACKWARD = OpDef(
    name=_UNPERMUTE_BWD,
    inputs=("permuted", "sorted_index", "probs", "grad_out"),
    optional=("probs",),
    outputs=("grad_permuted", "grad_probs"),
    attrs=(Attr("top_k", int, 0), Attr("with_probs", bool, False)),
    check_attrs=_check_top_k(_UNPERMUTE_BWD),
    infer=_infer_unpermute_backward,
    infer_dtype=_infer_unpermute_backward_dtype,
    impls=(kernel("MoeTokenUnpermuteBackward"), composition(_unpermute_backward_composed)),
)


def moe_token_unpermute_backward(permuted, sorted_index, probs, grad_out, top_k=0):
    """Gradients of moe_token_unpermute: (grad_permuted [T*K, H] dtype of permuted, grad_probs
    [T, K] dtype of probs (float32 zeros without probs)). grad_permuted[sorted_index[t*K+k]] =
    probs[t,k] * grad_out[t]; grad_probs[t,k] = <permuted[sorted_index[t*K+k]], grad_out[t]>."""
    return UNPERMUTE_BACKWARD(permuted, sorted_index, probs, grad_out, top_k=top_k,
                              with_probs=probs is not None)
