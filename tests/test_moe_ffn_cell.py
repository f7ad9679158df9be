"""The MoeFFN Cell: every activation, biases, per-row weights, empty experts, gradients (finite
differences), PyNative and GRAPH, float32/bfloat16/float16."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn

from ms_moe_ops import MoeFFN
from ms_moe_ops import reference as ref
from ms_moe_ops.reference import _moe_activation
from conftest import (assert_close, assert_rounded, finite_diff, kernels_missing, needs_kernels,
                      numpy, rounded, tensor)

E, H, F = 4, 6, 5
COUNTS = np.array([3, 0, 4, 2], np.int64)  # expert 1 gets no rows
M = int(COUNTS.sum())


def expected(x, w1, w2, b1=None, b2=None, row_weight=None, activation="fastgelu", clamp=0.0):
    """The experts on their row blocks, in float64."""
    y = np.zeros((x.shape[0], w2.shape[2]))
    start = 0
    for e, n in enumerate(COUNTS):
        rows = slice(start, start + n)
        h = x[rows] @ w1[e] + (0 if b1 is None else b1[e])
        y[rows] = _moe_activation(activation, h, clamp) @ w2[e] + (0 if b2 is None else b2[e])
        start += n
    return y if row_weight is None else y * row_weight.reshape(-1, 1)


def make_ffn(activation, has_bias=False, clamp=0.0, seed=0):
    ffn = MoeFFN(E, H, F, activation=activation, has_bias=has_bias, clamp_limit=clamp)
    rng = np.random.default_rng(seed)
    for p in ffn.trainable_params():
        p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    return ffn


def weights_of(ffn):
    get = lambda p: None if p is None else p.asnumpy().astype(np.float64)  # noqa: E731
    return dict(w1=get(ffn.weight1), w2=get(ffn.weight2), b1=get(ffn.bias1), b2=get(ffn.bias2))


def data(seed=1, dtype="float32"):
    rng = np.random.default_rng(seed)
    return rounded(rng.normal(0, 1, (M, H)), dtype), rng.uniform(0.1, 1.0, M)


class _Apply(nn.Cell):
    def __init__(self, ffn, with_weight, objective):
        super().__init__()
        self.ffn = ffn
        self.with_weight = with_weight
        self.objective = objective

    def construct(self, x, counts, row_weight, cotangent):
        y = self.ffn(x, counts, row_weight if self.with_weight else None)
        return (y.astype(ms.float32) * cotangent).sum() if self.objective else y


def call(ffn, x, row_weight, mode, dtype="float32", grads=False):
    """ffn's output, or with grads: (output, (dx, drow_weight, {param: grad}), cotangent) of
    sum(ffn(...) * cotangent)."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        rw = Tensor(np.ones(M, np.float32) if row_weight is None else row_weight.astype(np.float32))
        cot = Tensor(np.random.default_rng(9).normal(0, 1, (M, H)).astype(np.float32))
        args = (tensor(x, dtype), Tensor(COUNTS), rw, cot)
        out = numpy(_Apply(ffn, row_weight is not None, False)(*args))
        if not grads:
            return out
        params = ffn.trainable_params()
        fn = ms.grad(_Apply(ffn, row_weight is not None, True), grad_position=(0, 2), weights=params)
        (gx, grw), gp = fn(*args)
        return out, (numpy(gx), numpy(grw), {p.name.split(".")[-1]: numpy(g)
                                              for p, g in zip(params, gp)}), cot.asnumpy()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


@pytest.mark.parametrize("activation", ["fastgelu", "gelu", "relu", "silu", "swiglu"])
@pytest.mark.parametrize("has_bias", [False, True])
def test_forward_matches_reference(activation, has_bias):
    ffn = make_ffn(activation, has_bias)
    x, rw = data()
    assert ffn.weight1.shape == (E, H, 2 * F if activation == "swiglu" else F)
    assert ffn.weight2.shape == (E, F, H)
    got = call(ffn, x, None, "pynative")
    assert_close(got, expected(x, **weights_of(ffn), activation=activation))
    got = call(ffn, x, rw, "pynative")
    assert_close(got, expected(x, **weights_of(ffn), row_weight=rw, activation=activation))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("activation", ["swiglu", "fastgelu"])
