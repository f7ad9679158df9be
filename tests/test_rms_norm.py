"""rms_norm and add_rms_norm (ms_moe_ops.ops) and the models' RMSNorm on them: the golden model in both
modes and at edge shapes, gradients against finite differences and against MindSpore's autograd
of the plain composition, bad inputs, and what the models' norms compute."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from ms_moe_ops import reference as ref
from ms_moe_ops.models.layers import RMSNorm
from ms_moe_ops.ops import add_rms_norm, rms_norm
from conftest import finite_diff, grad, nan_pool, numpy, run


def _norm(x, weight):
    return rms_norm(x, weight, 1e-6)


def _case(rng, shape, scale=2.0):
    x = rng.normal(0, scale, shape).astype(np.float32)
    weight = rng.normal(1, 0.5, shape[-1:]).astype(np.float32)
    return x, weight


@pytest.mark.parametrize("shape", [(3, 16), (2, 1, 4, 64), (1, 1024), (1,), (5, 1), (2, 3, 1031),
                                   (64, 2048)],
                         ids=["rows", "heads", "one row", "one element", "H=1", "H odd",
                              "threads"])
def test_matches_golden(shape, mode, rng):
    x, weight = _case(rng, shape)
    out = numpy(run(_norm, Tensor(x), Tensor(weight), mode=mode))
    assert out.shape == shape and out.dtype == np.float32
    np.testing.assert_allclose(out, ref.rms_norm(x, weight, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("shape", [(0, 8), (4, 0), (2, 0, 3)], ids=["no rows", "H=0", "empty"])
def test_empty_inputs(shape, mode, rng):
    nan_pool(mode)
    x, weight = _case(rng, shape)
    out = numpy(run(_norm, Tensor(x), Tensor(weight), mode=mode))
    assert out.shape == shape


def test_eps_and_extremes():
    # eps dominates a row of zeros (0 out, not NaN); large values do not overflow the squares;
    # a non-finite element gives what the composition gives (NaN or 0 rows), never a crash
    x = np.array([[0, 0, 0, 0], [3e19, -3e19, 3e19, 1], [np.inf, 1, 2, 3],
                  [np.nan, 1, 2, 3]], np.float32)
    w = np.array([1, 2, 3, 4], np.float32)
    out = numpy(rms_norm(Tensor(x), Tensor(w), 0.5))
    np.testing.assert_array_equal(out[0], 0)
    np.testing.assert_allclose(out[1], ref.rms_norm(x[1], w, 0.5), rtol=1e-6)
    assert np.isnan(out[2, 0]) and (out[2, 1:] == 0).all()
    assert np.isnan(out[3]).all()


def test_one_call_per_row_gives_the_same_bits(rng):
    # one row per task: the same bits for any batch it sits in (decoding's rows are alone)
    x, w = _case(rng, (16, 1024))
    whole = numpy(rms_norm(Tensor(x), Tensor(w)))
    for i in (0, 7, 15):
        one = numpy(rms_norm(Tensor(x[i:i + 1]), Tensor(w)))
        np.testing.assert_array_equal(one, whole[i:i + 1])


def test_gradient(mode, rng):
    x, weight = _case(rng, (3, 8))
    c = rng.normal(size=(3, 8))

    def loss(a, b):
        return (rms_norm(a, b, 1e-3) * Tensor(c, ms.float32)).sum()

    gx, gw = grad(loss, Tensor(x), Tensor(weight), mode=mode, argnums=(0, 1))
    x64, w64 = x.astype(np.float64), weight.astype(np.float64)
    np.testing.assert_allclose(numpy(gx), finite_diff(lambda v: (ref.rms_norm(v, w64, 1e-3) * c)
                                                      .sum(), x64), rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(numpy(gw), finite_diff(lambda v: (ref.rms_norm(x64, v, 1e-3) * c)
                                                      .sum(), w64), rtol=1e-4, atol=1e-5)


def test_gradient_equals_autograd_of_the_composition(mode, rng):
    x, weight = _case(rng, (2, 5, 32))
    c = Tensor(rng.normal(size=(2, 5, 32)).astype(np.float32))

    def ours(a, b):
        return (rms_norm(a, b) * c).sum()

    def plain(a, b):
        return (b * (a * ops.rsqrt((a * a).mean(-1, keep_dims=True) + 1e-6)) * c).sum()

    got = grad(ours, Tensor(x), Tensor(weight), mode=mode, argnums=(0, 1))
    want = grad(plain, Tensor(x), Tensor(weight), mode=mode, argnums=(0, 1))
    for g, w in zip(got, want):
        np.testing.assert_allclose(numpy(g), numpy(w), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("x_shape,w_shape,x_dtype,w_dtype,error,words", [
    ((3, 8), (7,), np.float32, np.float32, ValueError, "'weight' must have shape [8]"),
    ((3, 8), (1, 8), np.float32, np.float32, ValueError, "'weight'"),
    ((3, 8), (8,), np.float16, np.float32, TypeError, "'x' must have dtype float32"),
    ((3, 8), (8,), np.float32, np.float16, TypeError, "'weight' must have dtype float32"),
    ((), (1,), np.float32, np.float32, ValueError, "'x' must have at least one axis"),
], ids=["weight width", "weight rank", "x dtype", "weight dtype", "scalar"])
def test_bad_inputs_are_refused(x_shape, w_shape, x_dtype, w_dtype, error, words):
    with pytest.raises(error, match="rms_norm") as info:
        rms_norm(Tensor(np.ones(x_shape, x_dtype)), Tensor(np.ones(w_shape, w_dtype)))
    assert words in str(info.value)


@pytest.mark.parametrize("eps", [-1e-6, float("nan")])
def test_bad_eps_is_refused(eps):
    with pytest.raises(ValueError, match="rms_norm: attribute 'eps' must be >= 0"):
        rms_norm(Tensor(np.ones((2, 4), np.float32)), Tensor(np.ones(4, np.float32)), eps)


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16, ms.bfloat16])
def test_the_models_norm(dtype, mode, rng):
    # float32 tokens take the operator; half-precision ones the float32 composition, rounded back
    norm = RMSNorm(24, 1e-5)
    weight = rng.normal(1, 0.3, 24).astype(np.float32)
    norm.weight.set_data(Tensor(weight))
    x = rng.normal(0, 3, (2, 3, 24)).astype(np.float32)
    got = numpy(run(norm, Tensor(x, dtype), mode=mode)).astype(np.float64)
    xd = numpy(Tensor(x, dtype)).astype(np.float64)
    tol = 2e-6 if dtype == ms.float32 else 1e-2
    np.testing.assert_allclose(got, ref.rms_norm(xd, weight, 1e-5), rtol=tol, atol=tol)


def _add_norm(x, residual, weight):
    return add_rms_norm(x, residual, weight, 1e-6)


@pytest.mark.parametrize("shape", [(3, 16), (1, 1024), (1,), (2, 3, 1031), (64, 2048), (0, 8)],
                         ids=["rows", "one row", "one element", "H odd", "threads", "empty"])
def test_add_rms_norm_matches_golden(shape, mode, rng):
    x, weight = _case(rng, shape)
    residual = rng.normal(0, 2, shape).astype(np.float32)
    y, total = (numpy(t) for t in run(_add_norm, Tensor(x), Tensor(residual), Tensor(weight),
                                      mode=mode))
    want_y, want_total = ref.add_rms_norm(x, residual, weight, 1e-6)
    np.testing.assert_array_equal(total, want_total)  # the float32 sum, as x + residual
    np.testing.assert_allclose(y, want_y, rtol=2e-6, atol=1e-6)
    # the same bits as the sum, then the norm (a decoding step's residual path, before and after)
    np.testing.assert_array_equal(y, numpy(rms_norm(Tensor(total.astype(np.float32)),
                                                    Tensor(weight))))


def test_add_rms_norm_gradient(mode, rng):
    x, weight = _case(rng, (3, 8))
    residual = rng.normal(0, 2, (3, 8)).astype(np.float32)
    cy, cs = rng.normal(size=(3, 8)), rng.normal(size=(3, 8))

    def loss(a, r, w):
        y, total = add_rms_norm(a, r, w, 1e-3)
        return (y * Tensor(cy, ms.float32)).sum() + (total * Tensor(cs, ms.float32)).sum()

    got = grad(loss, Tensor(x), Tensor(residual), Tensor(weight), mode=mode, argnums=(0, 1, 2))
    args = [v.astype(np.float64) for v in (x, residual, weight)]

    def f(position):
        def value(v):
            a = list(args)
            a[position] = v
            total = a[0] + a[1]
            return (ref.rms_norm(total, a[2], 1e-3) * cy).sum() + (total * cs).sum()
        return value

    for position, g in enumerate(got):
        np.testing.assert_allclose(numpy(g), finite_diff(f(position), args[position]),
                                   rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("shapes, dtypes, error, words", [
    (((3, 8), (3, 7), (8,)), (np.float32,) * 3, ValueError, "'residual' must have shape [3, 8]"),
    (((3, 8), (3, 8), (7,)), (np.float32,) * 3, ValueError, "'weight' must have shape [8]"),
    (((3, 8), (3, 8), (8,)), (np.float32, np.float16, np.float32), TypeError,
     "'residual' must have dtype float32"),
    (((3, 8), (3, 8), (8,)), (np.float16, np.float16, np.float32), TypeError,
     "must have dtype float32"),
], ids=["residual shape", "weight width", "residual dtype", "x dtype"])
def test_add_rms_norm_bad_inputs_are_refused(shapes, dtypes, error, words):
    with pytest.raises(error, match="rms_norm") as info:
        add_rms_norm(*[Tensor(np.ones(s, d)) for s, d in zip(shapes, dtypes)])
    assert words in str(info.value)


def test_add_rms_norm_bad_eps_is_refused():
    with pytest.raises(ValueError, match="add_rms_norm: attribute 'eps' must be >= 0"):
        add_rms_norm(*[Tensor(np.ones(s, np.float32)) for s in ((2, 4), (2, 4), (4,))], -1.0)


@pytest.mark.parametrize("dtype", [ms.float32, ms.float16])
def test_the_models_add_norm(dtype, mode, rng):
    # float32 takes the operator; half precision the sum, then the norm
    norm = RMSNorm(24, 1e-5)
    norm.weight.set_data(Tensor(rng.normal(1, 0.3, 24).astype(np.float32)))
    x, r = (Tensor(rng.normal(0, 3, (2, 1, 24)).astype(np.float32), dtype) for _ in range(2))

    def both(a, b):
        return norm.add_norm(a, b)

    y, total = (numpy(t) for t in run(both, x, r, mode=mode))
    np.testing.assert_array_equal(total, numpy(x + r))
    np.testing.assert_array_equal(y, numpy(norm(x + r)))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_whole_models_training_step_compiles_as_on_ascend(family, monkeypatch):
    # the models' norms on Atlas A2: MindSpore's RmsNorm with this package's bprop; the front end
    # must accept the whole float32 training step (forward, every gradient) and stop only at an
    # Ascend kernel the CPU backend lacks
    from ascend_sim import ASCEND_ONLY, as_on, backend_refusal
    from hf_models import hf_config
    from ms_moe_ops.models import CausalLMConfig, MoECausalLM
    from ms_moe_ops.models.causal_lm import CausalLMLoss
    from ms_moe_ops.ops import _platform

    as_on(monkeypatch, _platform.A2)
    ms.set_seed(0)
    net = MoECausalLM(CausalLMConfig.from_transformers(hf_config(family, layers=2).to_dict()))
    loss = CausalLMLoss(net)
    ids = Tensor(np.random.default_rng(0).integers(0, 64, (2, 8)).astype(np.int32))
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        with pytest.raises(RuntimeError) as info:
            ms.value_and_grad(loss, None, loss.trainable_params())(ids)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    refused = backend_refusal(info.value)  # (RmsNorm: the first kernel of the step)
    assert refused in ASCEND_ONLY + ("RmsNorm",), str(info.value)[:2000]
