"""SwiGLU with clamp, per-token weights and group index (SPEC §3): swiglu_group and its backward
swiglu_group_quant_grad (the seed aclnnSwigluGroupQuantGrad; no quantisation happens in it).

clamp_limit: c > 0 turns the clamp on, c <= 0 turns it off.

Implementations: the CPU kernels; the forward is composed from MindSpore ops on every other
device (no aclnn forward kernel exists); the backward is aclnnSwigluGroupQuantGrad on Ascend 950
in GRAPH mode (the only SoC that has it) and composed elsewhere.
"""
import math

import numpy as np
import mindspore as ms
from mindspore import ops

from ._checks import (FLOATS, UNKNOWN_RANK, check_dtype, check_rank, check_same_dtype, check_shape,
                      known, unknown_rank)
from ._impls import aclnn, composition, kernel
from ._op import Attr, OpDef
from ._platform import ASCEND_950

_FWD = "swiglu_group"
_BWD = "swiglu_group_quant_grad"
# The clamp limit aclnnSwigluGroupQuantGrad gets when the clamp is off. The kernel's versions
# disagree on how to say "off": its operator document and first version read 0 as off (and -1 as
# a limit of -1); its later tiling accepts only -1 (off) or > 0 and rejects 0. The largest float32
# is a limit to both, and the same as no clamp for every input of magnitude below it: only
# +-inf and +-3.4028235e38 get the clamped gradient (zero) instead of the unclamped one.
ACLNN_CLAMP_OFF = float(np.finfo(np.float32).max)


def _check_clamp(op):
    def check(a):
        c = a["clamp_limit"]
        if math.isnan(c) or math.isinf(c):
            raise ValueError(f"{op}: attribute 'clamp_limit' must be a finite number "
                             f"(> 0 turns the clamp on, <= 0 off), got {c}")
    return check


def _check_x(op, x):
    """(leading dimensions, H) of x [.., 2H]; the leading dimensions are None when the rank is
    unknown, H is -1 when unknown."""
    check_rank(op, "x", x, (2, 3))
    if unknown_rank(x):
        return None, -1
    if known(x[-1]) and (x[-1] % 2 or x[-1] == 0):
        raise ValueError(f"{op}: the last dimension of 'x' must be even and positive (x0 | x1 "
                         f"halves), got shape {list(x)}")
    return list(x[:-1]), x[-1] // 2 if known(x[-1]) else -1


def _rows(lead, last):
    """lead + [last], or the unknown rank's [-2] when lead is unknown."""
    return [UNKNOWN_RANK] if lead is None else lead + [last]


def _check_weight_and_groups(op, lead, weight, group_index):
    if weight is not None:
        check_shape(op, "weight", weight, _rows(lead, 1), "one value per token")
    if group_index is not None:
        check_rank(op, "group_index", group_index, 1)


def _check_weight_dtypes(op, weight, group_index):
    if weight is not None:
        check_dtype(op, "weight", weight, ("float32",))
    if group_index is not None:
        check_dtype(op, "group_index", group_index, ("int64",))


# -- forward ------------------------------------------------------------------------------------

def _infer_forward(a, x, weight, group_index):
    lead, h = _check_x(_FWD, x)
    _check_weight_and_groups(_FWD, lead, weight, group_index)
    return _rows(lead, h), _rows(lead, h)


def _infer_forward_dtype(a, x, weight, group_index):
    check_dtype(_FWD, "x", x, FLOATS)
    _check_weight_dtypes(_FWD, weight, group_index)
    return x, x


def _row_mask(rows_shape, group_index):
    """[.., 1] float32: 1 for the first min(sum(group_index), T) rows, 0 after. Each count is
    clamped to T before the sum, so counts near 2**63 cannot wrap it (exact while G*T < 2**63)."""
    rows = 1
    for d in rows_shape:
        rows *= d
    trunc = ops.minimum(ops.minimum(group_index, rows).sum(), rows)
    keep = (ops.arange(rows, dtype=ms.int64) < trunc).astype(ms.float32)
    return keep.reshape(tuple(rows_shape) + (1,))


def _clamped(x, c):
    """float32 halves (x0, x1) of x and their clamped values (x0', x1')."""
    x0, x1 = ops.chunk(x.astype(ms.float32), 2, -1)
    if c > 0:
        return x0, x1, ops.minimum(x0, c), ops.clamp(x1, -c, c)
    return x0, x1, x0, x1