def test_modes_and_dtypes(activation, dtype, mode):
    if activation == "fastgelu" and dtype != "float32" and kernels_missing():
        pytest.skip(f"one rounding of the fused FFN to {dtype}: the composition rounds its hidden "
                    f"layer to it too: {kernels_missing()}")
    ffn = make_ffn(activation, has_bias=True, clamp=0.7 if activation == "swiglu" else 0.0)
    x, rw = data(dtype=dtype)
    got = call(ffn, x, rw, mode, dtype)
    if dtype == "float32":
        assert_close(got, expected(x, **weights_of(ffn), row_weight=rw, activation=activation,
                                   clamp=ffn.clamp_limit))
        return
    # every operator rounds its output to dtype once: the last one must be within half an ulp
    # of the same chain in float64, rounded where the Cell rounds
    exact, size = rounded_chain(x, weights_of(ffn), rw.astype(np.float32), activation,
                                ffn.clamp_limit, dtype)
    assert_rounded(got, exact, dtype, err=1e-6 * size)


def rounded_chain(x, w, rw, activation, clamp, dtype):
    """(the Cell's last operator's exact result on its rounded inputs, the size of its terms)."""
    r = lambda a: rounded(a, dtype)  # noqa: E731
    w1, w2, b1 = r(w["w1"]), r(w["w2"]), r(w["b1"])
    gmm = ref.grouped_matmul
    if activation != "swiglu":  # moe_ffn
        y = r(ref.moe_ffn(x, COUNTS, w1, w2, b1, r(w["b2"]), activation=activation))
    else:  # grouped_matmul (bias1) -> swiglu_group -> grouped_matmul (bias2)
        a = r(ref.swiglu_group(r(gmm(x, w1, COUNTS, b1)), clamp_limit=clamp))
        y = r(gmm(a, w2, COUNTS, r(w["b2"])))
    # then the row weight, in float32
    return y * rw[:, None], np.abs(y * rw[:, None])


@pytest.mark.parametrize("activation,has_bias,clamp", [("swiglu", True, 0.9), ("swiglu", False, 0.0),
                                                       ("gelu", True, 0.0)])
@pytest.mark.slow_in_graph
def test_gradients_match_finite_differences(activation, has_bias, clamp, mode):
    ffn = make_ffn(activation, has_bias, clamp)
    x, rw = data(seed=2)
    _, (gx, grw, gp), cot = call(ffn, x, rw, mode, grads=True)
    base = dict(x=x, row_weight=rw, **weights_of(ffn))

    def objective(**change):
        kw = {**base, **change}
        return float((expected(activation=activation, clamp=clamp, **kw) * cot).sum())

    assert_close(gx, finite_diff(lambda v: objective(x=v), x), rtol=1e-4)
    # the routing weight's gradient: from swiglu_group's fused backward, or the row scaling
    assert_close(grw, finite_diff(lambda v: objective(row_weight=v), rw), rtol=1e-4)
    names = {"weight1": "w1", "weight2": "w2", "bias1": "b1", "bias2": "b2"}
    assert set(gp) == {n for n in names if base[names[n]] is not None}
    for pname, arg in names.items():
        if base[arg] is not None:
            want = finite_diff(lambda v: objective(**{arg: v}), base[arg])
            assert_close(gp[pname], want, rtol=1e-4)
            assert np.abs(gp[pname][1]).max() == 0  # expert 1 has no rows


def test_bad_configuration():
    with pytest.raises(ValueError, match="activation"):
        MoeFFN(4, 8, 8, activation="tanh")
    with pytest.raises(ValueError, match="clamp_limit"):
        MoeFFN(4, 8, 8, activation="gelu", clamp_limit=7.0)
    with pytest.raises(ValueError, match="num_experts"):
        MoeFFN(0, 8, 8)
    with pytest.raises(TypeError, match="ffn_hidden_size"):
        MoeFFN(4, 8, 2.5)


@needs_kernels("a data fault is found by this package's CPU kernels")
def test_counts_that_do_not_add_up_raise():
    ffn = make_ffn("fastgelu")
    x, _ = data()
    with pytest.raises(RuntimeError):
        ffn(Tensor(x.astype(np.float32)), Tensor(np.array([3, 0, 4, 9], np.int64))).asnumpy()
