"""Exact rounding of every float16/bfloat16 output: each element is the float32 result rounded to
nearest-even, so it lies within half an ulp of the float64 golden value computed on the same
(rounded) inputs, up to the float32 arithmetic's own small error (see conftest.assert_rounded).
A truncating conversion, a conversion done twice or a half-precision intermediate is off by up to
a whole ulp in about half of the elements and fails.

Shapes are chosen so that every vectorised conversion path runs along with its scalar tail
(16-wide bfloat16 and 8-wide float16 blocks), on every instruction-set path."""
import numpy as np
import pytest
from mindspore import Tensor

from ms_moe_ops import (grouped_matmul, moe_ffn, moe_gating_top_k, moe_gating_top_k_backward,
                        moe_token_unpermute, reference as ref)
from ms_moe_ops.ops.ffn import FFN_ACTIVATION_GRAD
from ms_moe_ops.ops.gating import GATING_GRAD, GATING_SOFTMAX_BACKWARD
from ms_moe_ops.ops.permute import moe_token_unpermute_backward
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP, swiglu_group_quant_grad
from conftest import assert_rounded, needs_kernels, numpy, rounded, tensor

pytestmark = pytest.mark.every_isa  # the kernels run under every instruction-set path
HALF = pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
EPS32 = 2.0 ** -24  # float32's unit roundoff


@HALF
@pytest.mark.parametrize("norm_type,renorm", [(1, 1), (0, 0), (0, 1)])
def test_router_y(dtype, norm_type, renorm, rng):
    # selection made on well separated scores so it does not depend on the precision
    perm = np.array([rng.permutation(48) for _ in range(5)])
    x = rounded((perm - 24) / 8.0 + rng.uniform(-0.02, 0.02, (5, 48)), dtype)
    y, idx, _ = moe_gating_top_k(tensor(x, dtype), 20, norm_type=norm_type, renorm=renorm,
                                 routed_scaling_factor=2.5)
    ry, ridx, _ = ref.moe_gating_top_k(x, 20, norm_type=norm_type, renorm=renorm,
                                       routed_scaling_factor=2.5)
    np.testing.assert_array_equal(numpy(idx), ridx)
    assert_rounded(numpy(y), ry, dtype, err=16 * EPS32 * np.abs(ry))


def _router_grad_inputs(rng, dtype, softmax):
    xn = rng.uniform(0.05, 0.95, (6, 40))
    if softmax:
        xn = xn / xn.sum(axis=1, keepdims=True)
    xn = xn.astype(np.float32)
    gy = rounded(rng.normal(size=(6, 5)), dtype)
    idx = np.array([rng.permutation(40)[:5] for _ in range(6)], np.int32)
    return xn, gy, idx


@HALF
def test_router_backward(dtype, rng):
    xn, gy, idx = _router_grad_inputs(rng, dtype, softmax=False)
    out = moe_gating_top_k_backward(Tensor(xn), tensor(gy, dtype), Tensor(idx),
                                    routed_scaling_factor=1.5)
    exact = ref.moe_gating_top_k_backward(xn, gy, idx, routed_scaling_factor=1.5)
    # gn = (g - beta) / D cancels: bound the float32 error by the terms' size
    w = np.take_along_axis(xn.astype(np.float64), idx, 1)
    d = w.sum(1, keepdims=True)
    terms = np.zeros_like(exact)
    np.put_along_axis(terms, idx, 1.5 * (np.abs(gy) + np.abs(gy * w).sum(1, keepdims=True) / d) / d, 1)
    assert_rounded(numpy(out), exact, dtype, err=16 * EPS32 * xn * (1 - xn) * terms)


@HALF
@pytest.mark.parametrize("renorm", [0, 1])
def test_router_softmax_backward(dtype, renorm, rng):
    xn, gy, idx = _router_grad_inputs(rng, dtype, softmax=True)
    out = GATING_SOFTMAX_BACKWARD(Tensor(xn), tensor(gy, dtype), Tensor(idx), renorm=renorm,
                                  routed_scaling_factor=1.5)
    exact = ref.moe_gating_top_k_softmax_backward(xn, gy, idx, renorm, 1.5)
    scale = 1.5 * np.abs(gy).sum(1, keepdims=True) * (4.0 if renorm else 1.0) / (
        np.take_along_axis(xn, idx, 1).sum(1, keepdims=True) if renorm else 1.0)
    assert_rounded(numpy(out), exact, dtype, err=16 * EPS32 * xn * scale)


