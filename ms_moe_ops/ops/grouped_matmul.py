"""grouped_matmul (SPEC §5): one matrix product per group of rows, with the transposed forms a
backward needs, so that grouped layers (MoeFFN) differentiate through it."""
import mindspore as ms
from mindspore import ops

from ._checks import FLOATS, check_dtype, check_rank, check_same_dtype, check_shape
from ._op import Attr, OpDef

_OP = "grouped_matmul"


def _check_attrs(a):
    if a["transpose_x"] and a["transpose_weight"]:
        raise ValueError(f"{_OP}: attributes 'transpose_x' and 'transpose_weight' cannot both be "
                         f"True, got transpose_x=True, transpose_weight=True")


def _infer(a, x, weight, group_list, bias):
    check_rank(_OP, "x", x, 2)
    check_rank(_OP, "group_list", group_list, 1)
    m, k = x
    g = group_list[0]
    if g < 1:
        raise ValueError(f"{_OP}: 'group_list' must hold at least one group, got shape {list(group_list)}")
    if a["transpose_x"]:
        # out[g] = x[rows g]^T @ weight[rows g]: weight is the second row-grouped operand
        check_rank(_OP, "weight", weight, 2)
        if weight[0] != m:
            raise ValueError(f"{_OP}: with transpose_x, 'weight' must be [M, N] with the M={m} rows "
                             f"of 'x', got shape {list(weight)}")
        if bias is not None:
            raise ValueError(f"{_OP}: 'bias' is not supported with transpose_x, got shape {list(bias)}")
        return ([g, k, weight[1]],)
    check_rank(_OP, "weight", weight, 3)
    n = weight[1] if a["transpose_weight"] else weight[2]
    expected = [g, n, k] if a["transpose_weight"] else [g, k, n]
    check_shape(_OP, "weight", weight, expected,
                "[G, N, K] (transpose_weight)" if a["transpose_weight"] else "[G, K, N]")
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


def group_sum(values, group_list, cumulative=False):
    """Per-group sum of the rows of values [M, N] -> [G, N] (a product with a column of ones)."""
    ones = ops.ones((values.shape[0], 1), values.dtype)
    sums = grouped_matmul(ones, values, group_list, transpose_x=True, cumulative=cumulative)
    shape = (sums.shape[0], sums.shape[2])
    if values.dtype == ms.bfloat16:  # GRAPH mode has no bfloat16 Reshape on CPU (exact casts)
        return sums.astype(ms.float32).reshape(shape).astype(ms.bfloat16)
    return sums.reshape(shape)


def _bprop(a):
    c = a["cumulative"]

    def bprop(x, weight, groups, bias, out, dout):
        if a["transpose_x"]:  # out[g] = x_g^T @ b_g
            dx = grouped_matmul(weight, dout, groups, transpose_weight=True, cumulative=c)
            dweight = grouped_matmul(x, dout, groups, cumulative=c)
            return dx, dweight, ops.zeros_like(groups), None
        if a["transpose_weight"]:  # out_g = x_g @ w[g]^T
            dx = grouped_matmul(dout, weight, groups, cumulative=c)
            dweight = grouped_matmul(dout, x, groups, transpose_x=True, cumulative=c)
        else:  # out_g = x_g @ w[g]
            dx = grouped_matmul(dout, weight, groups, transpose_weight=True, cumulative=c)
            dweight = grouped_matmul(x, dout, groups, transpose_x=True, cumulative=c)
        dbias = None if bias is None else group_sum(dout, groups, c)
        return dx, dweight, ops.zeros_like(groups), dbias

    return bprop


def _ascend(a):
    """MindSpore's grouped matmul (aclnnGroupedMatmulV4); it has no CPU kernel.

    transpose_x uses group_type 2 (groups along the reduced axis), which CANN's
    aclnnGroupedMatmulV4 documents but MindSpore 2.10's docstring does not list (-1 and 0
    only): not checked on a device."""
    from mindspore.ops.auto_generate import grouped_matmul_v4

    list_type = 0 if a["cumulative"] else 1  # 0: cumulative ends, 1: counts

    def f(x, weight, group_list, bias):
        if a["transpose_x"]:  # split along the reduced axis (group_type 2)
            return grouped_matmul_v4([x.T], [weight], group_list=group_list, split_item=3,
                                     group_type=2, group_list_type=list_type)[0]
        if a["transpose_weight"]:
            weight = weight.transpose(0, 2, 1)
        return grouped_matmul_v4([x], [weight], bias=None if bias is None else [bias],
                                 group_list=group_list, split_item=3, group_type=0,
                                 group_list_type=list_type)[0]

    return f


GROUPED_MATMUL = OpDef(
    name=_OP,
    inputs=("x", "weight", "group_list", "bias"),
    optional=("bias",),
    outputs=("y",),
    attrs=(Attr("transpose_x", bool, False), Attr("transpose_weight", bool, False),
           Attr("cumulative", bool, False)),
    check_attrs=_check_attrs,
    infer=_infer,
    infer_dtype=_infer_dtype,
    cpu="GroupedMatmul",
    ascend=_ascend,
    bprop=_bprop,
)


def grouped_matmul(x, weight, group_list, bias=None, transpose_x=False, transpose_weight=False,
                   cumulative=False):
    """One matrix product per group of consecutive rows.

    Args:
        x: [M, K] float32/float16/bfloat16, rows grouped (group 0's rows first).
        weight: [G, K, N] (or [G, N, K] with transpose_weight), dtype of x. With transpose_x it is
            the second row-grouped operand, [M, N].
        group_list: int64 [G] rows per group (each >= 0, sum <= M), or with cumulative=True the
            inclusive cumulative ends (non-decreasing, last <= M). A tensor, so GRAPH mode does
            not recompile when the counts change. Rows past the last group (a padded batch)
            belong to no group: zero output rows, no work. Counts that do not fit M rows raise
            RuntimeError before anything is written.
        bias: [G, N] or None, added to the rows of its group (not with transpose_x).
        transpose_x: out[g] = x[rows g]^T @ weight[rows g] -> [G, K, N] (a weight gradient;
            an empty group gives zeros).
        transpose_weight: out[rows g] = x[rows g] @ weight[g]^T (an input gradient).

    Returns:
        [M, N] (or [G, K, N] with transpose_x) in x's dtype; float32 maths through the BLAS.
        Differentiable with respect to x, weight and bias.
    """
    return GROUPED_MATMUL(x, weight, group_list, bias, transpose_x=transpose_x,
                          transpose_weight=transpose_weight, cumulative=cumulative)
