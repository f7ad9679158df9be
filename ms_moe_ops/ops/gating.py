"""Router operators (SPEC §1-2): moe_gating_top_k, its sigmoid backward (the seed
aclnnMoeGatingTopKBackward) and its softmax backward (this package's own).

Implementations: the CPU kernels; on Atlas A2/A3 and Ascend 950 in GRAPH mode
aclnnMoeGatingTopK and aclnnMoeGatingTopKBackward within their limits, when the installed CANN has
them; a composition of MindSpore ops everywhere else (PyNative on Ascend: MindSpore's PyNative
custom path takes tensors only, not the kernels' scalars).
"""
import numpy as np
import mindspore as ms
from mindspore import ops

from ._checks import (FLOATS, check_dtype, check_range, check_rank, check_same_dtype, check_shape,
                      differ, dims, known)
from ._impls import aclnn, composition, kernel
from ._indexing import add_per_row
from ._op import Attr, OpDef
from ._platform import A2, A3, ASCEND_950

MAX_EXPERTS = 2048
ACLNN_MAX_ALIGNED_EXPERTS = 2048  # aclnnMoeGatingTopK: (experts per group, aligned up to 32) * groups

# -- moe_gating_top_k ---------------------------------------------------------------------------

_FWD = "moe_gating_top_k"


def _check_router_attrs(a):
    for name, allowed in (("group_select_mode", (0, 1)), ("norm_type", (0, 1)), ("renorm", (0, 1))):
        if a[name] not in allowed:
            raise ValueError(f"{_FWD}: attribute '{name}' must be 0 or 1, got {a[name]}")
    if a["group_count"] < 1:
        raise ValueError(f"{_FWD}: attribute 'group_count' must be >= 1, got {a['group_count']}")
    check_range(_FWD, "attribute 'k_group'", a["k_group"], 1, a["group_count"], "1 <= k_group <= group_count")
    if a["k"] < 1:
        raise ValueError(f"{_FWD}: attribute 'k' must be >= 1, got {a['k']}")


def _infer_router(a, x, bias):
    m, n = dims(_FWD, "x", x, 2)
    check_range(_FWD, "the expert count N (x.shape[1])", n, 1, MAX_EXPERTS)
    if bias is not None:
        check_shape(_FWD, "bias", bias, [n], "one value per expert")
    if not known(n):  # the rest needs the expert count
        return [m, a["k"]], [m, a["k"]], [m, n]
    if n % a["group_count"]:
        raise ValueError(f"{_FWD}: the expert count N={n} must be divisible by attribute "
                         f"'group_count', got group_count={a['group_count']}")
    per_group = n // a["group_count"]
    if a["group_count"] > 1 and a["group_select_mode"] == 1 and per_group < 2:
        raise ValueError(f"{_FWD}: group_select_mode=1 needs at least 2 experts per group, got "
                         f"{per_group} (N={n}, group_count={a['group_count']})")
    check_range(_FWD, "attribute 'k'", a["k"], 1, a["k_group"] * per_group,
                "1 <= k <= k_group * N / group_count")
    return [m, a["k"]], [m, a["k"]], [m, n]


def _infer_router_dtype(a, x, bias):
    check_dtype(_FWD, "x", x, FLOATS)
    if bias is not None:
        check_same_dtype(_FWD, "bias", bias, "x", x)
    return x, "int32", "float32"


def _router_bprop(a):
    backward_args = dict(routed_scaling_factor=a["routed_scaling_factor"], eps=a["eps"])

    def bprop(x, bias, out, dout):
        _, expert_idx, x_norm = out
        dy, _, dx_norm = dout
        # x_norm is an output too: its own gradient adds the score function's derivative
        grad = GATING_GRAD(x_norm, dy, expert_idx, dx_norm, norm_type=a["norm_type"],
                           renorm=a["renorm"], **backward_args)
        return grad, (None if bias is None else ops.zeros_like(bias))

    return bprop


def top_k_lowest_index(values, k):
    """(values, indices) [.., k] of the k largest values of each row, in descending order, equal
    values in ascending index order whatever the device's TopK does with ties: the slot p holding
    value v takes the (r+1)-th index (in index order) whose value is v, r = the earlier slots
    holding v. Costs [.., k, N] comparisons."""
    top, _ = ops.topk(values, k)
    same = top.expand_dims(-1) == top.expand_dims(-2)                        # [.., k, k]
    earlier = ms.Tensor(np.tril(np.ones((k, k), np.bool_), -1))              # q < p
    r = ops.logical_and(same, earlier).astype(ms.int32).sum(-1, keepdims=True)
    seen = ops.cumsum((values.expand_dims(-2) == top.expand_dims(-1)).astype(ms.int32), -1)
    return top, (seen <= r).astype(ms.int32).sum(-1).astype(ms.int32)


