"""Arguments taken as MindSpore takes them: numpy scalars wherever a Python int, float or bool is
taken (operator attributes and Cell constructors), MindSpore dtype objects wherever a dtype is
taken, and messages that say what was wrong with the value."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn

import ms_moe_ops
from ms_moe_ops import (GatingTopK, MoELayer, MoeFFN, grouped_matmul, moe_ffn, moe_gating_top_k,
                        moe_token_permute, moe_token_unpermute, quantize_moe_ffn, swiglu_group)
from conftest import needs_kernels, numpy, run, tensor


def _outputs(result):
    return [numpy(t) for t in (result if isinstance(result, tuple) else (result,))]


def _gating(x, k, s, flag):
    return moe_gating_top_k(x, k, routed_scaling_factor=s, out_flag=flag, group_count=2, k_group=2)


def _swiglu(x, c):
    return swiglu_group(x, clamp_limit=c)


def _permute(x, idx, e):
    return moe_token_permute(x, idx, e)


def _unpermute(x, index, k):
    return moe_token_unpermute(x, index, top_k=k)


def _grouped_matmul(x, w, tokens, t):
    return grouped_matmul(x, w, tokens, transpose_weight=t)


def _cases(rng):
    """name -> (function of (tensors..., scalars...), its tensor inputs, the scalars as Python
    values)."""
    x = rng.standard_normal((6, 8)).astype(np.float32)
    idx = np.argsort(-x, axis=1)[:, :2].astype(np.int32)
    w = rng.standard_normal((2, 3, 8)).astype(np.float32)
    return {
        "gating": (_gating, (x,), (2, 2.5, True)),
        "swiglu": (_swiglu, (x,), (0.5,)),
        "permute": (_permute, (x, idx), (8,)),
        "unpermute": (_unpermute, (x, rng.permutation(6).astype(np.int32)), (2,)),
        "grouped_matmul": (_grouped_matmul, (x, w, np.array([2, 4], np.int64)), (True,)),
    }


class _WithScalars(nn.Cell):
    """fn(*inputs, *scalars): the scalars are attributes, constants of a compiled graph."""

    def __init__(self, fn, scalars):
        super().__init__()
        self.fn = fn
        self.scalars = scalars

    def construct(self, *inputs):
        return self.fn(*inputs, *self.scalars)


def _numpy_scalar(value):
    if isinstance(value, bool):
        return np.bool_(value)
    return np.int64(value) if isinstance(value, int) else np.float32(value)


@pytest.mark.parametrize("name", ["gating", "swiglu", "permute", "unpermute", "grouped_matmul"])
def test_operator_attributes_take_numpy_scalars(name, mode, rng):
    fn, arrays, scalars = _cases(rng)[name]
    inputs = [tensor(a) for a in arrays]
    expected = _outputs(fn(*inputs, *scalars))
    as_numpy = tuple(_numpy_scalar(v) for v in scalars)
    got = _outputs(run(_WithScalars(fn, as_numpy), *inputs, mode=mode))
    for g, e in zip(got, expected):
        np.testing.assert_array_equal(g, e)


def test_the_issue_reproduction_numpy_k(rng):
    x = tensor(rng.standard_normal((4, 8)).astype(np.float32))
    for got, want in zip(moe_gating_top_k(x, np.int64(2)), moe_gating_top_k(x, 2)):
        np.testing.assert_array_equal(numpy(got), numpy(want))


def _copy_parameters(src, dst):
    for (name, p), (other, q) in zip(src.parameters_and_names(), dst.parameters_and_names()):
        assert name == other
        q.set_data(p.data.copy())


@pytest.mark.parametrize("make", [
    lambda i, f: GatingTopK(i(8), i(4), i(2), n_group=i(2), topk_group=i(1),
                            group_select_mode=i(0), routed_scaling_factor=f(2.0),
                            bias_update_rate=f(1e-2)),
    lambda i, f: MoeFFN(i(4), i(8), i(6), activation="swiglu", clamp_limit=f(3.0)),
    lambda i, f: MoELayer(i(8), i(6), i(4), i(2), n_group=i(2), topk_group=i(2),
                          routed_scaling_factor=f(1.5), n_shared_experts=i(1),
                          shared_ffn_hidden_size=i(4)),
], ids=["GatingTopK", "MoeFFN", "MoELayer"])
@pytest.mark.slow_in_graph
def test_cells_take_numpy_scalars(make, mode, rng):
    plain = make(int, float)
    cell = make(np.int64, np.float32)
    _copy_parameters(plain, cell)
    for attr in ("hidden_size", "num_experts", "top_k", "n_group", "ffn_hidden_size"):
        if hasattr(cell, attr):
            assert type(getattr(cell, attr)) is int, attr
    x = tensor(rng.standard_normal((5, 8)).astype(np.float32))
    args = (x, tensor(np.array([1, 0, 3, 1], np.int64))) if isinstance(cell, MoeFFN) else (x,)
    for got, want in zip(_outputs(run(cell, *args, mode=mode)), _outputs(plain(*args))):
        np.testing.assert_array_equal(got, want)


@needs_kernels("on CPU the int8 path runs on the kernel only", other_devices_too=True)
def test_moe_ffn_output_dtype_takes_dtype_objects(rng):
    # the issue's reproduction: output_dtype=ms.float32 on the float path
    x = tensor(rng.standard_normal((4, 8)).astype(np.float32))
    tokens = tensor(np.array([3, 1], np.int64))
    w1 = tensor(rng.standard_normal((2, 8, 5)).astype(np.float32))
    w2 = tensor(rng.standard_normal((2, 5, 8)).astype(np.float32))
    np.testing.assert_array_equal(numpy(moe_ffn(x, tokens, w1, w2, output_dtype=ms.float32)),
                                  numpy(moe_ffn(x, tokens, w1, w2)))
    # and on the int8 path, where it picks y's dtype
    cell = MoeFFN(2, 8, 5)
    for dtype in (ms.float32, ms.bfloat16, ms.float16):
        q = quantize_moe_ffn(cell, numpy(x), np.array([3, 1]), output_dtype=dtype)
        assert q.output_dtype == ms_moe_ops.ops._checks.dtype_name(dtype)
        assert q(x, tokens).dtype == dtype
        y = moe_ffn(Tensor(np.ones((4, 8), np.int8)), tokens, q.weight1, q.weight2, None, None,
                    q.scale, q.offset, q.deq_scale1, q.deq_scale2, output_dtype=dtype)
        assert y.dtype == dtype


@needs_kernels("on CPU the int8 path runs on the kernel only", other_devices_too=True)
def test_output_dtype_as_dtype_object_in_graph_mode(rng):
    tokens = tensor(np.array([3, 1], np.int64))
    q = quantize_moe_ffn(MoeFFN(2, 8, 5), rng.standard_normal((4, 8)).astype(np.float32),
                         np.array([3, 1]), output_dtype="float32")
    x = Tensor(np.ones((4, 8), np.int8))
    fn = lambda x, t: moe_ffn(x, t, q.weight1, q.weight2, None, None,  # noqa: E731
                              q.scale, q.offset, q.deq_scale1, q.deq_scale2,
                              output_dtype=ms.float32)
    y = run(fn, x, tokens, mode="graph")
    assert y.dtype == ms.float32
    np.testing.assert_array_equal(numpy(y), numpy(fn(x, tokens)))


@pytest.mark.parametrize("call,error,words", [
    (lambda: MoELayer(8.0, 16, 4, 2), TypeError, r"hidden_size must be an int, got float \(8.0\)"),
    (lambda: MoELayer(np.float64(8), 16, 4, 2), TypeError,
     "hidden_size must be an int, got float64"),
    (lambda: MoELayer(8, 16, 4, True), TypeError, r"top_k must be an int, got bool \(True\)"),
    (lambda: MoELayer(8, 16, 4, 2, n_shared_experts=np.int64(-1)), ValueError,
     "n_shared_experts must be an int >= 0, got -1"),
    (lambda: GatingTopK(8, np.int32(0), 1), ValueError, "num_experts must be an int >= 1, got 0"),
    (lambda: GatingTopK(8, 4, 2, n_group="2"), TypeError,
     r"n_group must be an int, got str \('2'\)"),
    (lambda: MoeFFN(4, 8, "8"), TypeError, "ffn_hidden_size must be an int, got str"),
    (lambda: moe_gating_top_k(tensor(np.zeros((2, 8), np.float32)), np.float32(2)), TypeError,
     r"attribute 'k' must be int, got float32 \(2.0\)"),
    (lambda: swiglu_group(tensor(np.zeros((2, 8), np.float32)), clamp_limit="1"), TypeError,
     "attribute 'clamp_limit' must be float, got str"),
    (lambda: quantize_moe_ffn(MoeFFN(2, 8, 5), np.zeros((4, 8), np.float32), np.array([3, 1]),
                              output_dtype=ms.int32), ValueError,
     "output_dtype must be one of float16, bfloat16, float32 .*, got mindspore.int32"),
    (lambda: quantize_moe_ffn(MoeFFN(2, 8, 5), np.zeros((4, 8), np.float32), np.array([3, 1]),
                              output_dtype=16), TypeError,
     r"output_dtype must be .*, got int \(16\)"),
    (lambda: moe_ffn(Tensor(np.ones((4, 8), np.int8)), Tensor(np.array([4], np.int64)),
                     Tensor(np.ones((1, 8, 5), np.int8)), Tensor(np.ones((1, 5, 8), np.int8)),
                     output_dtype=ms.int8), ValueError,
     "attribute 'output_dtype' must be None or one of"),
])
def test_bad_arguments_say_what_was_wrong(call, error, words):
    with pytest.raises(error, match=words):
        call()
