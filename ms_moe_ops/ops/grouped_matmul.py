"""grouped_matmul (SPEC §5): one matrix product per group of rows, with the transposed forms a
backward needs, so that grouped layers (MoeFFN) differentiate through it.

Implementations: the CPU kernel; on Ascend MindSpore's grouped matmul (GmmV2,
aclnnGroupedMatmul) with its own backward (GmmV2Backward); a composition of MindSpore matmuls
everywhere else.
"""
import mindspore as ms
from mindspore import ops

from .._compat import auto_generate
from ._checks import (FLOATS, check_dtype, check_rank, check_same_dtype, check_shape, differ,
                      dims, unknown_rank)
from ._impls import builtin, composition, kernel
from ._op import Attr, OpDef
from ._platform import A2, A3, ASCEND_950

_OP = "grouped_matmul"


def _check_attrs(a):
    if a["transpose_x"] and a["transpose_weight"]:
        raise ValueError(f"{_OP}: attributes 'transpose_x' and 'transpose_weight' cannot both be "
                         f"True, got transpose_x=True, transpose_weight=True")


def _infer(a, x, weight, group_list, bias):
    m, k = dims(_OP, "x", x, 2)
    g = dims(_OP, "group_list", group_list, 1)[0]
    if g == 0:
        raise ValueError(f"{_OP}: 'group_list' must hold at least one group, got shape {list(group_list)}")
    if a["transpose_x"]:
        # out[g] = x[rows g]^T @ weight[rows g]: weight is the second row-grouped operand
        weight = dims(_OP, "weight", weight, 2)
        if differ(weight[0], m):
            raise ValueError(f"{_OP}: with transpose_x, 'weight' must be [M, N] with the M={m} rows "
                             f"of 'x', got shape {list(weight)}")
        if bias is not None:
            raise ValueError(f"{_OP}: 'bias' is not supported with transpose_x, got shape {list(bias)}")
        return ([g, k, weight[1]],)
    check_rank(_OP, "weight", weight, (3, 2))
    if not unknown_rank(weight) and len(weight) == 2:  # one weight for every group
        n = weight[0] if a["transpose_weight"] else weight[1]
        expected, what = ([n, k], "[N, K] (transpose_weight)") if a["transpose_weight"] else \
            ([k, n], "[K, N]")
    else:
        weight = dims(_OP, "weight", weight, 3)
        n = weight[1] if a["transpose_weight"] else weight[2]
        expected, what = ([g, n, k], "[G, N, K] (transpose_weight)") if a["transpose_weight"] \
            else ([g, k, n], "[G, K, N]")
    check_shape(_OP, "weight", weight, expected, what)
    if bias is not None:
        check_shape(_OP, "bias", bias, [g, n], "[G, N]")
    return ([m, n],)


def _infer_dtype(a, x, weight, group_list, bias):
    check_dtype(_OP, "x", x, FLOATS)
    check_same_dtype(_OP, "weight", weight, "x", x)
    check_dtype(_OP, "group_list", group_list, ("int64",))
    if bias is not None:
        check_same_dtype(_OP, "bias", bias, "x", x)
    return (x,)


def group_sum(values, group_list, cumulative=False, padded=True):
    """Per-group sum of the rows of values [M, N] -> [G, N] (a product with a column of ones)."""
    ones = ops.ones((values.shape[0], 1), dtype=values.dtype)
    sums = grouped_matmul(ones, values, group_list, transpose_x=True, cumulative=cumulative,
                          padded=padded)
    shape = (sums.shape[0], sums.shape[2])
    if values.dtype == ms.bfloat16:  # GRAPH mode has no bfloat16 Reshape on CPU (exact casts)
        return sums.astype(ms.float32).reshape(shape).astype(ms.bfloat16)
    return sums.reshape(shape)


