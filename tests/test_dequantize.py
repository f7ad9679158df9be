"""dequantize (ms_moe_ops.ops.dequantize): the quantised experts' float32 weights against the
golden model, bitwise, in both modes; the gradient of the steps against finite differences; bad
inputs; the quantised experts' decoding path through it."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

from ms_moe_ops import reference as ref
from ms_moe_ops.ops import dequantize
from conftest import finite_diff, grad, nan_pool, needs_kernels, numpy, run


def _case(rng, e=4, k=5, n=7, index=(2, 0, 2)):
    weight = rng.integers(-128, 128, (e, k, n)).astype(np.int8)
    scale = rng.uniform(0.01, 1, (e, n)).astype(np.float32)
    return weight, scale, np.asarray(index, np.int32)


def _call(weight, scale, index):
    return dequantize(weight, scale, index)


@pytest.mark.parametrize("index", [(2, 0, 2), (3,), (0, 1, 2, 3), ()],
                         ids=["repeated", "one", "all", "none"])
def test_matches_golden(index, mode, rng):
    weight, scale, index = _case(rng, index=index)
    nan_pool(mode)
    out = numpy(run(_call, Tensor(weight), Tensor(scale), Tensor(index), mode=mode))
    assert out.shape == (len(index), 5, 7) and out.dtype == np.float32
    np.testing.assert_array_equal(out, ref.dequantize(weight, scale, index))


def test_large_weights_on_threads(rng):
    # past 256 KB of work (the threads share the rows), K and N off the vector widths
    weight, scale, index = _case(rng, e=3, k=257, n=131, index=(1, 2, 1, 0))
    out = numpy(_call(Tensor(weight), Tensor(scale), Tensor(index)))
    np.testing.assert_array_equal(out, ref.dequantize(weight, scale, index))


def test_gradient_of_the_steps(mode, rng):
    weight, scale, index = _case(rng)
    c = rng.normal(size=(3, 5, 7))

    def loss(s):
        return (dequantize(Tensor(weight), s, Tensor(index)) * Tensor(c, ms.float32)).sum()

    got = numpy(grad(loss, Tensor(scale), mode=mode))

    def golden(s):  # float64: weight[index] * s[index], weighted
        return (weight[index].astype(np.float64) * s[index][:, None, :] * c).sum()

    np.testing.assert_allclose(got, finite_diff(golden, scale), rtol=1e-5, atol=1e-5)
    assert not got[3].any()  # an expert not picked has no gradient


@pytest.mark.parametrize("change,error,words", [
    (lambda w, s, i: (w.astype(np.float32), s, i), TypeError, "'weight' must have dtype int8"),
    (lambda w, s, i: (w, s.astype(np.float16), i), TypeError, "'scale' must have dtype float32"),
    (lambda w, s, i: (w, s, i.astype(np.int64)), TypeError, "'index' must have dtype int32"),
    (lambda w, s, i: (w, s[:, :3], i), ValueError, "'scale' must have shape [4, 7]"),
    (lambda w, s, i: (w[0], s, i), ValueError, "'weight' must be 3-D"),
    (lambda w, s, i: (w, s, i.reshape(1, 3)), ValueError, "'index' must be 1-D"),
], ids=["weight dtype", "scale dtype", "index dtype", "scale shape", "weight rank", "index rank"])
def test_bad_inputs_are_refused(change, error, words, rng):
    weight, scale, index = change(*_case(rng))
    with pytest.raises(error, match="dequantize") as info:
        dequantize(Tensor(weight), Tensor(scale), Tensor(index))
    assert words in str(info.value)


@needs_kernels("the composition does not check expert numbers")
@pytest.mark.parametrize("bad", [-1, 4])
def test_expert_numbers_outside_the_experts_are_refused(bad, mode, rng):
    weight, scale, index = _case(rng)
    index[1] = bad
    with pytest.raises(RuntimeError, match=r"dequantize: 'index' must hold expert numbers in "
                                           r"\[0, 4\), got " + str(bad)):
        numpy(run(_call, Tensor(weight), Tensor(scale), Tensor(index), mode=mode))
