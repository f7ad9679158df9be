"""weight_quant_grouped_matmul (ms_moe_ops.ops): weight-only int8 experts' products against the
golden model in both modes, for a decoding step's few rows and for more; the kernel against the
composition; the gradients of x and the steps against finite differences; bad inputs and counts;
the quantised experts' decoding path through it."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor

import ms_moe_ops
from ms_moe_ops import MoELayer, reference as ref
from ms_moe_ops.ops import record_choices, weight_quant_grouped_matmul
from ms_moe_ops.ops.weight_quant_grouped_matmul import _composed
from conftest import finite_diff, grad, needs_kernels, numpy, run


def _case(rng, counts=(2, 0, 3), k=6, n=5, padding=0):
    counts = np.asarray(counts, np.int64)
    x = rng.normal(size=(int(counts.sum()) + padding, k)).astype(np.float32)
    weight = rng.integers(-128, 128, (len(counts), k, n)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (len(counts), n)).astype(np.float32)
    return x, weight, scale, counts


def _tensors(*arrays):
    return [Tensor(a) for a in arrays]


def _close(got, x, weight, scale, counts):
    want = ref.weight_quant_grouped_matmul(x, weight, scale, counts)
    bound = ref.weight_quant_grouped_matmul(np.abs(x), np.abs(weight.astype(np.int16)),
                                            np.abs(scale), counts)
    assert got.shape == want.shape and got.dtype == np.float32
    assert (np.abs(got - want) <= 4e-7 * (x.shape[1] + 2) * bound).all()


@pytest.mark.parametrize("counts,k,padding", [
    ((0, 1, 0, 1), 1024, 0),     # one decoding token, top-2: groups cut along K
    ((1, 1, 0, 3), 300, 2),      # K off the chunks and the unrolled rows, padded rows
    ((20, 0, 1, 16), 300, 0),    # a group of 20 rows (uncut), one of 16 (cut)
    ((0, 0, 0, 0), 8, 3),        # no row routed: every row padding
    ((1,), 0, 0),                # K = 0
], ids=["decode", "padded", "many rows", "no rows", "k0"])
def test_matches_golden(counts, k, padding, mode, rng):
    x, weight, scale, counts = _case(rng, counts, k, 37, padding)
    out = numpy(run(weight_quant_grouped_matmul, *_tensors(x, weight, scale, counts), mode=mode))
    _close(out, x, weight, scale, counts)
    assert not out[int(counts.sum()):].any()


def test_kernel_and_composition_agree(rng):
    # (past 256 KB of weights: the threads share the tiles)
    x, weight, scale, counts = _case(rng, (3, 0, 1, 2), 1024, 131)
    args = _tensors(x, weight, scale, counts)
    for out in (weight_quant_grouped_matmul(*args), _composed({"padded": True})(*args)):
        _close(numpy(out), x, weight, scale, counts)


def test_gradients_of_x_and_the_steps(mode, rng):
    x, weight, scale, counts = _case(rng, padding=1)
    c = rng.normal(size=(x.shape[0], 5))

    def loss(x_, s_):
        return (weight_quant_grouped_matmul(x_, Tensor(weight), s_, Tensor(counts))
                * Tensor(c, ms.float32)).sum()

    dx, ds = grad(loss, Tensor(x), Tensor(scale), mode=mode, argnums=(0, 1))

    def golden(x_, s_):
        return (ref.weight_quant_grouped_matmul(x_, weight, s_, counts) * c).sum()

    np.testing.assert_allclose(numpy(dx), finite_diff(lambda v: golden(v, scale), x), rtol=1e-4,
                               atol=1e-5)
    np.testing.assert_allclose(numpy(ds), finite_diff(lambda v: golden(x, v), scale), rtol=1e-4,
                               atol=1e-5)
    assert not numpy(ds)[1].any()  # an expert without rows has no gradient


@pytest.mark.parametrize("change,error,words", [
    (lambda x, w, s, c: (x.astype(np.float16), w, s, c), TypeError, "'x' must have dtype float32"),
    (lambda x, w, s, c: (x, w.astype(np.float32), s, c), TypeError,
     "'weight' must have dtype int8"),
    (lambda x, w, s, c: (x, w, s.astype(np.float16), c), TypeError,
     "'scale' must have dtype float32"),
    (lambda x, w, s, c: (x, w, s, c.astype(np.int32)), TypeError,
     "'group_list' must have dtype int64"),
    (lambda x, w, s, c: (x[:, :4], w, s, c), ValueError, "'weight' must have shape [3, 4, 5]"),
    (lambda x, w, s, c: (x, w, s[:, :3], c), ValueError, "'scale' must have shape [3, 5]"),
    (lambda x, w, s, c: (x, w, s, c[:2]), ValueError, "'group_list' must have shape [3]"),
    (lambda x, w, s, c: (x, w[0], s, c), ValueError, "'weight' must be 3-D"),
    (lambda x, w, s, c: (x, w[:0], s[:0], c[:0]), ValueError,
     "'weight' must hold at least one expert, got shape [0, 6, 5]"),
], ids=["x dtype", "weight dtype", "scale dtype", "counts dtype", "k", "scale shape",
        "counts shape", "weight rank", "no expert"])
def test_bad_inputs_are_refused(change, error, words, rng):
    args = change(*_case(rng))
    with pytest.raises(error, match="weight_quant_grouped_matmul") as info:
        weight_quant_grouped_matmul(*_tensors(*args))
    assert words in str(info.value)


@needs_kernels("the kernel's count checks")
@pytest.mark.parametrize("counts,padded,words", [
    ((2, 0, 4), True, r"group_list\[2\] = 4 does not fit 5 rows"),
    ((2, -1, 4), True, r"group_list\[1\] = -1 does not fit 5 rows"),
    ((2, 0, 2), False, r"group_list cover 4 of the 5 rows"),
], ids=["past the rows", "negative", "uncovered rows, unpadded"])
def test_counts_that_do_not_fit_are_refused(counts, padded, words, mode, rng):
    x, weight, scale, _ = _case(rng)
    def call(*a):
        return weight_quant_grouped_matmul(*a, padded=padded)

    with pytest.raises(RuntimeError, match="weight_quant_grouped_matmul: " + words):
        numpy(run(call, *_tensors(x, weight, scale, np.asarray(counts, np.int64)), mode=mode))


@pytest.mark.parametrize("quant_mode", ["int8", "w8a16"])
def test_quantised_decoding_reads_the_int8_weights(quant_mode, mode, rng):
    """A quantised layer's few rows take this operator (not dequantize); many rows the
    dequantised product; both match the float layer within the quantisation error."""
    ms.set_seed(0)
    layer = MoELayer(32, 16, 4, 2, n_shared_experts=1, activation="swiglu")
    layer.set_train(False)
    few, many = (Tensor(rng.standard_normal((r, 32)).astype(np.float32)) for r in (3, 40))
    expected = [layer(x).asnumpy() for x in (few, many)]
    ms_moe_ops.quantize(layer, quant_mode, calibration=[many, few])
    for x, want, direct in zip((few, many), expected, (True, False)):
        with record_choices() as ran:
            y = run(layer, x, mode=mode).asnumpy()
        names = {name for name, _ in ran}
        assert ("weight_quant_grouped_matmul" in names) is direct, ran
        assert ("dequantize" in names) is not direct, ran
        assert np.abs(y - want).max() / np.abs(want).max() < 0.03


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_experts_keep_the_dequantised_product(dtype, mode, rng):
    """The operator is float32: quantised experts computing in half precision dequantise (into
    their dtype) and stay within that dtype's rounding of the float32 result."""
    ms.set_seed(0)
    layer = ms_moe_ops.quantize(MoELayer(32, 16, 4, 2, activation="swiglu"), "w8a16")
    layer.set_train(False)
    x = rng.standard_normal((3, 32)).astype(np.float32)
    counts = Tensor(np.array([1, 0, 2, 0], np.int64))
    want = layer.experts(Tensor(x), counts).asnumpy()
    with record_choices() as ran:
        y = run(layer.experts, Tensor(x).astype(getattr(ms, dtype)), counts, mode=mode)
    names = {name for name, _ in ran}
    assert "dequantize" in names and "weight_quant_grouped_matmul" not in names, ran
    assert y.dtype == getattr(ms, dtype)
    error = np.abs(y.astype(ms.float32).asnumpy() - want).max() / np.abs(want).max()
    assert error < (2e-2 if dtype == "bfloat16" else 3e-3), error


def test_without_the_kernel_few_rows_dequantise_only_their_experts(rng, monkeypatch):
    """With the compositions forced (as without the kernel library), the operator would
    dequantise every expert: few rows keep the gathered path instead."""
    monkeypatch.setenv("MS_MOE_OPS_IMPL", "composition")
    ms.set_seed(0)
    layer = ms_moe_ops.quantize(MoELayer(32, 16, 4, 2, activation="swiglu"), "w8a16")
    layer.set_train(False)
    with record_choices() as ran:
        layer(Tensor(rng.standard_normal((3, 32)).astype(np.float32)))
    names = {name for name, _ in ran}
    assert "dequantize" in names and "weight_quant_grouped_matmul" not in names, ran