def _forward_composed(a):
    """The forward from MindSpore ops; its gradient is still the fused backward (the OpDef's
    bprop), not autodiff of the composition."""
    c = a["clamp_limit"]

    def forward(x, weight, group_index):
        _, _, x0, x1 = _clamped(x, c)
        y_origin = ops.silu(x0) * x1
        if group_index is not None:
            y_origin = y_origin * _row_mask(x.shape[:-1], group_index)
        y = y_origin if weight is None else y_origin * weight
        return y.astype(x.dtype), y_origin.astype(x.dtype)

    return forward


def _swiglu_bprop(a):
    clamp_limit = a["clamp_limit"]

    def bprop(x, weight, group_index, out, dout):
        # y_origin is an internal output (swiglu_group returns y only): its gradient is zero.
        dy = dout[0]
        if weight is None:
            grad_x, _ = SWIGLU_GROUP_QUANT_GRAD(dy, x, None, None, group_index,
                                                clamp_limit=clamp_limit)
            grad_w = None
        else:
            grad_x, grad_w = SWIGLU_GROUP_QUANT_GRAD(dy, x, weight, out[1], group_index,
                                                     clamp_limit=clamp_limit)
        return grad_x, grad_w, (None if group_index is None else ops.zeros_like(group_index))

    return bprop


def _composed_bprop(a):
    """The fused backward for the composition: without weight its y and y_origin are one
    tensor, and PyNative may hand the gradient of y to either output slot."""
    backward = _swiglu_bprop(a)

    def bprop(x, weight, group_index, out, dout):
        if weight is None:
            dout = (dout[0] + dout[1], dout[1])
        return backward(x, weight, group_index, out, dout)

    return bprop


SWIGLU_GROUP = OpDef(
    name=_FWD,
    inputs=("x", "weight", "group_index"),
    optional=("weight", "group_index"),
    outputs=("y", "y_origin"),
    attrs=(Attr("clamp_limit", float, 0.0),),
    check_attrs=_check_clamp(_FWD),
    infer=_infer_forward,
    infer_dtype=_infer_forward_dtype,
    impls=(kernel("SwigluGroup"), composition(_forward_composed, grad=_composed_bprop)),
    bprop=_swiglu_bprop,
)


def swiglu_group(x, weight=None, group_index=None, clamp_limit=0.0):
    """SwiGLU of the two halves of x, optionally clamped, weighted per token and truncated.

    Per row t < trunc: x0' = min(x0, c), x1' = clamp(x1, -c, c) when clamp_limit c > 0;
    y = silu(x0') * x1' * weight[t]. Rows t >= trunc = min(sum(group_index), T) are 0.

    Args:
        x: [T, 2H] or [B, S, 2H] float32/float16/bfloat16 (gate half first).
        weight: [T, 1] or [B, S, 1] float32 per-token weight (e.g. routing probability), or None.
        group_index: 1-D int64 tensor of per-group token COUNTS, or None (all rows). A negative
            count is a RuntimeError raised before anything is written.
        clamp_limit: > 0 clamps as above; <= 0 disables the clamp.

    Returns:
        y: [.., H], dtype of x. Differentiable with respect to x and weight (the backward is
        swiglu_group_quant_grad). On Ascend the forward is composed from MindSpore ops (there is
        no aclnn forward kernel) and the backward is aclnnSwigluGroupQuantGrad.
    """
    return SWIGLU_GROUP(x, weight, group_index, clamp_limit=clamp_limit)[0]


# -- backward -----------------------------------------------------------------------------------

def _infer_backward(a, grad_y, x, weight, y_origin, group_index):
    lead, h = _check_x(_BWD, x)
    check_shape(_BWD, "grad_y", grad_y, _rows(lead, h), "x's shape with the last dim halved")
    if weight is not None and y_origin is None:
        raise ValueError(f"{_BWD}: 'weight' needs 'y_origin' (the un-weighted forward output) to "
                         f"compute the weight's gradient, got y_origin=None")
    if y_origin is not None:
        check_shape(_BWD, "y_origin", y_origin, _rows(lead, h), "the shape of grad_y")
    _check_weight_and_groups(_BWD, lead, weight, group_index)
    return list(x), _rows(lead, 1)


