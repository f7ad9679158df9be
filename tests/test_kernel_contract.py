"""The CPU kernels never trust their caller: every shape relation they rely on is checked from the
shapes they receive (a graph loaded from MINDIR runs none of the Python inference), data faults
raise an exception that carries the operator and the reason in PyNative and GRAPH mode, counts
near 2**63 saturate instead of wrapping, and empty rows work."""
import os
import re

import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, ops

from ms_moe_ops import reference as ref
from ms_moe_ops import (grouped_matmul, moe_ffn, moe_token_permute, moe_token_unpermute,
                        swiglu_group, swiglu_group_quant_grad)
from ms_moe_ops.ops import _platform
from ms_moe_ops.ops._impls import kernel_library
from conftest import assert_close, kernels_missing, needs_kernels, numpy, run, tensor

INT64_MAX = 2 ** 63 - 1
kernel_checks = needs_kernels("these are the CPU kernels' own checks")


# -- swiglu: group counts near 2**63 saturate (they used to wrap and zero every row) -------------

SATURATING = [[1, INT64_MAX], [INT64_MAX, INT64_MAX], [INT64_MAX], [2 ** 62, 2 ** 62],
              [0, INT64_MAX, 0], [3, INT64_MAX - 2]]


@pytest.mark.parametrize("counts", SATURATING)
@pytest.mark.parametrize("impl", ["kernel", "composition"])
@pytest.mark.slow_in_graph
def test_swiglu_counts_near_int64_max_keep_every_row(counts, impl, mode, rng, monkeypatch):
    if impl == "kernel" and kernels_missing():
        pytest.skip(f"the CPU kernel: {kernels_missing()}")
    monkeypatch.setenv(_platform.IMPL_ENV, impl)
    x = rng.normal(size=(4, 8)).astype(np.float32)
    w = rng.uniform(0.1, 1, (4, 1)).astype(np.float32)
    gi = Tensor(np.array(counts, np.int64))
    expected = ref.swiglu_group(x, w)  # every row: the counts cover more than 4 rows
    y = run(swiglu_group, tensor(x), tensor(w), gi, mode=mode)
    assert_close(numpy(y), expected)
    assert_close(ref.swiglu_group(x, w, counts), expected)
    gy = rng.normal(size=(4, 4)).astype(np.float32)
    yo = ref.swiglu_group(x).astype(np.float32)
    gx, gw = run(swiglu_group_quant_grad, tensor(gy), tensor(x), tensor(w), tensor(yo), gi,
                 mode=mode)
    want_gx, want_gw = ref.swiglu_group_quant_grad(gy, x, w, yo)
    assert_close(numpy(gx), want_gx)
    assert_close(numpy(gw), want_gw)
    assert np.count_nonzero(numpy(gx).any(axis=1)) == 4


def test_swiglu_reference_saturates():
    x = np.ones((3, 4))
    for counts, rows in (([INT64_MAX, INT64_MAX], 3), ([1, 1], 2), ([0], 0), ([2 ** 62] * 4, 3)):
        y = ref.swiglu_group(x, group_index=np.array(counts, np.int64))
        assert np.count_nonzero(y.any(axis=1)) == rows
    with pytest.raises(ValueError):
        ref.swiglu_group(x, group_index=np.array([-2 ** 63, 1], np.int64))


def _swiglu_grouped(x, group_index):
    return swiglu_group(x, None, group_index)


@kernel_checks
@pytest.mark.slow_in_graph
def test_swiglu_most_negative_count_is_a_data_fault(mode):
    gi = Tensor(np.array([INT64_MAX, -2 ** 63], np.int64))
    with pytest.raises(RuntimeError, match=r"ms_moe_ops.swiglu_group: group_index\[1\] = "
                                           r"-9223372036854775808 is negative"):
        numpy(run(_swiglu_grouped, tensor(np.ones((2, 4), np.float32)), gi, mode=mode))


# -- moe_token_permute with empty rows -------------------------------------------------------------

def _permute4(x, idx):
    return moe_token_permute(x, idx, 4)


def _unpermute2(permuted, sorted_index):
    return moe_token_unpermute(permuted, sorted_index, top_k=2)