def _sum_groups(grads):
    """[G, ...] -> [...], the gradient of a weight every group shares (bfloat16 summed in
    float32: MindSpore's CPU backend has no bfloat16 ReduceSum in GRAPH mode)."""
    if grads.dtype == ms.bfloat16:
        return grads.astype(ms.float32).sum(0).astype(ms.bfloat16)
    return grads.sum(0)


def _bprop(a):
    c, p = a["cumulative"], a["padded"]

    def bprop(x, weight, groups, bias, out, dout):
        if a["transpose_x"]:  # out[g] = x_g^T @ b_g
            dx = grouped_matmul(weight, dout, groups, transpose_weight=True, cumulative=c, padded=p)
            dweight = grouped_matmul(x, dout, groups, cumulative=c, padded=p)
            return dx, dweight, ops.zeros_like(groups), None
        if a["transpose_weight"]:  # out_g = x_g @ w[g]^T
            dx = grouped_matmul(dout, weight, groups, cumulative=c, padded=p)
            dweight = grouped_matmul(dout, x, groups, transpose_x=True, cumulative=c, padded=p)
        else:  # out_g = x_g @ w[g]
            dx = grouped_matmul(dout, weight, groups, transpose_weight=True, cumulative=c, padded=p)
            dweight = grouped_matmul(x, dout, groups, transpose_x=True, cumulative=c, padded=p)
        if weight.ndim == 2:  # every group's weight: the sum of the groups' gradients
            dweight = _sum_groups(dweight)
        dbias = None if bias is None else group_sum(dout, groups, c, p)
        return dx, dweight, ops.zeros_like(groups), dbias

    return bprop


def _group_members(group_list, rows, cumulative):
    """[rows, G] bool: where a row belongs to a group (rows past the last group: none)."""
    ends = group_list if cumulative else ops.cumsum(group_list, 0)
    row = ops.arange(rows, dtype=ms.int64).reshape(-1, 1)
    owner = (row >= ends.reshape(1, -1)).astype(ms.int32).sum(1)
    groups = ops.arange(group_list.shape[0], dtype=ms.int32).reshape(1, -1)
    return owner.reshape(-1, 1) == groups


def _composed(a):
    """One masked product per group, in float32: memory of one [M, N] product at a time (never
    a [G, M, N] tensor), G times the flops of the grouped product (every group's product covers
    all M rows). Exact: each group takes its own rows' results, selected (not multiplied by a
    mask: a NaN in another group's rows or in the padding stays there). The last resort where
    neither a kernel nor a built-in runs (the resolver says so with a warning)."""
    transpose_x, transpose_weight, cumulative = a["transpose_x"], a["transpose_weight"], \
        a["cumulative"]
    matmul_op = ops.MatMul(transpose_a=transpose_x, transpose_b=transpose_weight)

    def matmul(lhs, rhs):
        # an empty sum is zeros: MindSpore's CPU MatMul leaves its output unset when the reduced
        # dimension is 0 (no rows with transpose_x, K = 0 otherwise)
        if lhs.shape[0 if transpose_x else 1] == 0:
            n = rhs.shape[0] if transpose_weight else rhs.shape[1]
            return ops.zeros((lhs.shape[1] if transpose_x else lhs.shape[0], n), dtype=lhs.dtype)
        return matmul_op(lhs, rhs)

    def f(x, weight, group_list, bias):
        member = _group_members(group_list, x.shape[0], cumulative)        # [M, G]
        xf = x.astype(ms.float32)
        wf = weight.astype(ms.float32)
        if transpose_x:  # out[g] = x_g^T @ weight_g: [G, K, N], both operands' rows of group g
            zero = ops.zeros((), dtype=ms.float32)
            return ops.stack([matmul(ops.where(member[:, g:g + 1], xf, zero),
                                     ops.where(member[:, g:g + 1], wf, zero))
                              for g in range(group_list.shape[0])]).astype(x.dtype)
        y = ops.zeros((x.shape[0], wf.shape[-2] if transpose_weight else wf.shape[-1]),
                      dtype=ms.float32)
        for g in range(group_list.shape[0]):
            y = ops.where(member[:, g:g + 1], matmul(xf, wf if wf.ndim == 2 else wf[g]), y)
        if bias is not None:
            y = y + ops.matmul(member.astype(ms.float32), bias.astype(ms.float32))
        return y.astype(x.dtype)

    return f