_F32_MAX = float(np.finfo(np.float32).max)


def nan_first(values):
    """values in the router's selection order with no NaN left, for TopK and equality tests: NaN
    ranks above every number (the kernels' order, as torch.topk), so NaN -> +inf, +inf -> the
    largest float32 and -inf -> the lowest (above the -inf of dropped groups). Only scores of
    exactly +-3.4028235e38 then tie with +-inf."""
    inf = ops.isinf(values)
    big = ops.where(values > 0, ops.full_like(values, _F32_MAX), ops.full_like(values, -_F32_MAX))
    return ops.where(ops.isnan(values), ops.full_like(values, float("inf")),
                     ops.where(inf, big, values))


def _softmax(logits):
    """softmax over the last axis, NaN for a whole row whose max - logit is undefined (a NaN or
    +inf logit, or every logit -inf), as the kernel and the golden model compute it; MindSpore's
    softmax would leave NaN in one place only."""
    undefined = ops.logical_or(ops.isnan(logits), logits == float("inf")).any(-1, keep_dims=True)
    undefined = ops.logical_or(undefined, (logits == float("-inf")).all(-1, keep_dims=True))
    return ops.where(undefined, ops.full_like(logits, float("nan")), ops.softmax(logits, -1))


def _router_composed(a):
    """moe_gating_top_k from MindSpore ops (SPEC §1 step by step)."""
    k, k_group, groups = a["k"], a["k_group"], a["group_count"]
    sigmoid, renorm = a["norm_type"] == 1, a["renorm"] == 1
    mode, scale, eps = a["group_select_mode"], a["routed_scaling_factor"], a["eps"]

    def route(x, bias):
        logits = x.astype(ms.float32)
        x_norm = ops.sigmoid(logits) if sigmoid else _softmax(logits)
        choice = x_norm if bias is None else x_norm + bias.astype(ms.float32)
        ranked = nan_first(choice)
        if groups > 1:
            n = x.shape[-1]
            grouped = ranked.reshape(-1, groups, n // groups)
            if mode == 0:
                score = grouped.max(axis=-1)
            else:  # the two largest as they are: a NaN among them makes the group's score NaN
                _, best = ops.topk(grouped, 2)
                raw = ops.gather_elements(choice.reshape(grouped.shape), 2, best)
                score = nan_first(raw.sum(-1))
            _, kept = top_k_lowest_index(score, k_group)                     # [M, k_group]
            ids = ops.arange(groups, dtype=ms.int32).reshape(1, 1, groups)
            keep = (kept.expand_dims(-1) == ids).astype(ms.int32).sum(1) > 0   # [M, groups]
            # dropped groups get -inf (never 0): their experts can never win
            ranked = ops.where(keep.expand_dims(-1), grouped, float("-inf")).reshape(-1, n)
        _, idx = top_k_lowest_index(ranked, k)
        w = ops.gather_elements(x_norm, 1, idx)
        if sigmoid or renorm:
            w = w / (w.sum(-1, keepdims=True) + eps)
        return (w * scale).astype(x.dtype), idx, x_norm

    return route


def _aclnn_limits(a, args, soc):
    """aclnnMoeGatingTopK's own limits (CANN ops-transformer moe_gating_top_k: its document and
    tiling, which checks the aligned group size only when groups are really selected)."""
    m, n, groups = args["x"].shape[0], args["x"].shape[-1], a["group_count"]
    if n < 0 or m < 0:
        # MindSpore's custom aclnn kernel keeps pointers to scalar arguments across shape changes
        # (several scalars of one type): only static shapes are sent to the kernel
        return False, "the shape is only known at run time"
    per_group = n // groups
    aligned = -(-per_group // 32) * 32
    selecting = groups not in (1, n) and a["k_group"] != groups
    if selecting and aligned * groups > ACLNN_MAX_ALIGNED_EXPERTS:
        return False, (f"experts per group aligned up to 32 ({aligned}) x group_count ({groups}) "
                       f"= {aligned * groups} > {ACLNN_MAX_ALIGNED_EXPERTS}")
    if per_group <= a["group_select_mode"]:
        return False, f"group_select_mode={a['group_select_mode']} needs more experts per group"
    if a["norm_type"] == 0 and a["renorm"] == 1:
        return False, "the kernel supports renorm=0 only (softmax renormalisation is composed)"
    if soc == ASCEND_950 and a["norm_type"] != 1:
        return False, "the kernel's first Ascend 950 releases take sigmoid scores (norm_type 1) only"
    return True, ""


def _aclnn_router_scalars(a):
    """out_flag false: the kernel then skips writing x_norm (and takes its fast tiling for
    DeepSeek-V3's shapes; its first Ascend 950 releases accept false only); renorm 0: sigmoid
    renormalises whatever renorm says, and softmax with renorm=1 is composed (the kernel's
    releases before 2026 take renorm=0 only)."""
    return dict(out_flag=False, renorm=0)


def _with_scores(a):
    """The kernel's y and expert_idx, with x_norm computed here from the logits (the kernel,
    called with out_flag false, leaves that output unwritten): sigmoid or softmax in float32,
    as the kernel computes it (the bias only chooses)."""
    sigmoid = a["norm_type"] == 1

    def wrap(call, inputs):
        y, expert_idx, _ = call(inputs)
        logits = inputs[0].astype(ms.float32)
        return y, expert_idx, ops.sigmoid(logits) if sigmoid else _softmax(logits)

    return wrap


GATING_TOP_K = OpDef(
    name=_FWD,
    inputs=("x", "bias"),
    optional=("bias",),
    outputs=("y", "expert_idx", "x_norm"),
    attrs=(Attr("k", int, 1), Attr("k_group", int, 1), Attr("group_count", int, 1),
           Attr("group_select_mode", int, 0), Attr("renorm", int, 0), Attr("norm_type", int, 1),
           Attr("out_flag", bool, True), Attr("routed_scaling_factor", float, 1.0),
           Attr("eps", float, 1e-20)),
    check_attrs=_check_router_attrs,
    infer=_infer_router,
    infer_dtype=_infer_router_dtype,
    impls=(
        kernel("MoeGatingTopK"),
        *aclnn("aclnnMoeGatingTopK",
              "x, bias, k:int, k_group:int, group_count:int, group_select_mode:int, renorm:int, "
              "norm_type:int, out_flag:bool, routed_scaling_factor:double, eps:double",
              socs=(A2, A3, ASCEND_950), dtypes=[(t, t, t, "int32", "float32") for t in FLOATS],
              supports=_aclnn_limits, scalars=_aclnn_router_scalars, around=_with_scores),
        composition(_router_composed),
    ),
    bprop=_router_bprop,
)


def moe_gating_top_k(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                     norm_type=1, out_flag=True, routed_scaling_factor=1.0, eps=1e-20):
    """DeepSeek-V3 style router: scores, optional group-limited selection, top-k, renormalisation.

    Args:
        x: [M, N] float32/float16/bfloat16 logits, 1 <= N <= 2048.
        k: experts per row. bias: [N] (dtype of x) added to the scores for selection only.
        k_group, group_count, group_select_mode: keep the k_group best of group_count equal groups
            (group score: max (0) or sum of the two largest (1)).
        renorm: softmax only: renormalise the k weights. norm_type: 1 sigmoid, 0 softmax.
        routed_scaling_factor, eps: y = w / (sum(w) + eps) * routed_scaling_factor.

    Returns:
        (y [M, k] dtype of x, expert_idx [M, k] int32, x_norm [M, N] float32). Differentiable
        with respect to x.
    """
    return GATING_TOP_K(x, bias, k=k, k_group=k_group, group_count=group_count,
                        group_select_mode=group_select_mode, renorm=renorm, norm_type=norm_type,
                        out_flag=out_flag, routed_scaling_factor=routed_scaling_factor, eps=eps)


# -- backwards --------------------------------------------------------------------------------

def _backward_infer(op, min_experts):
    def infer(a, x_norm, grad_y, expert_idx):
        m, n = dims(op, "x_norm", x_norm, 2)
        grad_y = dims(op, "grad_y", grad_y, 2)
        check_rank(op, "expert_idx", expert_idx, 2)
        check_range(op, "the expert count N (x_norm.shape[1])", n, min_experts, MAX_EXPERTS)
        if differ(grad_y[0], m):
            raise ValueError(f"{op}: 'grad_y' must have M={m} rows like 'x_norm', got shape "
                             f"{list(grad_y)}")
        check_range(op, "K (grad_y.shape[1])", grad_y[1], 1, n, "1 <= K <= N")
        check_shape(op, "expert_idx", expert_idx, grad_y, "the shape of grad_y")
        return ([m, n],)

    def infer_dtype(a, x_norm, grad_y, expert_idx):
        check_dtype(op, "x_norm", x_norm, ("float32",))
        check_dtype(op, "grad_y", grad_y, FLOATS)
        check_dtype(op, "expert_idx", expert_idx, ("int32",))
        return (grad_y,)

    return infer, infer_dtype


def _check_sigmoid_only(a):
    if a["norm_type"] != 1:
        raise ValueError(f"moe_gating_top_k_backward: attribute 'norm_type' must be 1 (sigmoid), "
                         f"got {a['norm_type']}; the softmax backward is part of moe_gating_top_k")
    if a["renorm"] not in (0, 1):
        raise ValueError(f"moe_gating_top_k_backward: attribute 'renorm' must be 0 or 1, "
                         f"got {a['renorm']}")


def _sigmoid_backward_composed(a):
    """The sigmoid router backward from MindSpore ops (SPEC §2; duplicates are summed)."""
    scale, eps = a["routed_scaling_factor"], a["eps"]

    def grad(x_norm, grad_y, expert_idx):
        g = grad_y.astype(ms.float32) * scale
        w = ops.gather_elements(x_norm, 1, expert_idx)
        d = w.sum(axis=-1, keepdims=True) + eps
        beta = (w / d * g).sum(axis=-1, keepdims=True)
        gn = add_per_row(x_norm, expert_idx, (g - beta) / d)
        return (x_norm * (1 - x_norm) * gn).astype(grad_y.dtype)

    return grad


def _static_rows(a, args, soc):
    if args["x_norm"].shape[0] < 0:
        return False, "the shape is only known at run time (see moe_gating_top_k's aclnn limits)"
    return True, ""


def _float32_grad_y(a):
    """The kernel is called with float32 grad_y (a float32 grad_x, as it is registered), cast
    back to grad_y's dtype."""
    def wrap(call, inputs):
        x_norm, grad_y, expert_idx = inputs
        return call((x_norm, grad_y.astype(ms.float32), expert_idx)).astype(grad_y.dtype)

    return wrap


GATING_BACKWARD = OpDef(
    name="moe_gating_top_k_backward",
    inputs=("x_norm", "grad_y", "expert_idx"),
    outputs=("grad_x",),
    attrs=(Attr("renorm", int, 0), Attr("norm_type", int, 1),
           Attr("routed_scaling_factor", float, 1.0), Attr("eps", float, 1e-20)),
    check_attrs=_check_sigmoid_only,
    infer=_backward_infer("moe_gating_top_k_backward", 2)[0],  # the aclnn kernel's range
    infer_dtype=_backward_infer("moe_gating_top_k_backward", 2)[1],
    impls=(
        kernel("MoeGatingTopKBackward"),
        *aclnn("aclnnMoeGatingTopKBackward",
              "x_norm, grad_y, expert_idx, renorm:int, norm_type:int, "
              "routed_scaling_factor:double, eps:double",
              socs=(A2, A3, ASCEND_950), dtypes=[("float32", "float32", "int32", "float32")],
              supports=_static_rows, around=_float32_grad_y),
        composition(_sigmoid_backward_composed),
    ),
)


def moe_gating_top_k_backward(x_norm, grad_y, expert_idx, renorm=0, norm_type=1,
                              routed_scaling_factor=1.0, eps=1e-20):
    """Gradient of moe_gating_top_k (sigmoid) with respect to x (SPEC §2).

    x_norm [M, N] float32, grad_y [M, K] float32/float16/bfloat16, expert_idx [M, K] int32 ->
    grad_x [M, N] in grad_y's dtype. Duplicate indices in a row are summed; an index outside
    [0, N) is a RuntimeError raised before anything is written.
    """
    return GATING_BACKWARD(x_norm, grad_y, expert_idx, renorm=renorm, norm_type=norm_type,
                           routed_scaling_factor=routed_scaling_factor, eps=eps)


def _softmax_backward_composed(a):
    """The softmax router backward from MindSpore ops (Ascend has no kernel for it)."""
    scale, eps, renorm = a["routed_scaling_factor"], a["eps"], a["renorm"] == 1

    def grad(x_norm, grad_y, expert_idx):
        g = grad_y.astype(ms.float32) * scale
        w = ops.gather_elements(x_norm, 1, expert_idx)
        if renorm:
            d = w.sum(axis=-1, keepdims=True) + eps
            beta = (w / d * g).sum(axis=-1, keepdims=True)
            g = (g - beta) / d
        gn = add_per_row(x_norm, expert_idx, g)
        out = x_norm * (gn - (x_norm * gn).sum(axis=-1, keepdims=True))
        return out.astype(grad_y.dtype)

    return grad


_SOFTMAX_BWD = "moe_gating_top_k_softmax_backward"
GATING_SOFTMAX_BACKWARD = OpDef(
    name=_SOFTMAX_BWD,
    inputs=("x_norm", "grad_y", "expert_idx"),
    outputs=("grad_x",),
    attrs=(Attr("renorm", int, 0), Attr("routed_scaling_factor", float, 1.0),
           Attr("eps", float, 1e-20)),
    infer=_backward_infer(_SOFTMAX_BWD, 1)[0],
    infer_dtype=_backward_infer(_SOFTMAX_BWD, 1)[1],
    impls=(kernel("MoeGatingTopKSoftmaxBackward"), composition(_softmax_backward_composed)),
)


# -- the router's whole backward ------------------------------------------------------------------

_GRAD = "moe_gating_top_k_grad"


def _infer_grad(a, x_norm, grad_y, expert_idx, grad_x_norm):
    shapes = _backward_infer(_GRAD, 1)[0](a, x_norm, grad_y, expert_idx)
    if grad_x_norm is not None:
        check_shape(_GRAD, "grad_x_norm", grad_x_norm, x_norm, "the shape of x_norm")
    return shapes


def _infer_grad_dtype(a, x_norm, grad_y, expert_idx, grad_x_norm):
    if grad_x_norm is not None:
        check_dtype(_GRAD, "grad_x_norm", grad_x_norm, ("float32",))
    return _backward_infer(_GRAD, 1)[1](a, x_norm, grad_y, expert_idx)


def _check_grad_attrs(a):
    for name in ("norm_type", "renorm"):
        if a[name] not in (0, 1):
            raise ValueError(f"{_GRAD}: attribute '{name}' must be 0 or 1, got {a[name]}")


def _grad_composed(a):
    """The backward through y (moe_gating_top_k_backward, or the softmax one) plus the score
    function's derivative applied to grad_x_norm, as separate operators."""
    sigmoid = a["norm_type"] == 1
    args = dict(routed_scaling_factor=a["routed_scaling_factor"], eps=a["eps"])
    one_expert = _sigmoid_backward_composed(a)  # N = 1, below the backward operator's N >= 2

    def grad(x_norm, grad_y, expert_idx, grad_x_norm):
        # both parts in float32, rounded to grad_y's dtype once (as the kernel does)
        gy = grad_y.astype(ms.float32)
        if sigmoid and x_norm.shape[1] == 1:
            g = one_expert(x_norm, gy, expert_idx)
        elif sigmoid:
            g = moe_gating_top_k_backward(x_norm, gy, expert_idx, **args)
        else:
            g = GATING_SOFTMAX_BACKWARD(x_norm, gy, expert_idx, renorm=a["renorm"], **args)
        if grad_x_norm is not None:
            if sigmoid:
                g = g + x_norm * (1 - x_norm) * grad_x_norm
            else:
                g = g + x_norm * (grad_x_norm - (x_norm * grad_x_norm).sum(axis=-1, keepdims=True))
        return g.astype(grad_y.dtype)

    return grad


# The gradient of moe_gating_top_k with respect to x, given the gradients of both its outputs y
# and x_norm: on CPU one kernel reads x_norm and grad_x_norm once and writes grad_x once (the
# separate operators take five passes over [M, N]).
GATING_GRAD = OpDef(
    name=_GRAD,
    inputs=("x_norm", "grad_y", "expert_idx", "grad_x_norm"),
    optional=("grad_x_norm",),
    outputs=("grad_x",),
    attrs=(Attr("norm_type", int, 1), Attr("renorm", int, 0),
           Attr("routed_scaling_factor", float, 1.0), Attr("eps", float, 1e-20)),
    check_attrs=_check_grad_attrs,
    infer=_infer_grad,
    infer_dtype=_infer_grad_dtype,
    impls=(kernel("MoeGatingTopKGrad"), composition(_grad_composed)),
)


def moe_gating_top_k_grad(x_norm, grad_y, expert_idx, grad_x_norm=None, norm_type=1, renorm=0,
                          routed_scaling_factor=1.0, eps=1e-20):
    """Gradient of moe_gating_top_k with respect to x from the gradients of y and of x_norm
    (sigmoid or softmax scores, as norm_type and renorm in the forward).

    x_norm [M, N] float32, grad_y [M, K] float32/float16/bfloat16, expert_idx [M, K] int32,
    grad_x_norm [M, N] float32 or None (zero) -> grad_x [M, N] in grad_y's dtype, computed in
    float32. Duplicate indices in a row are summed; an index outside [0, N) is a RuntimeError
    raised before anything is written.
    """
    return GATING_GRAD(x_norm, grad_y, expert_idx, grad_x_norm, norm_type=norm_type,
                       renorm=renorm, routed_scaling_factor=routed_scaling_factor, eps=eps)