@pytest.mark.parametrize("impl", ["kernel", "composition"])
def test_permute_with_no_hidden_width(impl, mode, monkeypatch):
    if impl == "kernel" and kernels_missing():
        pytest.skip(f"the CPU kernel: {kernels_missing()}")
    monkeypatch.setenv(_platform.IMPL_ENV, impl)
    idx = np.array([[2, 0], [1, 2], [0, 0]], np.int32)
    x = np.zeros((3, 0), np.float32)
    permuted, sorted_index, counts = run(_permute4, tensor(x), Tensor(idx), mode=mode)
    want = ref.moe_token_permute(x, idx, 4)
    assert permuted.shape == (6, 0)
    np.testing.assert_array_equal(sorted_index.asnumpy(), want[1])
    np.testing.assert_array_equal(counts.asnumpy(), want[2])
    out = run(_unpermute2, permuted, sorted_index, mode=mode)
    assert out.shape == (3, 0)


# -- the reason reaches the exception -----------------------------------------------------------------

@kernel_checks
def test_data_fault_message_reaches_the_exception(mode):
    idx = np.array([[0, 1], [7, 2]], np.int32)
    with pytest.raises(RuntimeError, match=r"ms_moe_ops\.moe_token_permute: expert_idx\[1\]\[0\] = "
                                           r"7 is outside \[0, 4\)"):
        numpy(run(_permute4, tensor(np.ones((2, 3), np.float32)), Tensor(idx), mode=mode)[0])
    # the process goes on: the next call works
    out = run(_permute4, tensor(np.ones((2, 3), np.float32)),
              Tensor(np.array([[0, 1], [3, 2]], np.int32)), mode=mode)
    np.testing.assert_array_equal(out[2].asnumpy(), [1, 1, 1, 1])


# -- moe_ffn's counts cover every row unless the call allows a padded batch ---------------------------

def _ffn_case(rng, m=6):
    x = rng.normal(size=(m, 4)).astype(np.float32)
    w1 = rng.normal(size=(2, 4, 3)).astype(np.float32)
    w2 = rng.normal(size=(2, 3, 4)).astype(np.float32)
    return x, w1, w2


@pytest.mark.parametrize("counts, cumulative", [([2, 3], False), ([2, 5], True), ([0, 0], False)])
@pytest.mark.slow_in_graph
def test_moe_ffn_counts_short_of_m_are_a_data_fault(counts, cumulative, mode, rng):
    if kernels_missing():
        pytest.skip(f"the CPU kernel's data check: {kernels_missing()}")
    x, w1, w2 = _ffn_case(rng)
    tokens = Tensor(np.array(counts, np.int64))

    def call(a, t, b, c):
        return moe_ffn(a, t, b, c, activation="relu", tokens_index_flag=cumulative)

    with pytest.raises(RuntimeError, match=r"ms_moe_ops\.moe_ffn: expert_tokens cover \d of the 6 "
                                           r"rows of x; they must cover all of them"):
        numpy(run(call, tensor(x), tokens, tensor(w1), tensor(w2), mode=mode))
    with pytest.raises(ValueError, match="padded=False"):
        ref.moe_ffn(x, np.array(counts), w1, w2, activation="relu", tokens_index_flag=cumulative)


@pytest.mark.parametrize("cumulative", [False, True])
def test_moe_ffn_padded_batch_when_allowed(cumulative, mode, rng):
    x, w1, w2 = _ffn_case(rng)
    counts = np.array([2, 3], np.int64)
    tokens = np.cumsum(counts) if cumulative else counts

    def call(a, t, b, c):
        return moe_ffn(a, t, b, c, activation="relu", tokens_index_flag=cumulative, padded=True)

    y = numpy(run(call, tensor(x), Tensor(tokens), tensor(w1), tensor(w2), mode=mode))
    want = ref.moe_ffn(x, tokens, w1, w2, activation="relu", tokens_index_flag=cumulative,
                       padded=True)
    assert_close(y, want)
    assert not y[5:].any()


def _exact_groups(x, w, group_list):
    return grouped_matmul(x, w, group_list, padded=False)


@kernel_checks
@pytest.mark.slow_in_graph
def test_grouped_matmul_exact_cover_on_request(mode, rng):
    x = rng.normal(size=(5, 3)).astype(np.float32)
    w = rng.normal(size=(2, 3, 4)).astype(np.float32)
    gl = Tensor(np.array([1, 2], np.int64))
    y = numpy(run(grouped_matmul, tensor(x), tensor(w), gl, mode=mode))
    assert not y[3:].any()  # padded by default, as SPEC §5 and Ascend's grouped matmul allow
    with pytest.raises(RuntimeError, match="group_list cover 3 of the 5 rows"):
        numpy(run(_exact_groups, tensor(x), tensor(w), gl, mode=mode))