def cover_every_row(group_list, rows, cumulative):
    """(group list whose last group ends at the last row, [rows, 1] mask of the rows the given
    groups cover). The Ascend kernels need the groups to cover every row; a padded batch's rows
    past the last group then go to the last group and are masked out."""
    ends = group_list if cumulative else ops.cumsum(group_list, 0)
    covered = ops.arange(rows, dtype=ms.int64) < ends[-1]
    last = ops.arange(group_list.shape[0], dtype=ms.int64) == group_list.shape[0] - 1
    return group_list + last.astype(ms.int64) * (rows - ends[-1]), covered.reshape(-1, 1)


def _builtin(a):
    """MindSpore's grouped matmul with a tensor group list (GmmV2: aclnnGroupedMatmulV4); it has
    no CPU kernel. Transposed operands go as views (TransposeExtView), never as copies: with
    transpose_x the reduced axis is grouped (group_type 2), where the kernel requires x to be a
    transposed, non-contiguous view (CANN's aclnnGroupedMatmulV4 document; MindSpore's own GMM
    backward passes it so); with transpose_weight the weights are read through a view rather than
    copied on every call. bfloat16 takes a float32 bias; rows past the last group (a padded
    batch) are masked, as the kernel needs every row in a group."""
    gmm_v2_op = auto_generate("gmm_v2_op")
    view = auto_generate("transpose_ext_view")
    cumulative, padded = a["cumulative"], a["padded"]
    list_type = 0 if cumulative else 1  # 0: cumulative ends, 1: counts
    transpose_x, transpose_weight = a["transpose_x"], a["transpose_weight"]

    def f(x, weight, group_list, bias):
        covered = None
        if padded:
            group_list, covered = cover_every_row(group_list, x.shape[0], cumulative)
        if transpose_x:
            if padded:  # (a product: the padding rows the exchange makes are zeros)
                x = x * covered.astype(x.dtype)
            return gmm_v2_op([view(x, 0, 1)], [weight], None, group_list, 2, list_type)[0]
        if weight.ndim == 2:  # one group (_builtin_fits): its weight
            weight = weight.reshape((1,) + weight.shape)
        if transpose_weight:
            weight = view(weight, 1, 2)
        if bias is not None:
            bias = [bias.astype(ms.float32) if x.dtype == ms.bfloat16 else bias]
        y = gmm_v2_op([x], [weight], bias, group_list, 0, list_type)[0]
        return y if covered is None else y * covered.astype(y.dtype)

    return f


GMM_MAX_GROUPS, GMM_MAX_DIM = 1024, 65536  # aclnnGroupedMatmulV4: a tensor group list, storage dims


def _builtin_fits(a, args, soc):
    """aclnnGroupedMatmulV4's limits (CANN document): at most 1024 groups with a tensor group
    list, every tensor's last dimension in storage < 65536 (transposed operands go as views of
    the tensors given here, so their storage's last dimension is these tensors' last)."""
    groups = args["group_list"].shape[0]
    if len(args["weight"].shape) == 2 and not a["transpose_x"] and groups != 1:
        return False, f"a weight for every group takes one group here, got {groups}"
    if groups > GMM_MAX_GROUPS:
        return False, f"at most {GMM_MAX_GROUPS} groups, got {groups}"
    too_long = [d for d in (args["x"].shape[-1], args["weight"].shape[-1]) if d >= GMM_MAX_DIM]
    if too_long:
        return False, f"every stored last dimension must be < {GMM_MAX_DIM}, got {too_long[0]}"
    return True, ""