@HALF
@pytest.mark.parametrize("norm_type", [0, 1])
def test_router_whole_backward(dtype, norm_type, rng):
    # moe_gating_top_k_grad: grad_y's and grad_x_norm's parts added in float32, rounded once
    xn, gy, idx = _router_grad_inputs(rng, dtype, softmax=norm_type == 0)
    dxn = rng.normal(size=xn.shape).astype(np.float32)
    out = GATING_GRAD(Tensor(xn), tensor(gy, dtype), Tensor(idx), Tensor(dxn), norm_type=norm_type,
                      renorm=1, routed_scaling_factor=1.5)
    exact = ref.moe_gating_top_k_grad(xn, gy, idx, dxn, norm_type, 1, 1.5)
    # every term is at most xn times the sum of the magnitudes it is made of
    size = 1.5 * 4.0 * np.abs(gy).sum(1, keepdims=True) / np.take_along_axis(
        xn, idx, 1).sum(1, keepdims=True) + 2 * np.abs(dxn).sum(1, keepdims=True)
    assert_rounded(numpy(out), exact, dtype, err=16 * EPS32 * xn * size)


def _swiglu_inputs(rng, dtype, rows=5, h=40):
    x = rounded(rng.uniform(-3, 3, (rows, 2 * h)), dtype)
    w = rng.uniform(0.1, 1.0, (rows, 1)).astype(np.float32)
    gy = rounded(rng.normal(size=(rows, h)), dtype)
    return x, w, gy


@HALF
@pytest.mark.parametrize("clamp", [0.0, 1.7])
def test_swiglu_forward(dtype, clamp, rng):
    x, w, _ = _swiglu_inputs(rng, dtype)
    y, y_origin = SWIGLU_GROUP(tensor(x, dtype), Tensor(w), None, clamp_limit=clamp)
    assert_rounded(numpy(y), ref.swiglu_group(x, w, clamp_limit=clamp), dtype)
    assert_rounded(numpy(y_origin), ref.swiglu_group(x, clamp_limit=clamp), dtype)


@HALF
def test_swiglu_backward(dtype, rng):
    x, w, gy = _swiglu_inputs(rng, dtype)
    yo = rounded(ref.swiglu_group(x), dtype)
    gx, _ = swiglu_group_quant_grad(tensor(gy, dtype), tensor(x, dtype), Tensor(w),
                                    tensor(yo, dtype))
    exact = ref.swiglu_group_quant_grad(gy, x, w, yo)[0]
    # gate gradient: gy * b * s * (1 + a (1 - s)) cancels near a = -1.28
    a, b = x[:, :40], x[:, 40:]
    s = 1 / (1 + np.exp(-a))
    size = np.concatenate([np.abs(b) * (1 + np.abs(a)), np.abs(a)], axis=1) * np.tile(np.abs(gy * w) * s, 2)
    assert_rounded(numpy(gx), exact, dtype, err=16 * EPS32 * size)


def _products(dtype, rng, m=37, k=24, n=40, counts=(20, 0, 17)):
    g = len(counts)
    x = rounded(rng.normal(size=(m, k)), dtype)
    w = rounded(rng.normal(size=(g, k, n)), dtype)
    b = rounded(rng.normal(size=(g, n)), dtype)
    dy = rounded(rng.normal(size=(m, n)), dtype)
    return x, w, b, dy, np.array(counts, np.int64)


@HALF
def test_grouped_matmul(dtype, rng):
    x, w, b, dy, gl = _products(dtype, rng)
    t = lambda a: tensor(a, dtype)  # noqa: E731
    y = grouped_matmul(t(x), t(w), tensor(gl), t(b))
    size = ref.grouped_matmul(np.abs(x), np.abs(w), gl, np.abs(b))
    assert_rounded(numpy(y), ref.grouped_matmul(x, w, gl, b), dtype, err=4 * 24 * EPS32 * size)
    yt = grouped_matmul(t(x), t(w.transpose(0, 2, 1).copy()), tensor(gl), transpose_weight=True)
    assert_rounded(numpy(yt), ref.grouped_matmul(x, w, gl), dtype,
                   err=4 * 24 * EPS32 * ref.grouped_matmul(np.abs(x), np.abs(w), gl))
    dw = grouped_matmul(t(x), t(dy), tensor(gl), transpose_x=True)
    size = ref.grouped_matmul(np.abs(x), np.abs(dy), gl, transpose_x=True)
    assert_rounded(numpy(dw), ref.grouped_matmul(x, dy, gl, transpose_x=True), dtype,
                   err=4 * 37 * EPS32 * size)


