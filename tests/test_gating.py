"""moe_gating_top_k, moe_gating_top_k_backward and the GatingTopK Cell."""
import re

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from ms_moe_ops import GatingTopK, moe_gating_top_k, moe_gating_top_k_backward
from ms_moe_ops import reference as ref
from ms_moe_ops.ops.gating import GATING_GRAD, GATING_SOFTMAX_BACKWARD
from conftest import assert_close, finite_diff, grad, needs_kernels, numpy, rounded, run, tensor

pytestmark = pytest.mark.every_isa  # the kernels run under every instruction-set path


def distinct_logits(m, n, seed=0):
    """Logits whose scores are well separated, so the selection is the same in any precision."""
    rng = np.random.default_rng(seed)
    rows = [rng.permutation(n) for _ in range(m)]
    return (np.array(rows, np.float64) - n / 2) * (4.0 / n) + rng.uniform(-0.01, 0.01, (m, n))


# -- forward --------------------------------------------------------------------------------------

CONFIGS = [
    dict(k=2),
    dict(k=4, k_group=2, group_count=4, group_select_mode=0),
    dict(k=4, k_group=2, group_count=4, group_select_mode=1, routed_scaling_factor=2.5),
    dict(k=3, norm_type=0, renorm=0),
    dict(k=3, norm_type=0, renorm=1, routed_scaling_factor=1.5),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_forward_matches_reference(cfg, dtype, rng):
    x = rounded(distinct_logits(6, 16), dtype)
    bias = rounded(rng.uniform(-0.02, 0.02, 16), dtype)
    y, idx, xn = moe_gating_top_k(tensor(x, dtype), bias=tensor(bias, dtype), **cfg)
    ry, ridx, rxn = ref.moe_gating_top_k(x, bias=bias, **cfg)
    assert y.dtype == tensor(x, dtype).dtype and idx.dtype == ms.int32 and xn.dtype == ms.float32
    np.testing.assert_array_equal(numpy(idx), ridx)
    assert_close(numpy(y), ry, dtype)
    assert_close(numpy(xn), rxn, "float32")


def test_graph_and_pynative_agree(mode):
    x = tensor(distinct_logits(4, 8).astype(np.float32))
    fn = lambda x: moe_gating_top_k(x, 2, None, 2, 4, 1)  # noqa: E731
    y, idx, _ = run(fn, x, mode=mode)
    ry, ridx, _ = ref.moe_gating_top_k(numpy(x), 2, None, 2, 4, 1)
    np.testing.assert_array_equal(numpy(idx), ridx)
    assert_close(numpy(y), ry)


def test_ties_prefer_lower_index():
    x = np.zeros((2, 8), np.float32)
    _, idx, _ = moe_gating_top_k(Tensor(x), 3)
    np.testing.assert_array_equal(numpy(idx), [[0, 1, 2], [0, 1, 2]])
    # tied groups too: groups 0 and 1 have equal scores, group 0 wins
    _, idx, _ = moe_gating_top_k(Tensor(x), 2, k_group=1, group_count=4, group_select_mode=1)
    np.testing.assert_array_equal(numpy(idx), [[0, 1], [0, 1]])


@pytest.mark.parametrize("mode_sel,k,expected", [(1, 1, [0]), (1, 2, [0, 2]), (0, 2, [3, 0])])
def test_ties_across_kept_groups_prefer_lower_index(mode_sel, k, expected):
    # Selection scores 0.5 + bias = (0.9, 0.1 | 0.9, 0.95 or 0.5): group 1 is the better group
    # (sum of two 1.4 or 1.85 against 1.0; max 0.95 against 0.9), both groups are kept, and
    # experts 0 and 2 tie: expert 0 must win although its group ranks second.
    bias = np.array([0.4, -0.4, 0.4, 0.45 if mode_sel == 0 else 0.0], np.float32)
    x = np.zeros((3, 4), np.float32)
    y, idx, _ = moe_gating_top_k(Tensor(x), k, Tensor(bias), k_group=2, group_count=2,
                                 group_select_mode=mode_sel)
    np.testing.assert_array_equal(numpy(idx), [expected] * 3)
    np.testing.assert_allclose(numpy(y), np.full((3, k), 1.0 / k), rtol=1e-6)  # all scores 0.5


@pytest.mark.parametrize("n,k", [(64, 40), (2048, 33), (96, 96)])
def test_ties_with_k_above_32_prefer_lower_index(n, k):
    # k > 32 takes the partial-sort path: all-equal logits must give experts 0..k-1 in order,
    # and a row of pairs (2 j, 2 j + 1 equal) must keep each pair's lower index first.
    x = np.zeros((2, n), np.float32)
    x[1] = -np.repeat(np.arange(n // 2), 2) / n  # descending pairs of equal scores
    _, idx, _ = moe_gating_top_k(Tensor(x), k)
    np.testing.assert_array_equal(numpy(idx), [np.arange(k), np.arange(k)])


@pytest.mark.parametrize("mode_sel", [0, 1])
def test_masked_groups_never_win_with_negative_bias(mode_sel):
    # Biased scores are all negative: a 0-fill of the dropped groups would make them win.
    x = distinct_logits(5, 16, seed=3).astype(np.float32)
    bias = np.full(16, -5.0, np.float32)
    bias[12:] = -4.0  # the last group is the best one
    _, idx, _ = moe_gating_top_k(Tensor(x), 4, Tensor(bias), k_group=1, group_count=4,
                                 group_select_mode=mode_sel)
    assert (numpy(idx) >= 12).all()
    _, ridx, _ = ref.moe_gating_top_k(x, 4, bias, k_group=1, group_count=4, group_select_mode=mode_sel)
    np.testing.assert_array_equal(numpy(idx), ridx)


def test_bias_selects_but_does_not_weigh():
    x = np.zeros((1, 4), np.float32)
    bias = np.array([0, 0, 0, 1], np.float32)
    y, idx, _ = moe_gating_top_k(Tensor(x), 2, Tensor(bias))
    np.testing.assert_array_equal(numpy(idx), [[3, 0]])
    np.testing.assert_allclose(numpy(y), [[0.5, 0.5]], rtol=1e-6)


@pytest.mark.parametrize("m,n,k", [(1, 2, 1), (3, 2, 2), (2, 2048, 8), (2, 64, 64), (1, 2048, 2048)])
def test_edge_shapes(m, n, k):
    x = distinct_logits(m, n, seed=n).astype(np.float32)
    y, idx, _ = moe_gating_top_k(Tensor(x), k)
    ry, ridx, _ = ref.moe_gating_top_k(x, k)
    np.testing.assert_array_equal(numpy(idx), ridx)
    assert_close(numpy(y), ry)


def test_nan_logits_stay_in_bounds():
    x = np.full((2, 8), np.nan, np.float32)
    _, idx, _ = moe_gating_top_k(Tensor(x), 3)
    assert ((numpy(idx) >= 0) & (numpy(idx) < 8)).all()


# -- backward -------------------------------------------------------------------------------------

SEED_X_NORM = np.array([0.5, 0.7, 0.3, 0.8, 0.2, 0.6, 0.9, 0.4, 0.6, 0.4, 0.8, 0.1, 0.7, 0.5, 0.3,
                        0.9, 0.2, 0.9, 0.5, 0.6, 0.8, 0.3, 0.7, 0.4, 0.8, 0.3, 0.6, 0.5, 0.4, 0.7,
                        0.2, 0.9], np.float32).reshape(4, 8)
SEED_GRAD_Y = np.array([1.0, 0.5, 0.8, 0.3, 0.6, 0.9, 0.4, 0.7], np.float32).reshape(4, 2)
SEED_IDX = np.array([3, 6, 2, 7, 1, 4, 0, 7], np.int32).reshape(4, 2)


def test_seed_example(mode):
    fn = lambda a, b, c: moe_gating_top_k_backward(a, b, c, routed_scaling_factor=2.5)  # noqa: E731
    out = numpy(run(fn, Tensor(SEED_X_NORM), Tensor(SEED_GRAD_Y), Tensor(SEED_IDX), mode=mode))
    # Row 0 by hand: g = (2.5, 1.25), w' = (0.8, 0.9), D = 1.7, beta = 3.125 / 1.7,
    # gw' = (g - beta) / D; grad_x = xn (1 - xn) gw' at experts 3 and 6, zero elsewhere.
    beta = (0.8 * 2.5 + 0.9 * 1.25) / 1.7
    expected0 = np.zeros(8)
    expected0[3] = 0.8 * 0.2 * (2.5 - beta) / 1.7
    expected0[6] = 0.9 * 0.1 * (1.25 - beta) / 1.7
    np.testing.assert_allclose(out[0], expected0, atol=1e-7)
    np.testing.assert_allclose(out, ref.moe_gating_top_k_backward(
        SEED_X_NORM, SEED_GRAD_Y, SEED_IDX, routed_scaling_factor=2.5), atol=1e-7)


def test_backward_dtypes(dtype):
    gy = rounded(SEED_GRAD_Y, dtype)
    out = moe_gating_top_k_backward(Tensor(SEED_X_NORM), tensor(gy, dtype), Tensor(SEED_IDX), eps=1e-6)
    assert out.dtype == tensor(gy, dtype).dtype
    assert_close(numpy(out), ref.moe_gating_top_k_backward(SEED_X_NORM, gy, SEED_IDX, eps=1e-6), dtype)


def test_backward_sums_duplicates():
    idx = np.array([[1, 1, 4]], np.int32)
    xn = np.linspace(0.1, 0.9, 6, dtype=np.float32)[None]
    gy = np.array([[1.0, -2.0, 0.5]], np.float32)
    out = numpy(moe_gating_top_k_backward(Tensor(xn), Tensor(gy), Tensor(idx)))
    expected = ref.moe_gating_top_k_backward(xn, gy, idx)
    np.testing.assert_allclose(out, expected, atol=1e-7)
    # the true derivative of y = w / sum(w) with a repeated expert is the sum of both slots
    single = ref.moe_gating_top_k_backward(xn, gy[:, :1], idx[:, :1])
    assert not np.allclose(expected, single)


@pytest.mark.parametrize("renorm", [0, 1])
def test_softmax_backward_kernel_matches_golden(renorm, rng):
    xn = ref._softmax(rng.normal(size=(5, 12))).astype(np.float32)
    gy = rng.normal(size=(5, 3)).astype(np.float32)
    idx = np.array([rng.permutation(12)[:3] for _ in range(5)], np.int32)
    idx[0, 1] = idx[0, 0]  # a duplicate
    args = (Tensor(xn), Tensor(gy), Tensor(idx))
    attrs = dict(renorm=renorm, routed_scaling_factor=1.5, eps=1e-6)
    out = numpy(GATING_SOFTMAX_BACKWARD(*args, **attrs))
    expected = ref.moe_gating_top_k_softmax_backward(xn, gy, idx, **attrs)
    assert_close(out, expected)



@pytest.mark.parametrize("softmax", [False, True])
@pytest.mark.parametrize("with_grad_x_norm", [False, True])
def test_whole_backward_kernel_matches_golden(softmax, with_grad_x_norm, dtype, mode, rng):
    # moe_gating_top_k_grad: the gradient through y and through x_norm, in one kernel
    logits = rng.normal(size=(6, 12))
    xn = (ref._softmax(logits) if softmax else 1 / (1 + np.exp(-logits))).astype(np.float32)
    gy = rounded(rng.normal(size=(6, 3)), dtype)
    idx = np.array([rng.permutation(12)[:3] for _ in range(6)], np.int32)
    idx[0, 1] = idx[0, 0]  # a duplicate: both gradients are summed
    dxn = rng.normal(size=(6, 12)).astype(np.float32) if with_grad_x_norm else None
    attrs = dict(norm_type=0 if softmax else 1, renorm=1, routed_scaling_factor=1.5, eps=1e-6)
    args = [Tensor(xn), tensor(gy, dtype), Tensor(idx)]

    def without_x_norm(x, g, i):
        return GATING_GRAD(x, g, i, None, **attrs)

    def with_x_norm(x, g, i, d):
        return GATING_GRAD(x, g, i, d, **attrs)

    if dxn is None:
        out = run(without_x_norm, *args, mode=mode)
    else:
        out = run(with_x_norm, *args, Tensor(dxn), mode=mode)
    assert out.dtype == tensor(gy, dtype).dtype
    assert_close(numpy(out), ref.moe_gating_top_k_grad(xn, gy, idx, dxn, **attrs), dtype)
    if not with_grad_x_norm and not softmax:  # unselected experts: exactly zero
        chosen = np.zeros_like(xn, bool)
        np.put_along_axis(chosen, idx, True, 1)
        assert not numpy(out)[~chosen].any()

# -- gradient of the forward against finite differences ------------------------------------------

@pytest.mark.parametrize("cfg", CONFIGS)
def test_forward_gradient_finite_differences(cfg, mode, rng):
    x = distinct_logits(3, 8, seed=7)
    c = rng.normal(size=(3, cfg["k"]))
    loss = lambda x: (moe_gating_top_k(x, **cfg)[0] * Tensor(c, ms.float32)).sum()  # noqa: E731
    g = numpy(grad(loss, Tensor(x.astype(np.float32)), mode=mode))
    fd = finite_diff(lambda v: (ref.moe_gating_top_k(v, **cfg)[0] * c).sum(), x)
    np.testing.assert_allclose(g, fd, atol=2e-5)


def test_x_norm_output_gradient_flows(rng):
    x = distinct_logits(2, 6, seed=1)
    c = rng.normal(size=(2, 6))
    loss = lambda x: (moe_gating_top_k(x, 2)[2] * Tensor(c, ms.float32)).sum()  # noqa: E731
    g = numpy(grad(loss, Tensor(x.astype(np.float32))))
    fd = finite_diff(lambda v: (ref.moe_gating_top_k(v, 2)[2] * c).sum(), x)
    np.testing.assert_allclose(g, fd, atol=1e-5)


@pytest.mark.parametrize("norm_type,renorm", [(0, 0), (0, 1), (1, 1)])
def test_x_norm_and_y_gradient_finite_differences(mode, norm_type, renorm, rng):
    # both outputs' gradients at once (the router's bprop, one moe_gating_top_k_grad call);
    # softmax scores: d x_norm / d x = diag(s) - s s^T, both terms; finite differences of a plain
    # numpy softmax or sigmoid, not the reference model
    x = distinct_logits(3, 8, seed=5)
    c, cy = rng.normal(size=(3, 8)), rng.normal(size=(3, 3))

    def loss(x):
        y, _, xn = moe_gating_top_k(x, 3, norm_type=norm_type, renorm=renorm)
        return (xn * Tensor(c, ms.float32)).sum() + (y * Tensor(cy, ms.float32)).sum()

    g = numpy(grad(loss, Tensor(x.astype(np.float32)), mode=mode))
    # fixed: the selection is piecewise constant
    idx = ref.moe_gating_top_k(x, 3, norm_type=norm_type)[1]

    def numpy_loss(v):
        if norm_type == 0:
            e = np.exp(v - v.max(axis=1, keepdims=True))
            s = e / e.sum(axis=1, keepdims=True)
        else:
            s = 1 / (1 + np.exp(-v))
        w = np.take_along_axis(s, idx, 1)
        if renorm:
            w = w / w.sum(axis=1, keepdims=True)
        return (s * c).sum() + (w * cy).sum()

    assert_close(g, finite_diff(numpy_loss, x), rtol=1e-4)


# -- bad inputs -------------------------------------------------------------------------------

X = Tensor(np.zeros((4, 8), np.float32))


@pytest.mark.parametrize("call,error,words", [
    (lambda: moe_gating_top_k(Tensor(np.zeros(8, np.float32)), 2), ValueError, "'x' must be 2-D"),
    (lambda: moe_gating_top_k(Tensor(np.zeros((4, 8), np.int32)), 2), TypeError, "'x' must have dtype"),
    (lambda: moe_gating_top_k(Tensor(np.zeros((4, 2049), np.float32)), 2), ValueError, "2048"),
    (lambda: moe_gating_top_k(X, 2, Tensor(np.zeros(7, np.float32))), ValueError, "'bias'"),
    (lambda: moe_gating_top_k(X, 2, Tensor(np.zeros(8, np.float16))), TypeError, "'bias'"),
    (lambda: moe_gating_top_k(X, 9), ValueError, "'k'"),
    (lambda: moe_gating_top_k(X, 0), ValueError, "'k'"),
    (lambda: moe_gating_top_k(X, 2.0), TypeError, "'k'"),
    (lambda: moe_gating_top_k(X, 2, group_count=3, k_group=1), ValueError, "group_count"),
    (lambda: moe_gating_top_k(X, 2, group_count=2, k_group=3), ValueError, "k_group"),
    (lambda: moe_gating_top_k(X, 5, group_count=4, k_group=2), ValueError, "'k'"),
    (lambda: moe_gating_top_k(X, 2, group_count=8, k_group=2, group_select_mode=1), ValueError, "2 experts per group"),
    (lambda: moe_gating_top_k(X, 2, group_select_mode=2), ValueError, "group_select_mode"),
    (lambda: moe_gating_top_k(X, 2, norm_type=2), ValueError, "norm_type"),
    (lambda: moe_gating_top_k(X, 2, renorm=3), ValueError, "renorm"),
])
def test_forward_bad_inputs(call, error, words):
    with pytest.raises(error, match=words):
        call()


XN, GY, IDX = Tensor(SEED_X_NORM), Tensor(SEED_GRAD_Y), Tensor(SEED_IDX)


@pytest.mark.parametrize("call,error,words", [
    (lambda: moe_gating_top_k_backward(XN, GY, IDX, norm_type=0), ValueError, "norm_type"),
    (lambda: moe_gating_top_k_backward(Tensor(SEED_X_NORM.astype(np.float16)), GY, IDX), TypeError, "'x_norm'"),
    (lambda: moe_gating_top_k_backward(XN, Tensor(SEED_GRAD_Y.astype(np.int32)), IDX), TypeError, "'grad_y'"),
    (lambda: moe_gating_top_k_backward(XN, GY, Tensor(SEED_IDX.astype(np.int64))), TypeError, "'expert_idx'"),
    (lambda: moe_gating_top_k_backward(XN, GY, Tensor(SEED_IDX[:, :1].copy())), ValueError, "'expert_idx'"),
    (lambda: moe_gating_top_k_backward(XN, Tensor(SEED_GRAD_Y[:3].copy()), IDX), ValueError, "'grad_y'"),
    (lambda: moe_gating_top_k_backward(Tensor(np.zeros((4, 1), np.float32)), Tensor(np.zeros((4, 1), np.float32)),
                                       Tensor(np.zeros((4, 1), np.int32))), ValueError, "N"),
    (lambda: moe_gating_top_k_backward(XN[:, :2], Tensor(np.zeros((4, 3), np.float32)),
                                       Tensor(np.zeros((4, 3), np.int32))), ValueError, "K"),
    (lambda: moe_gating_top_k_backward(Tensor(SEED_X_NORM[0]), GY, IDX), ValueError, "'x_norm' must be 2-D"),
])
def test_backward_bad_inputs(call, error, words):
    with pytest.raises(error, match=words):
        call()


def test_backward_two_experts():
    # the smallest valid N (2), duplicates included; read, so that a kernel error would surface
    xn = SEED_X_NORM[:, :2].copy()
    out = numpy(moe_gating_top_k_backward(Tensor(xn), GY, Tensor(SEED_IDX % 2)))
    expected = ref.moe_gating_top_k_backward(xn, SEED_GRAD_Y, SEED_IDX % 2)
    assert out.shape == (4, 2) and np.abs(expected).min() > 1e-3
    assert_close(out, expected)


@needs_kernels("a data fault is found by this package's CPU kernels")
@pytest.mark.parametrize("bad", [-1, 8, 2 ** 31 - 1])
@pytest.mark.slow_in_graph
def test_backward_index_out_of_range_is_a_clean_error(bad, mode):
    idx = SEED_IDX.copy()
    idx[2, 1] = bad
    fn = lambda a, b, c: moe_gating_top_k_backward(a, b, c)  # noqa: E731
    with pytest.raises(RuntimeError):
        numpy(run(fn, XN, GY, Tensor(idx), mode=mode))


@pytest.mark.parametrize("call,error,words", [
    (lambda: GATING_GRAD(XN, GY, IDX, Tensor(SEED_X_NORM.astype(np.float16))), TypeError,
     "moe_gating_top_k_grad.*'grad_x_norm'"),
    (lambda: GATING_GRAD(XN, GY, IDX, Tensor(SEED_X_NORM[:, :4].copy())), ValueError,
     "moe_gating_top_k_grad.*'grad_x_norm'"),
    (lambda: GATING_GRAD(XN, GY, IDX, XN, norm_type=2), ValueError, "'norm_type'"),
    (lambda: GATING_GRAD(XN, GY, IDX, XN, norm_type=0, renorm=2), ValueError, "'renorm'"),
    (lambda: GATING_GRAD(XN, Tensor(SEED_GRAD_Y.astype(np.int32)), IDX, XN), TypeError, "'grad_y'"),
    (lambda: GATING_GRAD(XN, GY, Tensor(SEED_IDX.astype(np.int64)), None), TypeError, "'expert_idx'"),
    (lambda: GATING_GRAD(XN, Tensor(SEED_GRAD_Y[:3].copy()), IDX, XN), ValueError, "'grad_y'"),
])
def test_whole_backward_bad_inputs(call, error, words):
    with pytest.raises(error, match=words):
        call()


@needs_kernels("a data fault is found by this package's CPU kernels")
@pytest.mark.parametrize("norm_type", [0, 1])
@pytest.mark.slow_in_graph
def test_whole_backward_index_out_of_range_is_a_clean_error(norm_type, mode):
    idx = SEED_IDX.copy()
    idx[1, 0] = 8
    fn = lambda a, b, c, d: GATING_GRAD(a, b, c, d, norm_type=norm_type)  # noqa: E731
    with pytest.raises(RuntimeError):
        numpy(run(fn, XN, GY, Tensor(idx), XN, mode=mode))


# -- the Cell ---------------------------------------------------------------------------------

class _RouterLoss(nn.Cell):
    def __init__(self, router, target):
        super().__init__()
        self.router = router
        self.target = Tensor(target, ms.float32)

    def construct(self, x):
        weights, idx = self.router(x)
        return ((weights - self.target) ** 2).sum()


@pytest.mark.parametrize("score_func,norm", [("sigmoid", True), ("sigmoid", False), ("softmax", True)])
def test_cell_matches_reference(score_func, norm, rng):
    cell = GatingTopK(8, 8, 2, n_group=2, topk_group=1, score_func=score_func, norm_topk_prob=norm,
                      routed_scaling_factor=2.0)
    cell.weight.set_data(Tensor(rng.normal(0, 0.5, (8, 8)).astype(np.float32)))
    h = rng.normal(size=(2, 3, 8)).astype(np.float32)
    w, idx = cell(Tensor(h, ms.bfloat16))
    logits = rounded(h, "bfloat16").reshape(6, 8) @ cell.weight.asnumpy().T.astype(np.float64)
    ry, ridx, rxn = ref.moe_gating_top_k(logits, 2, k_group=1, group_count=2, group_select_mode=1,
                                         renorm=int(norm), norm_type=int(score_func == "sigmoid"),
                                         routed_scaling_factor=2.0)
    if score_func == "sigmoid" and not norm:
        ry = np.take_along_axis(rxn, ridx, 1) * 2.0
    assert w.dtype == ms.float32 and w.shape == (6, 2)
    np.testing.assert_array_equal(numpy(idx), ridx)
    assert_close(numpy(w), ry, rtol=1e-4)
    np.testing.assert_array_equal(cell.load(), np.bincount(ridx.ravel(), minlength=8))


def test_cell_trains(mode, rng):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        cell = GatingTopK(16, 8, 2, n_group=4, topk_group=2, bias_update_rate=0.05)
        cell.weight.set_data(Tensor(rng.normal(0, 0.3, (8, 16)).astype(np.float32)))
        x = Tensor(rng.normal(size=(64, 16)).astype(np.float32))
        # every token wants weight 0.9 on its first expert
        net = nn.TrainOneStepCell(_RouterLoss(cell, np.tile([0.9, 0.1], (64, 1))),
                                  nn.Adam(cell.trainable_params(), 0.05))
        losses = [float(net(x).asnumpy()) for _ in range(20)]
        # the loss falls by 33-42% over these 20 steps for any seed tried
        assert losses[-1] < 0.75 * losses[0], losses
        assert cell.load().sum() == 20 * 64 * 2
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


def test_bias_update_moves_load_toward_balance(rng):
    # Scores spread over about +-0.1 (router weights set here), a selection bias of 0.5 that
    # sends almost every token to experts 0 and 1, and bias steps of 0.02: the sign updates
    # remove the head start in 25 steps and then hover around balance with steps much smaller
    # than the spread of the scores, so the load stays near balanced.
    cell = GatingTopK(16, 8, 2, bias_update_rate=0.02)
    cell.weight.set_data(Tensor(rng.normal(0, 0.1, (8, 16)).astype(np.float32)))
    bias = np.zeros(8, np.float32)
    bias[:2] = 0.5
    cell.expert_bias.set_data(Tensor(bias))
    x = Tensor(rng.normal(size=(512, 16)).astype(np.float32))
    imbalance = []
    for _ in range(50):
        cell(x)
        load = cell.load()
        assert load.sum() == 512 * 2
        imbalance.append(load.max() / load.mean())
        cell.update_expert_bias()
        assert cell.load().sum() == 0
    assert imbalance[0] > 3.5, imbalance  # experts 0 and 1 start with nearly all 1024 slots
    assert max(imbalance[-10:]) < 1.6, imbalance
    final = cell.expert_bias.asnumpy()
    assert (final[:2] < 0.5).all() and (final[2:] > 0).all(), final


@pytest.mark.parametrize("kwargs,message", [
    (dict(score_func="relu"), "GatingTopK: score_func must be 'sigmoid' or 'softmax', got 'relu'"),
    (dict(top_k=0), "GatingTopK: top_k must be an int >= 1, got 0"),
    (dict(n_group=3), "GatingTopK: num_experts=8 is not divisible by n_group=3"),
    (dict(top_k=10), "GatingTopK: top_k=10 > num_experts=8"),
    (dict(top_k=5, n_group=4, topk_group=1), "GatingTopK: top_k=5 > the experts of the kept "
     "groups: topk_group * num_experts / n_group = 1 * 8 / 4 = 2"),
    (dict(top_k=5, n_group=4, topk_group=2), "GatingTopK: top_k=5 > the experts of the kept "
     "groups: topk_group * num_experts / n_group = 2 * 8 / 4 = 4"),
    (dict(n_group=2, topk_group=3), "GatingTopK: topk_group=3 > n_group=2"),
])
def test_cell_bad_config(kwargs, message):
    """Each condition of the group-limited choice has its own message, naming the values that
    break it (one message once listed every condition)."""
    args = dict(hidden_size=8, num_experts=8, top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=re.escape(message)):
        GatingTopK(**args)


@pytest.mark.parametrize("kwargs", [dict(top_k=8), dict(top_k=2, n_group=4, topk_group=1),
                                    dict(top_k=4, n_group=4, topk_group=2),
                                    dict(n_group=2, topk_group=2),
                                    dict(n_group=8, top_k=1, group_select_mode=0)])
def test_cell_config_at_the_bounds(kwargs):
    GatingTopK(**dict(dict(hidden_size=8, num_experts=8, top_k=2), **kwargs))


@pytest.mark.parametrize("kwargs,message", [
    (dict(num_experts=4, n_group=4, topk_group=2),
     "GatingTopK(num_experts=4, n_group=4, topk_group=2, top_k=2, group_select_mode=1) cannot "
     "route: moe_gating_top_k: group_select_mode=1 needs at least 2 experts per group"),
    (dict(num_experts=4096), "GatingTopK(num_experts=4096, n_group=1, topk_group=1, top_k=2, "
     "group_select_mode=0) cannot route: moe_gating_top_k: the expert count N"),
], ids=["one-expert-per-group-mode-1", "too-many-experts"])
def test_cell_refuses_when_built_what_its_first_call_would(kwargs, message):
    """The router's own contract is checked when the Cell is built, in the Cell's terms."""
    with pytest.raises(ValueError, match=re.escape(message)):
        GatingTopK(hidden_size=8, top_k=2, **kwargs)
    GatingTopK(hidden_size=8, top_k=2, **dict(kwargs, group_select_mode=0, num_experts=min(
        kwargs["num_experts"], 2048)))  # what it says to change is enough