def _infer_backward_dtype(a, grad_y, x, weight, y_origin, group_index):
    check_dtype(_BWD, "x", x, FLOATS)
    check_same_dtype(_BWD, "grad_y", grad_y, "x", x)
    if y_origin is not None:
        check_same_dtype(_BWD, "y_origin", y_origin, "x", x)
    _check_weight_dtypes(_BWD, weight, group_index)
    return x, "float32"


def _backward_composed(a):
    """The backward from MindSpore ops (SPEC §3: Atlas A2/A3 have no kernel for it)."""
    c = a["clamp_limit"]

    def backward(grad_y, x, weight, y_origin, group_index):
        x0, x1, x0c, x1c = _clamped(x, c)
        g = grad_y.astype(ms.float32)
        lead = tuple(x.shape[:-1])
        keep = None if group_index is None else _row_mask(lead, group_index)
        if weight is None:
            grad_w = ops.zeros(lead + (1,), dtype=ms.float32)
        else:
            grad_w = (g * y_origin.astype(ms.float32)).sum(-1, keepdims=True)
            grad_w = grad_w if keep is None else grad_w * keep
            g = g * weight
        s = ops.sigmoid(x0c)
        gx0 = g * x1c * s * (1 + x0c * (1 - s))
        gx1 = g * x0c * s
        if c > 0:  # the gradient passes strictly inside the clamp, on the original x
            gx0 = gx0 * (x0 < c).astype(ms.float32)
            gx1 = gx1 * ops.logical_and(x1 > -c, x1 < c).astype(ms.float32)
        grad_x = ops.concat((gx0, gx1), -1)
        grad_x = grad_x if keep is None else grad_x * keep
        return grad_x.astype(x.dtype), grad_w

    return backward


def _zero_grad_weight_without_weight(a):
    """aclnnSwigluGroupQuantGrad writes gradWeightOutOptional only for a weight: without one, the
    declared grad_weight (zeros, as the CPU kernel and the composition give) is made here rather
    than read from a buffer the kernel never wrote."""
    def wrap(call, inputs):
        out = call(inputs)
        if inputs[2] is not None:
            return out
        return out[0], ops.zeros(out[1].shape, dtype=ms.float32)

    return wrap


SWIGLU_GROUP_QUANT_GRAD = OpDef(
    name=_BWD,
    inputs=("grad_y", "x", "weight", "y_origin", "group_index"),
    optional=("weight", "y_origin", "group_index"),
    outputs=("grad_x", "grad_weight"),
    attrs=(Attr("clamp_limit", float, 0.0),),
    check_attrs=_check_clamp(_BWD),
    infer=_infer_backward,
    infer_dtype=_infer_backward_dtype,
    impls=(
        kernel("SwigluGroupQuantGrad"),
        # groupIndexOptional is an aclTensor in the generated header (the seed text's aclIntArray
        # is wrong); clampLimit is a double, and "off" reaches the kernel as ACLNN_CLAMP_OFF
        *aclnn("aclnnSwigluGroupQuantGrad", "grad_y, x, weight, y_origin, group_index, "
              "clamp_limit:double", socs=(ASCEND_950,),
              dtypes=[(t, t, "float32", t, "int64", t, "float32") for t in FLOATS],
              scalars=lambda a: {"clamp_limit": a["clamp_limit"] if a["clamp_limit"] > 0
                                 else ACLNN_CLAMP_OFF},
              around=_zero_grad_weight_without_weight),
        composition(_backward_composed),
    ),
)


def swiglu_group_quant_grad(grad_y, x, weight=None, y_origin=None, group_index=None,
                            clamp_limit=0.0):
    """Gradient of swiglu_group (SPEC §3; Ascend: aclnnSwigluGroupQuantGrad).

    Args:
        grad_y: [.., H], dtype of x: the gradient of y. x: [.., 2H] the forward input.
        weight: [.., 1] float32 or None; needs y_origin (ValueError otherwise).
        y_origin: [.., H] the UN-weighted forward output (swiglu_group without weight), or None.
        group_index: 1-D int64 per-group token counts, or None. clamp_limit: as in swiglu_group;
            the gradient passes only where x0 < c and -c < x1 < c (strict).

    Returns:
        (grad_x [.., 2H] dtype of x, grad_weight [.., 1] float32 or None when weight is None).
        Rows t >= min(sum(group_index), T) get zero gradients.
    """
    grad_x, grad_weight = SWIGLU_GROUP_QUANT_GRAD(grad_y, x, weight, y_origin, group_index,
                                                  clamp_limit=clamp_limit)
    return grad_x, (None if weight is None else grad_weight)
