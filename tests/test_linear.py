"""models.Linear / models.linear: the models' projections, whose products of a few float32 rows on
the CPU (a decoding step) go through grouped_matmul with the weight read in place (the kernels'
matrix-vector path), and every other product through MindSpore's MatMul: the same values either
way, against float64, with a bias and by finite differences."""
import numpy as np
import pytest
import mindspore as ms

from ms_moe_ops.models.layers import SKINNY_ROWS, Linear, linear
from conftest import assert_close, finite_diff, grad, numpy, run, tensor


@pytest.mark.parametrize("rows", [1, 3, SKINNY_ROWS, SKINNY_ROWS + 1, 40])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
def test_linear_matches_float64(rows, bias, mode, rng):
    layer = Linear(37, 70, bias=bias)
    w = rng.standard_normal((70, 37)).astype(np.float32)
    layer.weight.set_data(ms.Tensor(w))
    b = np.zeros(70, np.float32)
    if bias:
        b = rng.standard_normal(70).astype(np.float32)
        layer.bias.set_data(ms.Tensor(b))
    x = rng.standard_normal((rows, 1, 37)).astype(np.float32)  # [..., in]: leading dims kept
    y = numpy(run(layer, tensor(x, "float32"), mode=mode))
    want = x.astype(np.float64) @ w.T.astype(np.float64) + b
    assert y.shape == (rows, 1, 70)
    assert_close(y, want, rtol=1e-5)


@pytest.mark.parametrize("rows", [2, SKINNY_ROWS + 1])
def test_linear_gradients(rows, mode, rng):
    x = rng.standard_normal((rows, 5))
    w = rng.standard_normal((3, 5))
    r = rng.standard_normal((rows, 3))

    def loss(x, w):
        return (linear(x, w, True) * tensor(r, "float32")).sum()

    got = grad(loss, tensor(x, "float32"), tensor(w, "float32"), mode=mode, argnums=(0, 1))
    assert_close(numpy(got[0]), finite_diff(lambda a: ((a @ w.T) * r).sum(), x), rtol=1e-4)
    assert_close(numpy(got[1]), finite_diff(lambda a: ((x @ a.T) * r).sum(), w), rtol=1e-4)


def test_linear_float16_takes_matmul(rng):
    """Only float32 takes the kernels' path; other dtypes keep MindSpore's MatMul (a float16
    weight with float16 rows, no cast)."""
    x = rng.standard_normal((2, 8)).astype(np.float16)
    w = rng.standard_normal((4, 8)).astype(np.float16)
    y = numpy(linear(tensor(x, "float16"), tensor(w, "float16"), True))
    assert y.dtype == np.float16
    assert_close(y, x.astype(np.float64) @ w.T.astype(np.float64), "float16")
