"""moe_ffn float path (SPEC §4): golden model, finite-difference gradients, expert edge cases,
bad input."""
import mindspore as ms
import numpy as np
import pytest

from ms_moe_ops import moe_ffn, reference
from conftest import (assert_close, assert_rounded, finite_diff, grad, kernels_missing,
                      needs_kernels, numpy, rounded, run, tensor)

pytestmark = pytest.mark.every_isa  # the kernels run under every instruction-set path

ACTIVATIONS = ["fastgelu", "gelu", "relu", "silu"]


DATA_CHECK = needs_kernels("a data fault is found by this package's CPU kernels")
def _case(rng, counts=(3, 0, 4), h=5, f=6, dtype="float32", bias=True):
    e, m = len(counts), int(sum(counts))
    r = lambda *shape: rounded(rng.standard_normal(shape) * 0.7, dtype)
    v = dict(x=r(m, h), w1=r(e, h, f), w2=r(e, f, h), b1=r(e, f) if bias else None,
             b2=r(e, h) if bias else None)
    return v, np.array(counts, np.int64)


def _golden(v, tokens, **kw):
    return reference.moe_ffn(v["x"], tokens, v["w1"], v["w2"], v["b1"], v["b2"], **kw)


def _call(v, tokens, dtype="float32", mode="pynative", **kw):
    t = lambda a: None if a is None else tensor(a, dtype)

    def fn(x, tokens, w1, w2, b1, b2):
        return moe_ffn(x, tokens, w1, w2, b1, b2, **kw)

    return run(fn, t(v["x"]), tensor(tokens), t(v["w1"]), t(v["w2"]), t(v["b1"]), t(v["b2"]),
               mode=mode)