def _builtin_grad(a):
    """MindSpore's own grouped-matmul backward (GmmV2Backward) for the plain product; the
    transposed forms differentiate as declared (grouped matmuls again)."""
    if a["transpose_x"] or a["transpose_weight"]:
        return _bprop(a)
    gmm_v2_backward_op = auto_generate("gmm_v2_backward_op")
    c = a["cumulative"]
    list_type = 0 if c else 1

    def bprop(x, weight, groups, bias, out, dout):
        every_row, dy = groups, dout
        if a["padded"]:
            every_row, covered = cover_every_row(groups, x.shape[0], c)
            dy = dout * covered.astype(dout.dtype)  # the padded rows' outputs are constant zeros
        shared = weight.ndim == 2  # (one group: _builtin_fits)
        w = weight.reshape((1,) + weight.shape) if shared else weight
        grads = gmm_v2_backward_op([dy], [x], [w], every_row, list_type)  # (dx, dweight)
        dweight = grads[1].reshape(weight.shape) if shared else grads[1]
        dbias = None if bias is None else group_sum(dout, groups, c, a["padded"])
        return grads[0], dweight, ops.zeros_like(groups), dbias

    return bprop


GROUPED_MATMUL = OpDef(
    name=_OP,
    inputs=("x", "weight", "group_list", "bias"),
    optional=("bias",),
    outputs=("y",),
    attrs=(Attr("transpose_x", bool, False), Attr("transpose_weight", bool, False),
           Attr("cumulative", bool, False), Attr("padded", bool, True)),
    check_attrs=_check_attrs,
    infer=_infer,
    infer_dtype=_infer_dtype,
    impls=(
        kernel("GroupedMatmul"),
        builtin(_builtin, socs=(A2, A3, ASCEND_950), grad=_builtin_grad, supports=_builtin_fits,
                primitive="GmmV2", kernel="aclnnGroupedMatmulV4"),
        composition(_composed, warn="a masked product per group: G times the flops of the grouped "
                                    "product"),
    ),
    bprop=_bprop,
)


def grouped_matmul(x, weight, group_list, bias=None, transpose_x=False, transpose_weight=False,
                   cumulative=False, padded=True):
    """One matrix product per group of consecutive rows.

    Args:
        x: [M, K] float32/float16/bfloat16, rows grouped (group 0's rows first).
        weight: [G, K, N] (or [G, N, K] with transpose_weight), dtype of x; or one weight for
            every group, [K, N] (or [N, K]): a dense layer's product over the grouped rows, its
            weight read where it is (a reshape to [1, K, N] would copy it on every call in a
            graph). With transpose_x it is the second row-grouped operand, [M, N].
        group_list: int64 [G] rows per group (each >= 0, sum <= M), or with cumulative=True the
            inclusive cumulative ends (non-decreasing, last <= M). A tensor, so GRAPH mode does
            not recompile when the counts change. Rows past the last group (a padded batch)
            belong to no group: zero output rows, no work. Counts that do not fit M rows raise
            RuntimeError before anything is written.
        padded: True (default, as Ascend's grouped matmul): the groups may cover fewer than M
            rows. False: they must cover all M rows (sum == M, last end == M), else RuntimeError;
            on Ascend this also saves masking the output.
        bias: [G, N] or None, added to the rows of its group (not with transpose_x).
        transpose_x: out[g] = x[rows g]^T @ weight[rows g] -> [G, K, N] (a weight gradient;
            an empty group gives zeros).
        transpose_weight: out[rows g] = x[rows g] @ weight[g]^T (an input gradient).

    Returns:
        [M, N] (or [G, K, N] with transpose_x) in x's dtype; float32 maths through the BLAS.
        Differentiable with respect to x, weight and bias.
    """
    return GROUPED_MATMUL(x, weight, group_list, bias, transpose_x=transpose_x,
                          transpose_weight=transpose_weight, cumulative=cumulative, padded=padded)
