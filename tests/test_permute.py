"""moe_token_permute, moe_token_unpermute and the unpermute backward."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from ms_moe_ops import reference as ref
from ms_moe_ops.ops.permute import (moe_token_permute, moe_token_unpermute,
                                    moe_token_unpermute_backward)
from conftest import (assert_close, assert_rounded, finite_diff, grad, needs_kernels, numpy,
                      rounded, run, tensor)

pytestmark = pytest.mark.every_isa  # the kernels run under every instruction-set path



def routing(t, k, e, seed=0):
    """[T, K] int32 expert ids, distinct per token (as a router gives them)."""
    rng = np.random.default_rng(seed)
    return np.array([rng.choice(e, k, replace=False) for _ in range(t)], np.int32)


def permuted_case(t, k, h, e, dtype, seed=0):
    """(x, expert_idx, golden permuted, golden sorted_index, golden counts)."""
    x = rounded(np.random.default_rng(seed).normal(size=(t, h)), dtype)
    idx = routing(t, k, e, seed)
    return (x, idx) + ref.moe_token_permute(x, idx, e)


# -- forward --------------------------------------------------------------------------------------

@pytest.mark.parametrize("t,k,h,e", [(7, 3, 5, 6), (1, 4, 3, 8), (9, 1, 4, 3), (5, 2, 1, 64)])
def test_permute_matches_reference(t, k, h, e, dtype):
    x, idx, rp, rs, rc = permuted_case(t, k, h, e, dtype)
    p, s, c = moe_token_permute(tensor(x, dtype), Tensor(idx), e)
    assert p.dtype == tensor(x, dtype).dtype and s.dtype == ms.int32 and c.dtype == ms.int64
    np.testing.assert_array_equal(numpy(s), rs)
    np.testing.assert_array_equal(numpy(c), rc)
    np.testing.assert_array_equal(numpy(p), rp)  # bitwise copies


def test_permute_is_stable_and_grouped():
    # every slot goes to expert 2 or 0: rows of one expert keep the (token, slot) order
    idx = np.array([[2, 0], [2, 0], [0, 2], [2, 2]], np.int32)
    x = np.arange(4, dtype=np.float32)[:, None] * np.ones((1, 3), np.float32)
    p, s, c = moe_token_permute(Tensor(x), Tensor(idx), 4)
    np.testing.assert_array_equal(numpy(c), [3, 0, 5, 0])  # experts 1 and 3 get no token
    # expert 0: slots (0,1), (1,1), (2,0); expert 2: (0,0), (1,0), (2,1), (3,0), (3,1)
    np.testing.assert_array_equal(numpy(s), [3, 0, 4, 1, 2, 5, 6, 7])
    np.testing.assert_array_equal(numpy(p)[:, 0], [0, 1, 2, 0, 1, 2, 3, 3])


def test_permute_seed_example(mode):
    # MindSpore's moe_token_permute docstring example (K = 1)
    tokens = np.array([[1] * 3, [7] * 3, [2] * 3, [1] * 3, [2] * 3, [3] * 3], np.float32)
    idx = np.array([[5], [0], [3], [1], [2], [4]], np.int32)
    fn = lambda x, i: moe_token_permute(x, i, 6)  # noqa: E731
    p, s, c = run(fn, tensor(tokens, "bfloat16"), Tensor(idx), mode=mode)
    np.testing.assert_array_equal(numpy(p)[:, 0], [7, 1, 2, 2, 3, 1])
    np.testing.assert_array_equal(numpy(s), [5, 0, 3, 1, 2, 4])
    np.testing.assert_array_equal(numpy(c), [1] * 6)


def test_unpermute_seed_example():
    # MindSpore's moe_token_unpermute docstring example: no probs, K = 1
    rows = np.array([1, 0, 0, 3, 2, 1, 2, 3], np.float32)[:, None] * np.ones((1, 3), np.float32)
    index = np.array([0, 6, 7, 5, 3, 1, 2, 4], np.int32)
    out = moe_token_unpermute(tensor(rows, "bfloat16"), Tensor(index))
    np.testing.assert_array_equal(numpy(out)[:, 0], rows[index, 0])


@pytest.mark.parametrize("probs_dtype", ["float32", "same", None])
def test_unpermute_matches_reference(dtype, probs_dtype, rng):
    _, _, rp, rs, _ = permuted_case(6, 3, 5, 4, dtype, seed=1)
    probs = None
    if probs_dtype is not None:
        pd = dtype if probs_dtype == "same" else "float32"
        probs = rounded(rng.uniform(0.1, 1, (6, 3)), pd)
    out = moe_token_unpermute(tensor(rp, dtype), Tensor(rs),
                              None if probs is None else tensor(probs, pd), top_k=3)
    assert out.dtype == tensor(rp, dtype).dtype and out.shape == (6, 5)
    assert_close(numpy(out), ref.moe_token_unpermute(rp, rs, probs, top_k=3), dtype)


def test_unpermute_inverts_permute(mode):
    x, idx, *_ = permuted_case(8, 4, 6, 5, "float32", seed=2)

    def round_trip(x, i):
        p, s, _ = moe_token_permute(x, i, 5)
        return moe_token_unpermute(p, s, None, 4)

    out = run(round_trip, Tensor(x.astype(np.float32)), Tensor(idx), mode=mode)
    np.testing.assert_allclose(numpy(out), 4 * x, rtol=1e-6)


@pytest.mark.parametrize("with_probs", [True, False])
def test_unpermute_backward_matches_reference(dtype, with_probs, rng):
    _, _, rp, rs, _ = permuted_case(5, 2, 4, 3, dtype, seed=3)
    probs = rounded(rng.uniform(0.1, 1, (5, 2)), dtype) if with_probs else None
    g = rounded(rng.normal(size=(5, 4)), dtype)
    dp, dq = moe_token_unpermute_backward(tensor(rp, dtype), Tensor(rs),
                                          None if probs is None else tensor(probs, dtype),
                                          tensor(g, dtype), top_k=2)
    rdp, rdq = ref.moe_token_unpermute_backward(rp, rs, probs, g, top_k=2)
    assert dp.dtype == tensor(rp, dtype).dtype
    assert dq.dtype == (tensor(probs, dtype).dtype if with_probs else ms.float32)
    assert_close(numpy(dp), rdp, dtype)
    assert_close(numpy(dq), rdq, dtype)




# -- gradients against finite differences ------------------------------------------------------

def test_permute_gradient_finite_differences(mode, rng):
    x, idx, *_ = permuted_case(4, 3, 3, 5, "float32", seed=6)
    c = rng.normal(size=(12, 3))
    loss = lambda x, i: (moe_token_permute(x, i, 5)[0] * Tensor(c, ms.float32)).sum()  # noqa: E731
    g = numpy(grad(loss, Tensor(x.astype(np.float32)), Tensor(idx), mode=mode))
    fd = finite_diff(lambda v: (ref.moe_token_permute(v, idx, 5)[0] * c).sum(), x)
    np.testing.assert_allclose(g, fd, atol=1e-5)


def test_unpermute_gradient_finite_differences(mode, rng):
    _, _, rp, rs, _ = permuted_case(4, 3, 3, 5, "float32", seed=7)
    probs = rng.uniform(0.1, 1, (4, 3))
    c = rng.normal(size=(4, 3))
    loss = lambda p, s, q: (moe_token_unpermute(p, s, q) * Tensor(c, ms.float32)).sum()  # noqa: E731
    gp, gq = grad(loss, Tensor(rp.astype(np.float32)), Tensor(rs),
                  Tensor(probs.astype(np.float32)), mode=mode, argnums=(0, 2))
    fd_p = finite_diff(lambda v: (ref.moe_token_unpermute(v, rs, probs) * c).sum(), rp)
    fd_q = finite_diff(lambda v: (ref.moe_token_unpermute(rp, rs, v) * c).sum(), probs)
    np.testing.assert_allclose(numpy(gp), fd_p, atol=1e-5)
    np.testing.assert_allclose(numpy(gq), fd_q, atol=1e-5)


def test_unweighted_unpermute_gradient(rng):
    _, _, rp, rs, _ = permuted_case(3, 2, 4, 3, "float32", seed=8)
    c = rng.normal(size=(3, 4))
    loss = lambda p, s: (moe_token_unpermute(p, s, None, 2) * Tensor(c, ms.float32)).sum()  # noqa: E731
    gp = numpy(grad(loss, Tensor(rp.astype(np.float32)), Tensor(rs)))
    fd = finite_diff(lambda v: (ref.moe_token_unpermute(v, rs, None, 2) * c).sum(), rp)
    np.testing.assert_allclose(gp, fd, atol=1e-5)


def test_gradient_half_precision(dtype, rng):
    # the backward kernels in every dtype: gradient of permute -> weighted unpermute. Each
    # kernel rounds once: the expectation is the same chain in float64, rounded where it rounds
    # (the forward's out; then grad_permuted and grad_probs from the unpermute backward, and the
    # permute backward's sum of a token's K rows); every gradient within half an ulp of it.
    x, idx, rows, index, _ = permuted_case(5, 2, 4, 3, dtype, seed=9)
    probs = rounded(rng.uniform(0.1, 1, (5, 2)), dtype)

    def loss(x, i, q):
        p, s, _ = moe_token_permute(x, i, 3)
        return (moe_token_unpermute(p, s, q).astype(ms.float32) ** 2).sum()

    gx, gq = grad(loss, tensor(x, dtype), Tensor(idx), tensor(probs, dtype), argnums=(0, 2))
    out = rounded(ref.moe_token_unpermute(rows, index, probs), dtype)
    g_rows, g_probs = ref.moe_token_unpermute_backward(rows, index, probs, 2 * out)
    g_x = ref.moe_token_unpermute(rounded(g_rows, dtype), index, top_k=2)
    assert_rounded(numpy(gq), g_probs, dtype, err=1e-6 * ref.moe_token_unpermute_backward(
        np.abs(rows), index, probs, 2 * np.abs(out))[1])
    assert_rounded(numpy(gx), g_x, dtype, err=1e-6 * np.abs(g_x))
    # and, loosely, the float64 derivative of the loss: d/dx = 2 w^2 x with w = sum_k probs
    w = probs.sum(axis=1, keepdims=True)
    assert_close(numpy(gx), 2 * w ** 2 * x, dtype, rtol=4 * 2.0 ** -8)


# -- bad inputs -------------------------------------------------------------------------------

X = Tensor(np.zeros((4, 3), np.float32))
IDX = Tensor(np.zeros((4, 2), np.int32))
ROWS = Tensor(np.zeros((8, 3), np.float32))
SORTED = Tensor(np.arange(8, dtype=np.int32))
PROBS = Tensor(np.ones((4, 2), np.float32))


@pytest.mark.parametrize("call,error,words", [
    (lambda: moe_token_permute(Tensor(np.zeros((4, 3), np.int32)), IDX, 4), TypeError, "'x' must have dtype"),
    (lambda: moe_token_permute(X, Tensor(np.zeros((4, 2), np.int64)), 4), TypeError, "'expert_idx'"),
    (lambda: moe_token_permute(Tensor(np.zeros(4, np.float32)), IDX, 4), ValueError, "'x' must be 2-D"),
    (lambda: moe_token_permute(X, Tensor(np.zeros(4, np.int32)), 4), ValueError, "'expert_idx' must be 2-D"),
    (lambda: moe_token_permute(X, Tensor(np.zeros((3, 2), np.int32)), 4), ValueError, "T=4"),
    (lambda: moe_token_permute(X, IDX, 0), ValueError, "num_experts"),
    (lambda: moe_token_permute(X, IDX, 4.0), TypeError, "num_experts"),
    (lambda: moe_token_unpermute(Tensor(np.zeros((8, 3), np.int32)), SORTED), TypeError, "'permuted'"),
    (lambda: moe_token_unpermute(ROWS, SORTED.astype(ms.int64)), TypeError, "'sorted_index'"),
    (lambda: moe_token_unpermute(ROWS.astype(ms.float16), SORTED, PROBS.astype(ms.bfloat16)), TypeError, "'probs'"),
    (lambda: moe_token_unpermute(ROWS[0], SORTED), ValueError, "'permuted' must be 2-D"),
    (lambda: moe_token_unpermute(ROWS, SORTED[:7]), ValueError, "'sorted_index'"),
    (lambda: moe_token_unpermute(ROWS, SORTED, Tensor(np.ones((3, 2), np.float32))), ValueError, "'probs'"),
    (lambda: moe_token_unpermute(ROWS, SORTED, PROBS, top_k=4), ValueError, "top_k"),
    (lambda: moe_token_unpermute(ROWS, SORTED, None, top_k=3), ValueError, "top_k"),
    (lambda: moe_token_unpermute(ROWS, SORTED, None, top_k=-1), ValueError, "top_k"),
    (lambda: moe_token_unpermute_backward(ROWS, SORTED, PROBS, Tensor(np.zeros((4, 2), np.float32))), ValueError, "'grad_out'"),
    (lambda: moe_token_unpermute_backward(ROWS, SORTED, PROBS, Tensor(np.zeros((4, 3), np.float16))), TypeError, "'grad_out'"),
])
def test_bad_inputs(call, error, words):
    with pytest.raises(error, match=words):
        call()


@needs_kernels("a data fault is found by this package's CPU kernels")
@pytest.mark.parametrize("bad", [-1, 4, 2 ** 31 - 1])
@pytest.mark.slow_in_graph
def test_permute_index_out_of_range_is_a_clean_error(bad, mode):
    idx = np.zeros((4, 2), np.int32)
    idx[3, 1] = bad
    with pytest.raises(RuntimeError):
        fn = lambda x, i: moe_token_permute(x, i, 4)[0]  # noqa: E731
        numpy(run(fn, X, Tensor(idx), mode=mode))


@needs_kernels("a data fault is found by this package's CPU kernels")
@pytest.mark.parametrize("index", [[0, 1, 2, 3, 4, 5, 6, 8], [0, 1, 2, 3, -1, 5, 6, 7],
                                   [0, 1, 2, 3, 4, 5, 6, 6]])
@pytest.mark.slow_in_graph
def test_unpermute_bad_sorted_index_is_a_clean_error(index, mode):
    index = Tensor(np.array(index, np.int32))
    fn = lambda p, s, q: moe_token_unpermute(p, s, q)  # noqa: E731
    with pytest.raises(RuntimeError):
        numpy(run(fn, ROWS, index, PROBS, mode=mode))
    with pytest.raises(RuntimeError):
        g = Tensor(np.ones((4, 3), np.float32))
        numpy(moe_token_unpermute_backward(ROWS, index, PROBS, g)[0])


@pytest.mark.parametrize("impl", [pytest.param("kernel", marks=needs_kernels()), "composition"])
def test_unpermute_backward_of_empty_rows_is_zero(impl, monkeypatch, rng):
    # H = 0: grad_probs is the empty sum, exactly 0 (MindSpore's ReduceSum leaves the output of an
    # empty input unset: the composition must not sum there)
    from ms_moe_ops.ops import _platform  # pylint: disable=import-outside-toplevel

    monkeypatch.setenv(_platform.IMPL_ENV, impl)
    t, k = 6, 3
    index = ref.moe_token_permute(np.zeros((t, 0)), rng.integers(0, 4, (t, k)).astype(np.int32), 4)[1]
    for _ in range(3):
        _, d_probs = moe_token_unpermute_backward(Tensor(np.zeros((t * k, 0), np.float32)),
                                                  Tensor(index), Tensor(rng.uniform(size=(t, k)).astype(np.float32)),
                                                  Tensor(np.zeros((t, 0), np.float32)))
        np.testing.assert_array_equal(numpy(d_probs), np.zeros((t, k)))