def test_matches_golden(dtype, mode, rng):
    if dtype != "float32" and kernels_missing():
        pytest.skip(f"one rounding to {dtype}: the composition rounds its hidden layer to it too: "
                    f"{kernels_missing()}")
    v, tokens = _case(rng, dtype=dtype)
    y = _call(v, tokens, dtype, mode)
    assert str(y.dtype).lower() == dtype and y.shape == (7, 5)
    assert_close(numpy(y), _golden(v, tokens), dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_activations(activation, rng):
    v, tokens = _case(rng, counts=(2, 5, 1))
    y = _call(v, tokens, activation=activation)
    assert_close(numpy(y), _golden(v, tokens, activation=activation))


def test_without_biases(rng):
    v, tokens = _case(rng, bias=False)
    assert_close(numpy(_call(v, tokens)), _golden(v, tokens))


def test_tokens_index_flag(mode, rng):
    v, tokens = _case(rng, counts=(2, 0, 3, 2))
    ends = np.cumsum(tokens)
    y = _call(v, ends, mode=mode, tokens_index_flag=True)
    assert_close(numpy(y), _golden(v, tokens))


def test_zero_token_experts(rng):
    # empty experts first, in the middle and last; their (huge) weights must not be touched
    v, tokens = _case(rng, counts=(0, 4, 0, 0, 3, 0))
    for e in (0, 2, 3, 5):
        v["w1"][e] = v["w2"][e] = 1e30
    y = numpy(_call(v, tokens))
    assert np.isfinite(y).all()
    assert_close(y, _golden(v, tokens))


def test_all_rows_to_one_expert_and_no_rows(rng):
    v, tokens = _case(rng, counts=(0, 6, 0))
    assert_close(numpy(_call(v, tokens)), _golden(v, tokens))
    v, tokens = _case(rng, counts=(0, 0))
    assert _call(v, tokens).shape == (0, 5)


def test_one_expert(rng):
    v, tokens = _case(rng, counts=(8,))
    assert_close(numpy(_call(v, tokens)), _golden(v, tokens))


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_256_experts(dtype, rng):
    if dtype != "float32" and kernels_missing():
        pytest.skip(f"one rounding to {dtype}: the composition rounds its hidden layer to it too: "
                    f"{kernels_missing()}")
    counts = rng.integers(0, 3, 256)
    v, tokens = _case(rng, counts=tuple(counts), h=3, f=2, dtype=dtype)
    assert_close(numpy(_call(v, tokens, dtype)), _golden(v, tokens), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rows_beyond_one_block(dtype, rng):
    if dtype != "float32" and kernels_missing():
        pytest.skip(f"one rounding to {dtype}: the composition rounds its hidden layer to it too: "
                    f"{kernels_missing()}")
    # an expert over several of the kernel's row tiles (custom_aot/gemm.h)
    v, tokens = _case(rng, counts=(1100, 30), h=4, f=3, dtype=dtype)
    assert_close(numpy(_call(v, tokens, dtype)), _golden(v, tokens), dtype)


# -- gradients ------------------------------------------------------------------------------------

NAMES = ("x", "w1", "w2", "b1", "b2")


def _check_gradients(v, tokens, r, mode="pynative", rtol=1e-4, **kw):
    """Gradients of sum(y * r) against finite differences of the golden model."""
    m, h = v["x"].shape  # loss = sum(y * r)
    weights = tensor(r, "float32")

    def loss(x, tokens, w1, w2, b1, b2):
        y = moe_ffn(x, tokens, w1, w2, b1, b2, **kw)
        return (y.astype(ms.float32) * weights).sum()

    bias = v["b1"] is not None
    t = lambda a: None if a is None else tensor(a, "float32")
    args = (t(v["x"]), tensor(tokens), t(v["w1"]), t(v["w2"]), t(v["b1"]), t(v["b2"]))
    got = grad(loss, *args, mode=mode, argnums=(0, 2, 3, 4, 5) if bias else (0, 2, 3))
    golden_tokens = np.diff(tokens, prepend=0) if kw.get("tokens_index_flag") else tokens
    kw = {k: val for k, val in kw.items() if k != "tokens_index_flag"}
    for name, g in zip(NAMES if bias else NAMES[:3], got):
        def f(a, name=name):
            return (_golden(dict(v, **{name: a}), golden_tokens, **kw) * r).sum()
        assert_close(numpy(g), finite_diff(f, v[name]), rtol=rtol)
    return got


@pytest.mark.parametrize("activation,mode", [(a, "pynative") for a in ACTIVATIONS] + [("fastgelu", "graph")])
def test_gradients_by_finite_differences(activation, mode, rng):
    v, tokens = _case(rng, counts=(2, 0, 3), h=3, f=4)
    if activation == "relu":  # keep pre-activations away from the kink
        v["b1"] = v["b1"] + np.sign(v["b1"]) * 0.3
    got = _check_gradients(v, tokens, rng.standard_normal((5, 3)), mode, activation=activation)
    w1, w2, b1 = (numpy(got[i]) for i in (1, 2, 3))
    assert not w1[1].any() and not w2[1].any() and not b1[1].any(), "empty expert: zero gradient"


def test_gradients_with_tokens_index_flag_and_no_bias(mode, rng):
    v, tokens = _case(rng, counts=(3, 1, 0, 2), h=3, f=2, bias=False)
    _check_gradients(v, np.cumsum(tokens), rng.standard_normal((6, 3)), mode,
                     tokens_index_flag=True)


def test_rows_past_the_experts(mode, rng):
    """Counts covering 5 of 7 rows (a padded batch, padded=True): the last rows are zero in y,
    get a zero gradient and are never read (NaN there changes nothing)."""
    v, tokens = _case(rng, counts=(2, 0, 3), h=3, f=4)
    v["x"] = np.concatenate([v["x"], np.full((2, 3), np.nan)])
    y = numpy(_call(v, tokens, mode=mode, padded=True))
    assert not y[5:].any()
    assert_close(y, _golden(v, tokens, padded=True))
    dx = numpy(_check_gradients(v, tokens, rng.standard_normal((7, 3)), mode, padded=True)[0])
    assert not dx[5:].any()


def _activation_derivative(activation, h):
    if activation == "relu":
        return (h > 0).astype(np.float64)
    step = 1e-6
    return (reference.ffn_activation(activation, h + step) -
            reference.ffn_activation(activation, h - step)) / (2 * step)


@pytest.mark.parametrize("activation", ["fastgelu", "silu"])
@pytest.mark.parametrize("dtype, mode", [("float16", "pynative"), ("bfloat16", "pynative"),
                                         ("bfloat16", "graph")])
def test_gradients_low_precision(dtype, mode, activation, rng):
    if dtype != "float32" and kernels_missing():
        pytest.skip(f"one rounding to {dtype}: the composition rounds its hidden layer to it too: "
                    f"{kernels_missing()}")
    # Every operator of the backward rounds its output to dtype once. The expectation is the
    # same chain in float64 on the same inputs, rounded where the backward rounds (the
    # cotangent, h, act(h), dh): each gradient must then be within half an ulp of it.
    v, tokens = _case(rng, counts=(5, 0, 7), h=24, f=20, dtype=dtype)
    r = rng.standard_normal((12, 24))
    cot = tensor(r, "float32")

    def loss(x, tokens, w1, w2, b1, b2):
        return (moe_ffn(x, tokens, w1, w2, b1, b2, activation=activation).astype(ms.float32)
                * cot).sum()

    t = lambda a: tensor(a, dtype)  # noqa: E731
    got = grad(loss, t(v["x"]), tensor(tokens), t(v["w1"]), t(v["w2"]), t(v["b1"]), t(v["b2"]),
               mode=mode, argnums=(0, 2, 3, 4, 5))
    gmm = reference.grouped_matmul
    x, w1, w2, b1 = v["x"], v["w1"], v["w2"], v["b1"]
    dout = rounded(r, dtype)
    h = rounded(gmm(x, w1, tokens, b1), dtype)
    da = rounded(gmm(dout, w2, tokens, transpose_weight=True), dtype)
    dh = rounded(da * _activation_derivative(activation, h), dtype)
    act_h = rounded(reference.ffn_activation(activation, h), dtype)
    ones = np.ones((12, 1))
    expected = [(gmm(dh, w1, tokens, transpose_weight=True),
                 gmm(np.abs(dh), np.abs(w1), tokens, transpose_weight=True)),
                (gmm(x, dh, tokens, transpose_x=True), gmm(np.abs(x), np.abs(dh), tokens, transpose_x=True)),
                (gmm(act_h, dout, tokens, transpose_x=True),
                 gmm(np.abs(act_h), np.abs(dout), tokens, transpose_x=True)),
                (gmm(ones, dh, tokens, transpose_x=True)[:, 0], gmm(ones, np.abs(dh), tokens, transpose_x=True)[:, 0]),
                (gmm(ones, dout, tokens, transpose_x=True)[:, 0],
                 gmm(ones, np.abs(dout), tokens, transpose_x=True)[:, 0])]
    for g, (exact, size) in zip(got, expected):
        assert_rounded(numpy(g), exact, dtype, err=1e-6 * size)


# -- bad input ------------------------------------------------------------------------------------

def _z(*shape, d=np.float32):
    return np.zeros(shape, d)


def _bad(**over):
    v = dict(x=_z(6, 4), tokens=np.array([2, 4], np.int64), w1=_z(2, 4, 3), b1=None, w2=_z(2, 3, 4),
             b2=None, scale=None, offset=None, dq1=None, dq2=None)
    v.update(over)
    return v


@pytest.mark.parametrize("over, attrs, error, match", [
    (dict(x=_z(6, 4, 1)), {}, ValueError, "'x' must be 2-D"),
    (dict(tokens=np.array([[2, 4]], np.int64)), {}, ValueError, "'expert_tokens' must be 1-D"),
    (dict(tokens=np.ones(257, np.int64), w1=_z(257, 4, 3), w2=_z(257, 3, 4)), {}, ValueError,
     "expert count E"),
    (dict(w1=_z(2, 5, 3)), {}, ValueError, "'weight1' must have shape"),
    (dict(w1=_z(3, 4, 3)), {}, ValueError, "'weight1' must have shape"),
    (dict(w1=_z(2, 4)), {}, ValueError, "'weight1' must be 3-D"),
    (dict(w2=_z(2, 3, 5)), {}, ValueError, "'weight2' must have shape"),
    (dict(b1=_z(2, 4)), {}, ValueError, "'bias1' must have shape"),
    (dict(b2=_z(2, 3)), {}, ValueError, "'bias2' must have shape"),
    ({}, dict(activation="swish"), ValueError, "'activation'"),
    ({}, dict(output_dtype="int8"), ValueError, "'output_dtype'"),
    ({}, dict(output_dtype="float16"), ValueError, "'output_dtype' is for the int8 path"),
    ({}, dict(tokens_index_flag=1), TypeError, "must be bool"),
    (dict(scale=_z(2)), {}, ValueError, "quantisation arguments"),
    (dict(dq1=_z(2, 3)), {}, ValueError, "quantisation arguments"),
    (dict(x=_z(6, 4, d=np.float64)), {}, TypeError, "'x' must have dtype"),
    (dict(tokens=np.array([2, 4], np.int32)), {}, TypeError, "'expert_tokens' must have dtype int64"),
    (dict(w1=_z(2, 4, 3, d=np.float16)), {}, TypeError, "'weight1' must have the dtype"),
    (dict(w2=_z(2, 3, 4, d=np.float16)), {}, TypeError, "'weight2' must have the dtype"),
    (dict(b1=_z(2, 3, d=np.float16)), {}, TypeError, "'bias1' must have the dtype"),
    (dict(b2=_z(2, 4, d=np.float16)), {}, TypeError, "'bias2' must have the dtype"),
    # int8 path: dtypes and missing quantisation arguments are found at graph build
    (dict(x=_z(6, 4, d=np.int8), w1=_z(2, 4, 3, d=np.int8), w2=_z(2, 3, 4, d=np.int8)), {},
     ValueError, "needs scale, offset, deq_scale1, deq_scale2"),
    (dict(x=_z(6, 4, d=np.int8)), {}, TypeError, "'weight1' must have dtype int8"),
    (dict(x=_z(6, 4, d=np.int8), w1=_z(2, 4, 3, d=np.int8), w2=_z(2, 3, 4, d=np.int8),
          b1=_z(2, 3, d=np.int8)), {}, TypeError, "'bias1' must have dtype int32"),
    (dict(x=_z(6, 4, d=np.int8), w1=_z(2, 4, 3, d=np.int8), w2=_z(2, 3, 4, d=np.int8),
          scale=_z(2), offset=_z(2), dq1=_z(2, 3, d=np.int32), dq2=_z(2, 4)), {}, TypeError,
     "'deq_scale1' must have dtype uint64 or float32"),
    (dict(x=_z(6, 4, d=np.int8), w1=_z(2, 4, 3, d=np.int8), w2=_z(2, 3, 4, d=np.int8),
          scale=_z(2, d=np.float16), offset=_z(2), dq1=_z(2, 3), dq2=_z(2, 4)), {}, TypeError,
     "'scale' must have dtype float32"),
    (dict(scale=_z(3)), {}, ValueError, "'scale' must have shape"),
    # data faults, found by the kernel before it writes
    pytest.param(dict(tokens=np.array([3, 4], np.int64)), {}, RuntimeError, None,
                 marks=DATA_CHECK),
    pytest.param(dict(tokens=np.array([7, -1], np.int64)), {}, RuntimeError, None,
                 marks=DATA_CHECK),
    pytest.param(dict(tokens=np.array([4, 2], np.int64)), dict(tokens_index_flag=True),
                 RuntimeError, None, marks=DATA_CHECK),
    pytest.param(dict(tokens=np.array([2, 7], np.int64)), dict(tokens_index_flag=True),
                 RuntimeError, None, marks=DATA_CHECK),
])
def test_bad_input(over, attrs, error, match):
    v = _bad(**over)
    t = lambda a: None if a is None else tensor(a)
    with pytest.raises(error, match=match):
        y = moe_ffn(t(v["x"]), t(v["tokens"]), t(v["w1"]), t(v["w2"]), t(v["b1"]), t(v["b2"]),
                    t(v["scale"]), t(v["offset"]), t(v["dq1"]), t(v["dq2"]), **attrs)
        y.asnumpy()


def test_bad_input_graph_mode(rng):
    v, tokens = _case(rng)
    with pytest.raises(ValueError, match="'activation'"):
        _call(v, tokens, mode="graph", activation="swish")


@needs_kernels("on CPU the int8 path runs on the kernel only", other_devices_too=True)
def test_int8_path_has_no_gradient(mode, rng):
    m, h, f, e = 4, 16, 16, 2
    i8 = lambda *s: tensor(rng.integers(-3, 4, s).astype(np.int8))
    f32 = lambda *s: tensor(np.full(s, 0.01, np.float32))
    args = (i8(m, h), tensor(np.array([1, 3], np.int64)), i8(e, h, f), i8(e, f, h))

    def loss(x, tokens, w1, w2):
        y = moe_ffn(x, tokens, w1, w2, scale=f32(e), offset=f32(e), deq_scale1=f32(e, f),
                    deq_scale2=f32(e, h), output_dtype="float32")
        return y.sum()

    with pytest.raises(RuntimeError, match="no gradient"):
        grad(loss, *args, mode=mode, argnums=(0,))