@HALF
@needs_kernels("one rounding of the whole FFN: the composition rounds its hidden layer to the "
               "input dtype, the kernel keeps it in float32", other_devices_too=True)
@pytest.mark.parametrize("activation", ["fastgelu", "gelu", "relu", "silu"])
def test_moe_ffn(dtype, activation, rng):
    x, w1, b1, _, tokens = _products(dtype, rng, m=21, k=40, n=24, counts=(9, 0, 12))
    w2 = rounded(rng.normal(size=(3, 24, 40)) * 0.3, dtype)
    b2 = rounded(rng.normal(size=(3, 40)), dtype)
    t = lambda a: tensor(a, dtype)  # noqa: E731
    y = moe_ffn(t(x), tensor(tokens), t(w1), t(w2), t(b1), t(b2), activation=activation)
    exact = ref.moe_ffn(x, tokens, w1, w2, b1, b2, activation=activation)
    size = ref.grouped_matmul(ref.grouped_matmul(np.abs(x), np.abs(w1), tokens, np.abs(b1)),
                              np.abs(w2), tokens, np.abs(b2))
    assert_rounded(numpy(y), exact, dtype, err=8 * 40 * EPS32 * size)


@HALF
@pytest.mark.parametrize("activation", ["fastgelu", "gelu", "relu", "silu"])
def test_moe_ffn_activation_gradient(dtype, activation, rng):
    h = rounded(rng.uniform(-4, 4, (6, 40)), dtype)
    ga = rounded(rng.normal(size=(6, 40)), dtype)
    gh, a = FFN_ACTIVATION_GRAD(tensor(h, dtype), tensor(ga, dtype), activation=activation)
    assert_rounded(numpy(a), ref.ffn_activation(activation, h), dtype,
                   err=16 * EPS32 * np.abs(h))
    step = 1e-6
    deriv = (ref.ffn_activation(activation, h + step) - ref.ffn_activation(activation, h - step)) / (2 * step)
    if activation == "relu":
        deriv = (h > 0).astype(np.float64)
    assert_rounded(numpy(gh), ga * deriv, dtype, err=16 * EPS32 * np.abs(ga) * (1 + np.abs(h)))


@HALF
@pytest.mark.parametrize("probs_half", [False, True])
def test_unpermute_and_its_backward(dtype, probs_half, rng):
    t_, k, h = 9, 3, 40
    idx = np.array([rng.permutation(6)[:k] for _ in range(t_)], np.int32)
    x = rounded(rng.normal(size=(t_, h)), dtype)
    rows, index, _ = ref.moe_token_permute(x, idx, 6)
    probs = rounded(rng.uniform(0.1, 1, (t_, k)), dtype if probs_half else "float32")
    pd = dtype if probs_half else "float32"
    out = moe_token_unpermute(tensor(rows, dtype), Tensor(index), tensor(probs, pd))
    size = ref.moe_token_unpermute(np.abs(rows), index, probs)
    assert_rounded(numpy(out), ref.moe_token_unpermute(rows, index, probs), dtype,
                   err=4 * k * EPS32 * size)
    plain = moe_token_unpermute(tensor(rows, dtype), Tensor(index), top_k=k)
    assert_rounded(numpy(plain), ref.moe_token_unpermute(rows, index, top_k=k), dtype,
                   err=4 * k * EPS32 * ref.moe_token_unpermute(np.abs(rows), index, top_k=k))
    g = rounded(rng.normal(size=(t_, h)), dtype)
    d_rows, d_probs = moe_token_unpermute_backward(tensor(rows, dtype), Tensor(index),
                                                   tensor(probs, pd), tensor(g, dtype))
    e_rows, e_probs = ref.moe_token_unpermute_backward(rows, index, probs, g)
    assert_rounded(numpy(d_rows), e_rows, dtype)
    size = ref.moe_token_unpermute_backward(np.abs(rows), index, probs, np.abs(g))[1]
    assert_rounded(numpy(d_probs), e_probs, pd, err=4 * h * EPS32 * size)