# -- the kernels called as another front end would: no Python inference in between --------------------

def _raw(library, symbol, out_shapes, out_dtypes, **attrs):
    """The kernel `symbol` as a Custom primitive whose output shapes are what a caller says, with
    the attributes as given: what a graph built elsewhere could hand the kernel. `library` is a
    link of its own to the kernel library: MindSpore keys a Custom primitive's attributes and
    kernel by its "path:function" string, which the package's own primitives must not share."""
    single = len(out_shapes) == 1
    prim = ops.Custom(f"{library}:{symbol}",
                      out_shape=lambda *_: list(out_shapes[0]) if single else tuple(map(list, out_shapes)),
                      out_dtype=lambda *_: out_dtypes[0] if single else tuple(out_dtypes),
                      func_type="aot")
    for key, value in attrs.items():
        prim.add_prim_attr(key, value)
    return prim


ROUTER = dict(k=2, k_group=1, group_count=1, group_select_mode=0, renorm=0, norm_type=1,
              out_flag=True, routed_scaling_factor=1.0, eps=1e-20)
F32, I32, I64 = ms.float32, ms.int32, ms.int64


def _f(*shape):
    return Tensor(np.ones(shape, np.float32))


def _i(values, dtype=np.int32):
    return Tensor(np.array(values, dtype))


