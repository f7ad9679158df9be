"""numpy golden models of every operator (SPEC.md), written for clarity, not speed.

Everything is computed in float64 from the inputs; callers round to the output dtype. Tests and
users compare the kernels against these.
"""
import numpy as np


def _sigmoid(x):
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # stable for any |x|


def _softmax(x):
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _top_k(values, k):
    """Indices of the k largest values, descending, lower index first on ties."""
    order = np.lexsort((np.arange(values.shape[-1]), -values))
    return order[:k]


# -- router (SPEC §1-2) --------------------------------------------------------------------------

def moe_gating_top_k(x, k, bias=None, k_group=1, group_count=1, group_select_mode=0, renorm=0,
                     norm_type=1, out_flag=True, routed_scaling_factor=1.0, eps=1e-20):
    """-> (y [M, k] float64, expert_idx [M, k] int32, x_norm [M, N] float64)."""
    x = np.asarray(x, np.float64)
    m, n = x.shape
    x_norm = _sigmoid(x) if norm_type == 1 else _softmax(x)
    # selection scores are what the kernel sees: float32 scores plus bias
    choice = x_norm.astype(np.float32).astype(np.float64)
    if bias is not None:
        choice = (choice.astype(np.float32) + np.asarray(bias, np.float32)).astype(np.float64)
    y = np.zeros((m, k))
    idx = np.zeros((m, k), np.int32)
    per = n // group_count
    for i in range(m):
        c = choice[i].copy()
        if group_count > 1:
            groups = c.reshape(group_count, per)
            if group_select_mode == 0:
                score = groups.max(axis=1)
            else:
                score = np.sort(groups, axis=1)[:, -2:].sum(axis=1)
            keep = _top_k(score.astype(np.float32), k_group)
            mask = np.full(group_count, True)
            mask[keep] = False
            groups[mask] = -np.inf
            c = groups.reshape(n)
        idx[i] = _top_k(c, k)
        w = x_norm[i, idx[i]]
        if norm_type == 1 or renorm == 1:
            w = w / (w.sum() + eps)
        y[i] = w * routed_scaling_factor
    return y, idx, x_norm


def _renorm_grad(w, g, renorm, eps):
    if not renorm:
        return g
    d = w.sum() + eps
    beta = (w / d * g).sum()
    return (g - beta) / d


def moe_gating_top_k_backward(x_norm, grad_y, expert_idx, renorm=0, norm_type=1,
                              routed_scaling_factor=1.0, eps=1e-20):
    """Sigmoid router backward (SPEC §2): -> grad_x [M, N] float64. Duplicates are summed."""
    x_norm = np.asarray(x_norm, np.float64)
    grad_y = np.asarray(grad_y, np.float64)
    grad_x = np.zeros_like(x_norm)
    for i in range(x_norm.shape[0]):
        idx = expert_idx[i]
        gw = _renorm_grad(x_norm[i, idx], routed_scaling_factor * grad_y[i], True, eps)
        gn = np.zeros(x_norm.shape[1])
        np.add.at(gn, idx, gw)
        grad_x[i] = x_norm[i] * (1 - x_norm[i]) * gn
    return grad_x


def moe_gating_top_k_softmax_backward(x_norm, grad_y, expert_idx, renorm=0,
                                      routed_scaling_factor=1.0, eps=1e-20):
    """Softmax router backward: -> grad_x [M, N] float64."""
    x_norm = np.asarray(x_norm, np.float64)
    grad_y = np.asarray(grad_y, np.float64)
    grad_x = np.zeros_like(x_norm)
    for i in range(x_norm.shape[0]):
        idx = expert_idx[i]
        gw = _renorm_grad(x_norm[i, idx], routed_scaling_factor * grad_y[i], renorm == 1, eps)
        gn = np.zeros(x_norm.shape[1])
        np.add.at(gn, idx, gw)
        grad_x[i] = x_norm[i] * (gn - (x_norm[i] * gn).sum())
    return grad_x