# (case id, symbol, inputs, output shapes, output dtypes, attributes, words of the message)
DIRECT = [
    ("gating k above the kept experts", "MoeGatingTopK", lambda: (_f(3, 8), None),
     [(3, 6), (3, 6), (3, 8)], [F32, I32, F32], dict(ROUTER, k=6, k_group=1, group_count=4),
     "attribute 'k' must be in"),
    ("gating k above 32 and the candidates", "MoeGatingTopK", lambda: (_f(3, 64), None),
     [(3, 40), (3, 40), (3, 64)], [F32, I32, F32], dict(ROUTER, k=40, k_group=1, group_count=2),
     "attribute 'k' must be in"),
    ("gating output too small", "MoeGatingTopK", lambda: (_f(3, 8), None),
     [(2, 2), (3, 2), (3, 8)], [F32, I32, F32], ROUTER, "'y' must have shape [3, 2]"),
    ("gating k_group above group_count", "MoeGatingTopK", lambda: (_f(3, 8), None),
     [(3, 2), (3, 2), (3, 8)], [F32, I32, F32], dict(ROUTER, k_group=3, group_count=2),
     "'k_group' must be in"),
    ("gating backward N above 2048", "MoeGatingTopKBackward",
     lambda: (_f(2, 3000), _f(2, 2), _i(np.zeros((2, 2)))), [(2, 3000)], [F32], ROUTER,
     "must be in [1, 2048]"),
    ("gating backward K above N", "MoeGatingTopKBackward",
     lambda: (_f(2, 16), _f(2, 2100), _i(np.zeros((2, 2100)))), [(2, 16)], [F32], ROUTER,
     "1 <= K <= N=16"),
    ("gating backward expert_idx shape", "MoeGatingTopKSoftmaxBackward",
     lambda: (_f(2, 16), _f(2, 3), _i(np.zeros((2, 2)))), [(2, 16)], [F32], ROUTER,
     "'expert_idx' must have shape [2, 3]"),
    ("gating whole backward grad_x_norm shape", "MoeGatingTopKGrad",
     lambda: (_f(2, 16), _f(2, 3), _i(np.zeros((2, 3))), _f(2, 15)), [(2, 16)], [F32], ROUTER,
     "'grad_x_norm' must have shape [2, 16]"),
    ("gating whole backward norm_type", "MoeGatingTopKGrad",
     lambda: (_f(2, 16), _f(2, 3), _i(np.zeros((2, 3))), None), [(2, 16)], [F32],
     dict(ROUTER, norm_type=2), "norm_type and renorm must be 0 or 1"),
    ("unpermute probs rows", "MoeTokenUnpermute",
     lambda: (_f(6, 4), _i(np.arange(6)), _f(2, 3)), [(3, 4)], [F32], dict(top_k=0),
     "'out' must have shape [2, 4]"),
    ("unpermute backward grad_probs", "MoeTokenUnpermuteBackward",
     lambda: (_f(6, 4), _i(np.arange(6)), _f(3, 2), _f(3, 4)), [(6, 4), (2, 3)], [F32, F32],
     dict(top_k=0), "'grad_probs' must have shape [3, 2]"),
    ("permute output rows", "MoeTokenPermute", lambda: (_f(4, 3), _i(np.zeros((4, 2)))),
     [(5, 3), (8,), (4,)], [F32, I32, I64], dict(num_experts=4),
     "'permuted' must have shape [8, 3]"),
    ("permute counts", "MoeTokenPermute", lambda: (_f(4, 3), _i(np.zeros((4, 2)))),
     [(8, 3), (8,), (3,)], [F32, I32, I64], dict(num_experts=4), "'counts' must have shape [4]"),
    ("grouped_matmul weight K", "GroupedMatmul",
     lambda: (_f(5, 3), _f(2, 4, 6), _i([2, 3], np.int64), None), [(5, 6)], [F32],
     dict(transpose_x=False, transpose_weight=False, cumulative=False),
     "'weight' must have shape [2, 3, 6]"),
    ("grouped_matmul transposed weight", "GroupedMatmul",
     lambda: (_f(5, 3), _f(2, 6, 4), _i([2, 3], np.int64), None), [(5, 6)], [F32],
     dict(transpose_x=False, transpose_weight=True, cumulative=False),
     "'weight' must have shape [2, 6, 3]"),
    ("grouped_matmul output", "GroupedMatmul",
     lambda: (_f(5, 3), _f(2, 3, 6), _i([2, 3], np.int64), None), [(4, 6)], [F32],
     dict(transpose_x=False, transpose_weight=False, cumulative=False),
     "'out' must have shape [5, 6]"),
    ("swiglu output dtype", "SwigluGroup", lambda: (Tensor(np.ones((2, 8), np.float16)), None, None),
     [(2, 4), (2, 4)], [F32, F32], dict(clamp_limit=0.0), "'y' has dtype float32"),
    ("swiglu backward grad_y dtype", "SwigluGroupQuantGrad",
     lambda: (Tensor(np.ones((2, 4), np.float16)), _f(2, 8), None, None, None),
     [(2, 8), (2, 1)], [F32, F32], dict(clamp_limit=0.0), "'grad_y' has dtype float16"),
    # a gradient whose last dimension alone is wrong (every other dimension right)
    ("gating whole backward grad_y width", "MoeGatingTopKGrad",
     lambda: (_f(2, 16), _f(2, 4), _i(np.zeros((2, 3))), None), [(2, 16)], [F32], ROUTER,
     "'expert_idx' must have shape [2, 4]"),
    ("swiglu backward grad_y width", "SwigluGroupQuantGrad",
     lambda: (_f(2, 3), _f(2, 8), None, None, None), [(2, 8), (2, 1)], [F32, F32],
     dict(clamp_limit=0.0), "'grad_y' must have shape [2, 4]"),
    ("unpermute backward grad width", "MoeTokenUnpermuteBackward",
     lambda: (_f(6, 4), _i(np.arange(6)), _f(3, 2), _f(3, 5)), [(6, 4), (3, 2)], [F32, F32],
     dict(top_k=0), "'grad_out' must have shape [3, 4]"),
    ("moe_ffn weight2", "MoeFFN",
     lambda: (_f(4, 3), _i([2, 2], np.int64), _f(2, 3, 5), None, _f(2, 4, 3), None, None, None,
              None, None), [(4, 3)], [F32],
     dict(activation="relu", tokens_index_flag=False, output_dtype=""),
     "'weight2' must have shape [2, 5, 3]"),
    ("moe_ffn expert count", "MoeFFN",
     lambda: (_f(4, 3), _i(np.zeros(300), np.int64), _f(300, 3, 1), None, _f(300, 1, 3), None,
              None, None, None, None), [(4, 3)], [F32],
     dict(activation="relu", tokens_index_flag=False, output_dtype=""), "must be in [1, 256]"),
]


@kernel_checks
@pytest.mark.parametrize("case", DIRECT, ids=[c[0] for c in DIRECT])
def test_kernel_checks_what_it_relies_on(case, mode, tmp_path):
    _, symbol, inputs, shapes, dtypes, attrs, words = case
    library = tmp_path / os.path.basename(kernel_library())
    library.symlink_to(kernel_library())
    prim = _raw(library, symbol, shapes, dtypes, **attrs)
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        with pytest.raises(RuntimeError, match="ms_moe_ops.*" + re.escape(words)):
            out = prim(*inputs())
            for o in (out if isinstance(out, tuple) else (out,)):
                o.asnumpy()
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)

