"""Properties of every operator against its golden model (ms_moe_ops/reference.py), element by
element: hypothesis draws the shapes (sizes next to every tile, block and vector width of
custom_aot/: 8 and 16 lanes, the router's 32-wide top-k, the 64-row and 64/128-column tiles of
gemm.h, the 128-column blocks of the transposed-x form, the 512-element blocks of swiglu.cc and
of the half-precision row blocks, the int8 FFN's 6 x 64 register tiles and 96-row chunks, empty
groups, one row, K = N), every dtype and every attribute combination; the data comes from a
drawn seed. Every property holds for the implementation chosen here (the kernel on CPU, under
every instruction-set path: every_isa, the lower paths in the slow pass) and for the composition
(MS_MOE_OPS_IMPL=composition, which runs wherever no kernel does; in the slow pass). Tolerances: float32 within a few float32 roundings per summed term, float16/bfloat16
the float32 result rounded once (conftest.assert_rounded)."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import assume, example, given, strategies as st  # noqa: E402
from mindspore import Tensor  # noqa: E402

from ms_moe_ops import (grouped_matmul, moe_ffn, moe_gating_top_k, moe_token_permute,  # noqa: E402
                        moe_token_unpermute, reference as ref)
from ms_moe_ops.ops import OPERATORS  # noqa: E402
from ms_moe_ops.ops.cast import CAST  # noqa: E402
from ms_moe_ops.ops.dequantize import DEQUANTIZE  # noqa: E402
from ms_moe_ops.ops.ffn import FFN_ACTIVATION_GRAD  # noqa: E402
from ms_moe_ops.ops.gating import GATING_BACKWARD, GATING_GRAD, GATING_SOFTMAX_BACKWARD  # noqa: E402
from ms_moe_ops.ops.permute import UNPERMUTE_BACKWARD  # noqa: E402
from ms_moe_ops.ops.rms_norm import ADD_RMS_NORM, RMS_NORM  # noqa: E402
from ms_moe_ops.ops.decode_attention import DECODE_ATTENTION  # noqa: E402
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP, SWIGLU_GROUP_QUANT_GRAD  # noqa: E402
from ms_moe_ops.ops.weight_quant_grouped_matmul import WEIGHT_QUANT_GROUPED_MATMUL  # noqa: E402
from cases import assert_int8_matches, int8_ffn, int8_ffn_case  # noqa: E402
from ms_moe_ops.ops import _platform  # noqa: E402
from conftest import (assert_close, assert_rounded, examples, isa_paths, kernels_missing,  # noqa: E402
                      numpy, rounded, tensor)

pytestmark = pytest.mark.every_isa

EPS32 = 2.0 ** -24
DTYPES = st.sampled_from(["float32", "float16", "bfloat16"])
SEEDS = st.integers(0, 2 ** 32 - 1)
ACTIVATIONS = ("fastgelu", "gelu", "relu", "silu")


@pytest.fixture(params=["preferred", pytest.param("composition", marks=pytest.mark.slow)])
def implementation(request, monkeypatch):
    """The implementation under test: the one the resolver prefers here, or the composition
    (which runs no kernel: once, on the best instruction-set path; in the slow pass, as
    tests/test_compositions.py covers it in the default run)."""
    if request.param == "composition":
        lower = getattr(request.node, "callspec", None) and \
            request.node.callspec.params.get("isa") not in (None, (isa_paths() or [None])[-1])
        if lower:
            pytest.skip("the composition runs no kernel: its run on the best path covers it")
        monkeypatch.setenv(_platform.IMPL_ENV, "composition")
    return request.param


def near(*points, lo=1):
    """Sizes at and next to each point (a tile, block or vector width)."""
    return st.sampled_from(sorted({q for p in points for q in (p - 1, p, p + 1) if q >= lo}))


# vector widths (8 and 16 lanes), the 64/128-column tiles, and small sizes of every kind
WIDTHS = st.one_of(near(1, 8, 16, 32, 64, 128), st.integers(1, 24))


def agree(actual, exact, dtype, size=None, terms=1):
    """actual (a kernel's output in dtype) against the float64 golden value on the same inputs:
    float32 within (terms + 1) * 8 float32 roundings of `size` (the sum of the magnitudes of what
    was added up, default |exact|); float16/bfloat16 that, then rounded once to nearest."""
    actual = numpy(actual) if isinstance(actual, Tensor) else np.asarray(actual)
    exact = np.asarray(exact, np.float64)
    size = np.abs(exact) if size is None else np.asarray(size, np.float64)
    err = 8 * (terms + 1) * EPS32 * size
    if exact.size == 0:
        assert actual.shape == exact.shape, (actual.shape, exact.shape)
    elif dtype == "float32":
        assert_close(actual, exact, "float32", rtol=0.0, atol=err)
    else:
        assert_rounded(actual, exact, dtype, err=err)


def data(seed):
    return np.random.default_rng(seed)


def test_every_operator_has_a_property():
    """A new operator needs its property here."""
    covered = {"moe_gating_top_k", "moe_gating_top_k_backward", "moe_gating_top_k_softmax_backward",
               "moe_gating_top_k_grad", "swiglu_group", "swiglu_group_quant_grad", "moe_ffn",
               "moe_ffn_activation_grad", "grouped_matmul", "moe_token_permute",
               "moe_token_unpermute", "moe_token_unpermute_backward", "cast", "dequantize",
               "rms_norm", "add_rms_norm", "decode_attention", "weight_quant_grouped_matmul"}
    assert {op.name for op in OPERATORS} == covered


# -- router ---------------------------------------------------------------------------------------

@st.composite
def router_cases(draw):
    group_count = draw(st.sampled_from([1, 1, 2, 3, 4, 8, 32]))
    per_group = draw(st.one_of(near(1, 2, 8, 16, 32, 64), st.integers(1, 12)).filter(
        lambda p: p * group_count <= 2048))
    mode = draw(st.integers(0, 1)) if per_group >= 2 else 0
    k_group = draw(st.integers(1, group_count))
    k = min(draw(st.one_of(near(1, 16, 32), st.integers(1, 40))), k_group * per_group)
    attrs = dict(k=k, k_group=k_group, group_count=group_count, group_select_mode=mode,
                 norm_type=draw(st.integers(0, 1)), renorm=draw(st.integers(0, 1)),
                 out_flag=draw(st.booleans()),
                 routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, 0.25, -1.5])),
                 eps=draw(st.sampled_from([1e-20, 1e-6, 0.5])))
    rows = draw(st.one_of(st.just(1), near(8, 16), st.integers(1, 6)))
    return rows, per_group * group_count, attrs, draw(st.booleans()), draw(DTYPES), draw(SEEDS)


@given(case=router_cases())
@examples(25)
def test_router(case, implementation):
    m, n, attrs, with_bias, dtype, seed = case
    rng = data(seed)
    x = rounded(rng.normal(0, 2, (m, n)), dtype)
    bias = rounded(rng.uniform(-0.2, 0.2, n), dtype) if with_bias else None
    y, idx, x_norm = moe_gating_top_k(tensor(x, dtype), bias=None if bias is None else
                                      tensor(bias, dtype), **attrs)
    _, _, golden_norm = ref.moe_gating_top_k(x, **attrs)
    assert_close(numpy(x_norm), golden_norm, "float32")  # (MindSpore's softmax: ~60 roundings)
    # the selection is exact from the kernel's own float32 scores (reference.gating_from_scores)
    choice = {a: attrs[a] for a in attrs if a != "out_flag"}
    golden_y, golden_idx = ref.gating_from_scores(numpy(x_norm), bias=bias, **choice)
    np.testing.assert_array_equal(numpy(idx), golden_idx)
    agree(y, golden_y, dtype, terms=attrs["k"])


@st.composite
def router_backward_cases(draw):
    op = draw(st.sampled_from([GATING_BACKWARD, GATING_SOFTMAX_BACKWARD, GATING_GRAD]))
    n = draw(st.one_of(near(2, 8, 16, 32, 64, 2048, lo=2), st.integers(2, 40)).filter(lambda v: v <= 2048))
    if op is GATING_GRAD:
        n = draw(st.one_of(st.just(1), st.just(n)))
    k = min(draw(st.one_of(near(1, 16, 32), st.integers(1, 12))), n)
    attrs = dict(routed_scaling_factor=draw(st.sampled_from([1.0, 2.5, -0.5])),
                 eps=draw(st.sampled_from([1e-20, 1e-6, 0.5])))
    if op is not GATING_BACKWARD:
        attrs["renorm"] = draw(st.integers(0, 1))
    if op is GATING_GRAD:
        attrs["norm_type"] = draw(st.integers(0, 1))
    with_grad_x_norm = op is GATING_GRAD and draw(st.booleans())
    rows = draw(st.one_of(st.just(1), st.integers(1, 6), near(16)))
    return op, rows, n, k, attrs, with_grad_x_norm, draw(DTYPES), draw(SEEDS)


@given(case=router_backward_cases())
@examples(25)
def test_router_backwards(case, implementation):
    op, m, n, k, attrs, with_dxn, dtype, seed = case
    rng = data(seed)
    softmax = op is GATING_SOFTMAX_BACKWARD or attrs.get("norm_type") == 0
    logits = rng.normal(0, 2, (m, n))
    x_norm = (ref._softmax(logits) if softmax else 1 / (1 + np.exp(-logits))).astype(np.float32)
    grad_y = rounded(rng.normal(size=(m, k)), dtype)
    idx = rng.integers(0, n, (m, k)).astype(np.int32)  # duplicates included: they are summed
    dxn = rng.normal(size=(m, n)).astype(np.float32) if with_dxn else None
    inputs = [Tensor(x_norm), tensor(grad_y, dtype), Tensor(idx)]
    if op is GATING_GRAD:
        inputs.append(None if dxn is None else Tensor(dxn))
        golden = ref.moe_gating_top_k_grad(x_norm, grad_y, idx, dxn, **attrs)
    elif op is GATING_SOFTMAX_BACKWARD:
        golden = ref.moe_gating_top_k_softmax_backward(x_norm, grad_y, idx, **attrs)
    else:
        golden = ref.moe_gating_top_k_backward(x_norm, grad_y, idx, **attrs)
    got = op(*inputs, **attrs)
    # what a row adds up: K gradients of size |s g| / D (or |s g|), and grad_x_norm
    w = np.take_along_axis(x_norm.astype(np.float64), idx, 1)
    renorm = not softmax or attrs.get("renorm") == 1
    d = w.sum(1, keepdims=True) + attrs["eps"] if renorm else 1.0
    row = abs(attrs["routed_scaling_factor"]) * np.abs(grad_y).max(1, keepdims=True) / d * (2 + w.sum(1, keepdims=True) / d)
    if dxn is not None:
        row = row + np.abs(dxn).max(1, keepdims=True)
    agree(got, golden, dtype, size=np.broadcast_to(row, golden.shape), terms=k + 2)


# -- swiglu ---------------------------------------------------------------------------------------

@st.composite
def swiglu_cases(draw):
    lead = draw(st.one_of(st.tuples(st.integers(1, 9)), st.tuples(st.integers(1, 3), st.integers(1, 4)),
                          st.just((1,))))
    h = draw(st.one_of(WIDTHS, near(256, 512)))
    counts = draw(st.one_of(st.none(), st.lists(st.integers(0, 6), min_size=1, max_size=4)))
    clamp = draw(st.sampled_from([0.0, -1.0, 0.5, 1.5, 3.0]))
    return lead, h, counts, clamp, draw(st.booleans()), draw(DTYPES), draw(SEEDS)


def _swiglu_data(case):
    lead, h, counts, clamp, weighted, dtype, seed = case
    rng = data(seed)
    x = rng.uniform(-4, 4, lead + (2 * h,))
    if clamp > 0:  # the clamp's kinks exactly: x0 = c, x1 = +-c (gradient zero there, strict)
        kinks = rng.random(x.shape) < 0.15
        x[kinks] = np.where(rng.random(x.shape) < 0.5, clamp, -clamp)[kinks]
    x = rounded(x, dtype)
    w = rng.uniform(-1, 1, lead + (1,)).astype(np.float32) if weighted else None
    gi = None if counts is None else np.array(counts, np.int64)
    return x, w, gi, rng


# MindSpore's own CPU sigmoid, which the composition calls, is within 80 float32 roundings
# (measured on 2^20 normal inputs of scale 4); the kernel's exp within a few
SIGMOID_TERMS = {"preferred": 4, "composition": 12}


@given(case=swiglu_cases())
@examples(20)
def test_swiglu_forward(case, implementation):
    _, h, _, clamp, _, dtype, _ = case
    x, w, gi, _ = _swiglu_data(case)
    y, y_origin = SWIGLU_GROUP(tensor(x, dtype), None if w is None else Tensor(w),
                               None if gi is None else Tensor(gi), clamp_limit=clamp)
    terms = SIGMOID_TERMS[implementation]
    agree(y, ref.swiglu_group(x, w, gi, clamp), dtype, terms=terms)
    agree(y_origin, ref.swiglu_group(x, None, gi, clamp), dtype, terms=terms)


@given(case=swiglu_cases())
@examples(20)
def test_swiglu_backward(case, implementation):
    _, h, _, clamp, weighted, dtype, _ = case
    x, w, gi, rng = _swiglu_data(case)
    gy = rounded(rng.normal(size=x.shape[:-1] + (h,)), dtype)
    yo = rounded(ref.swiglu_group(x, None, gi, clamp), dtype) if weighted else None
    gx, gw = SWIGLU_GROUP_QUANT_GRAD(tensor(gy, dtype), tensor(x, dtype),
                                     None if w is None else Tensor(w),
                                     None if yo is None else tensor(yo, dtype),
                                     None if gi is None else Tensor(gi), clamp_limit=clamp)
    exact_x, exact_w = ref.swiglu_group_quant_grad(gy, x, w, yo, gi, clamp)
    a, b = x[..., :h], x[..., h:]
    if clamp > 0:
        a, b = np.minimum(a, clamp), np.clip(b, -clamp, clamp)
    g = np.abs(gy) * (1.0 if w is None else np.abs(w))
    size = np.concatenate([g * np.abs(b) * (1 + np.abs(a)), g * np.abs(a)], -1)  # cancellation
    agree(gx, exact_x, dtype, size=size, terms=SIGMOID_TERMS[implementation])
    if w is None:
        assert not numpy(gw).any()
    else:
        agree(gw, exact_w, "float32", size=(np.abs(gy) * np.abs(yo)).sum(-1, keepdims=True), terms=h)


# -- the FFN activations, every rank the kernels take (1..8) ----------------------------------------

@st.composite
def activation_cases(draw):
    rank = draw(st.integers(1, 8))
    budget = 3000
    shape = []
    for _ in range(rank):
        d = draw(st.one_of(st.integers(1, 3), near(8, 16)))
        shape.append(max(1, min(d, budget // max(1, int(np.prod(shape or [1]))))))
    return tuple(shape), draw(st.sampled_from(ACTIVATIONS)), draw(DTYPES), draw(SEEDS)


@given(case=activation_cases())
@examples(20)
def test_activation_and_its_gradient(case, implementation):
    shape, activation, dtype, seed = case
    rng = data(seed)
    h = rng.uniform(-5, 5, shape)
    h[rng.random(shape) < 0.1] = 0.0  # relu's kink: the derivative there is 0 (v > 0)
    h = rounded(h, dtype)
    ga = rounded(rng.normal(size=shape), dtype)
    gh, a = FFN_ACTIVATION_GRAD(tensor(h, dtype), tensor(ga, dtype), activation=activation)
    assert gh.shape == a.shape == shape
    agree(a, ref.ffn_activation(activation, h), dtype, size=np.abs(h), terms=2)
    step = 1e-6
    slope = (ref.ffn_activation(activation, h + step) - ref.ffn_activation(activation, h - step)) / (2 * step)
    if activation == "relu":
        slope = (h > 0).astype(np.float64)
    agree(gh, ga * slope, dtype, size=np.abs(ga) * (1 + np.abs(h)), terms=2)


# -- grouped matmul -------------------------------------------------------------------------------

@st.composite
def gmm_cases(draw):
    form = draw(st.sampled_from(["plain", "transpose_weight", "transpose_x"]))
    big = draw(st.integers(0, 4)) == 0  # groups of more rows than a tile (64) or a block (512)
    count = near(64, 256, 512, lo=0) if big else st.integers(0, 9)
    counts = draw(st.lists(st.one_of(count, st.just(0)), min_size=1, max_size=5))
    padded = draw(st.booleans())
    pad = draw(st.integers(0, 3)) if padded else 0
    k_sizes = st.one_of(near(1, 8, 16), st.integers(1, 5)) if big else \
        st.one_of(WIDTHS, near(255, 256, 384) if form == "transpose_x" else WIDTHS)
    k = draw(k_sizes)
    n = k if draw(st.integers(0, 5)) == 0 else draw(
        st.one_of(near(1, 8, 16), st.integers(1, 5)) if big else st.one_of(WIDTHS, near(130, 200, 257)))
    bias = form != "transpose_x" and draw(st.booleans())
    return (form, counts, pad, padded, k, n, bias, draw(st.booleans()), draw(DTYPES), draw(SEEDS))


@given(case=gmm_cases())
@example(case=("plain", [3, 2], 0, False, 40, 200, False, False, "float16", 1))  # N > 128, few rows
@example(case=("transpose_weight", [2, 0, 1], 1, True, 33, 257, True, True, "bfloat16", 2))
@example(case=("transpose_weight", [3, 2], 0, False, 40, 200, True, False, "float32", 3))  # column
@example(case=("plain", [5, 0, 7], 0, False, 16, 300, False, False, "float32", 4))  # tiles (float32)
# few rows' column passes wider than 256 and past 1024, K not a multiple of the 4-row unroll
@example(case=("plain", [1, 2], 0, False, 37, 1100, False, False, "float32", 5))
@example(case=("plain", [1, 1, 1, 1], 1, True, 38, 1100, True, False, "float32", 6))
@examples(30)
def test_grouped_matmul(case, implementation):
    form, counts, pad, padded, k, n, with_bias, cumulative, dtype, seed = case
    rng = data(seed)
    m = sum(counts) + pad
    gl = np.array(counts, np.int64)
    x = rounded(rng.normal(size=(m, k)), dtype)
    if form == "transpose_x":
        w = rounded(rng.normal(size=(m, n)), dtype)
    else:
        w = rounded(rng.normal(size=(len(counts), k, n)), dtype)
    b = rounded(rng.normal(size=(len(counts), n)), dtype) if with_bias else None
    stored = w.transpose(0, 2, 1).copy() if form == "transpose_weight" else w
    kw = dict(transpose_x=form == "transpose_x", padded=padded)
    y = grouped_matmul(tensor(x, dtype), tensor(stored, dtype),
                       tensor(np.cumsum(gl) if cumulative else gl),
                       None if b is None else tensor(b, dtype), cumulative=cumulative,
                       transpose_weight=form == "transpose_weight", **kw)
    exact = ref.grouped_matmul(x, w, gl, b, **kw)
    size = ref.grouped_matmul(np.abs(x), np.abs(w), gl, None if b is None else np.abs(b), **kw)
    agree(y, exact, dtype, size=size, terms=max(counts) if kw["transpose_x"] else k)


# -- moe_ffn, float and int8 ----------------------------------------------------------------------

@st.composite
def ffn_cases(draw):
    experts = draw(st.one_of(st.integers(1, 4), near(256, lo=255).filter(lambda e: e <= 256)))
    small = experts > 4
    counts = [draw(st.integers(0, 1 if small else 9)) for _ in range(experts)]
    h = draw(st.integers(1, 3)) if small else draw(WIDTHS)
    f = draw(st.integers(1, 3)) if small else draw(st.one_of(WIDTHS, st.just(h)))
    padded = draw(st.booleans())
    return (counts, draw(st.integers(0, 3)) if padded else 0, padded, h, f,
            draw(st.sampled_from(ACTIVATIONS)), draw(st.booleans()), draw(st.booleans()),
            draw(st.booleans()), draw(DTYPES), draw(SEEDS))


@given(case=ffn_cases())
@examples(20)
def test_moe_ffn_float(case, implementation):
    counts, pad, padded, h, f, activation, b1_on, b2_on, cumulative, dtype, seed = case
    assume(implementation != "composition" or len(counts) <= 8)  # (a product per group: slow)
    # (one rounding of the whole FFN is the kernel's: the composition rounds its hidden layer)
    assume(dtype == "float32" or not (kernels_missing() or implementation == "composition"))
    rng = data(seed)
    e, m = len(counts), sum(counts) + pad
    r = lambda *shape: rounded(rng.normal(size=shape) * 0.7, dtype)  # noqa: E731
    x, w1, w2 = r(m, h), r(e, h, f), r(e, f, h)
    b1, b2 = (r(e, f) if b1_on else None), (r(e, h) if b2_on else None)
    tokens = np.array(counts, np.int64)
    t = lambda a: None if a is None else tensor(a, dtype)  # noqa: E731
    y = moe_ffn(t(x), tensor(np.cumsum(tokens) if cumulative else tokens), t(w1), t(w2), t(b1),
                t(b2), activation=activation, tokens_index_flag=cumulative, padded=padded)
    exact = ref.moe_ffn(x, tokens, w1, w2, b1, b2, activation=activation, padded=padded)
    hidden = ref.grouped_matmul(np.abs(x), np.abs(w1), tokens, None if b1 is None else np.abs(b1))
    size = ref.grouped_matmul(hidden, np.abs(w2), tokens, None if b2 is None else np.abs(b2))
    agree(y, exact, dtype, size=size, terms=h + f)


@st.composite
def int8_cases(draw):
    experts = draw(st.integers(1, 4))
    counts = [draw(st.one_of(st.integers(0, 8), near(6, 12, 96, lo=0))) for _ in range(experts)]
    h = draw(st.one_of(st.integers(1, 9), near(4, 16, 64)))
    f = draw(st.one_of(st.integers(1, 9), near(4, 64, 128), st.just(h)))
    return (counts, h, f, draw(st.booleans()), draw(st.sampled_from(["uint64", "float32"])),
            draw(st.sampled_from(ACTIVATIONS)), draw(st.sampled_from(["float16", "bfloat16", "float32"])),
            draw(st.booleans()), draw(SEEDS))


@given(case=int8_cases())
@examples(15)
def test_moe_ffn_int8(case):
    counts, h, f, bias, deq, activation, output_dtype, cumulative, seed = case
    if sum(counts) == 0:
        counts = counts[:-1] + [1]
    v = int8_ffn_case(data(seed), counts, h, f, bias, deq)
    golden = ref.moe_ffn_quant(v["x"], v["tokens"], v["w1"], v["w2"], v["b1"], v["b2"], v["scale"],
                               v["offset"], v["dq1"], v["dq2"], activation=activation,
                               output_dtype=output_dtype)
    if cumulative:
        v = dict(v, tokens=np.cumsum(v["tokens"]))
    y = int8_ffn(v, activation=activation, output_dtype=output_dtype, tokens_index_flag=cumulative)
    assert_int8_matches(y, golden, v, activation)


# -- token permutation ----------------------------------------------------------------------------

@st.composite
def permute_cases(draw):
    t = draw(st.one_of(st.integers(1, 12), near(64)))
    k = draw(st.one_of(st.integers(1, 4), near(8, 16)))
    experts = draw(st.integers(1, 12))
    h = draw(st.one_of(WIDTHS, st.just(0)))
    return t, k, experts, h, draw(st.sampled_from([None, "float32", "same"])), draw(DTYPES), draw(SEEDS)


@given(case=permute_cases())
@examples(20)
def test_permute_unpermute_and_backward(case, implementation):
    t, k, experts, h, probs_kind, dtype, seed = case
    rng = data(seed)
    x = rounded(rng.normal(size=(t, h)), dtype)
    idx = rng.integers(0, experts, (t, k)).astype(np.int32)
    permuted, sorted_index, counts = moe_token_permute(tensor(x, dtype), Tensor(idx), experts)
    golden = ref.moe_token_permute(x, idx, experts)
    np.testing.assert_array_equal(numpy(permuted), golden[0])  # bitwise: rows are moved
    np.testing.assert_array_equal(numpy(sorted_index), golden[1])
    np.testing.assert_array_equal(numpy(counts), golden[2])

    rows = rounded(rng.normal(size=(t * k, h)), dtype)
    pd = dtype if probs_kind == "same" else "float32"
    probs = None if probs_kind is None else rounded(rng.uniform(-1, 1, (t, k)), pd)
    pt = None if probs is None else tensor(probs, pd)
    top_k = 0 if probs is not None else k
    out = moe_token_unpermute(tensor(rows, dtype), Tensor(golden[1]), pt, top_k=top_k)
    exact = ref.moe_token_unpermute(rows, golden[1], probs, top_k=top_k)
    size = ref.moe_token_unpermute(np.abs(rows), golden[1], None if probs is None else np.abs(probs),
                                   top_k=top_k)
    agree(out, exact, dtype, size=size, terms=k)

    g = rounded(rng.normal(size=(t, h)), dtype)
    d_rows, d_probs = UNPERMUTE_BACKWARD(tensor(rows, dtype), Tensor(golden[1]), pt,
                                         tensor(g, dtype), top_k=top_k, with_probs=probs is not None)
    e_rows, e_probs = ref.moe_token_unpermute_backward(rows, golden[1], probs, g, top_k=top_k)
    agree(d_rows, e_rows, dtype)
    size = ref.moe_token_unpermute_backward(np.abs(rows), golden[1], probs, np.abs(g), top_k=top_k)[1]
    agree(d_probs, e_probs, pd if probs is not None else "float32", size=size, terms=h)


# -- cast -----------------------------------------------------------------------------------------

@st.composite
def cast_cases(draw):
    # sizes around the vectors and the threads' blocks (4096 elements; parallel past 16 of them)
    shape = draw(st.one_of(st.tuples(WIDTHS), st.tuples(st.integers(1, 3), near(4096)),
                           st.just((17, 4097))))
    return shape, draw(DTYPES), draw(DTYPES), draw(SEEDS)


@given(case=cast_cases())
@examples(20)
def test_cast(case, implementation):
    shape, source, target, seed = case
    rng = data(seed)
    x = rng.normal(size=shape) * 2.0 ** rng.integers(-30, 30, shape)
    special = rng.random(shape) < 0.1  # zeros, infinities, NaN, float16's limits and subnormals
    x[special] = rng.choice([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65520.0, 1e5, 3e-5,
                             6e-8, -1e-40, 1.00390625, 1.005859375], special.sum())
    x = rounded(x, source)
    out = numpy(CAST(tensor(x, source), dtype=target))
    assert str(out.dtype) == ("float32" if target == "bfloat16" else target)
    got, want = out.astype(np.float32), ref.cast(x, target).astype(np.float32)
    # bitwise (-0 stays -0), NaN stays NaN: every element is one rounding to nearest-even
    number = ~np.isnan(want)
    np.testing.assert_array_equal(np.isnan(got), ~number)
    np.testing.assert_array_equal(got.view(np.uint32)[number], want.view(np.uint32)[number])


@st.composite
def dequantize_cases(draw):
    # experts picked with repeats and in any order, K x N around the vectors and the threads'
    # share (past 256 KB of work), empty picks and K = 0
    e = draw(st.integers(1, 6))
    g = draw(st.integers(0, 8))
    k = draw(st.one_of(st.integers(0, 5), st.just(1024)))
    n = draw(WIDTHS)
    return e, g, k, n, draw(SEEDS)


@given(case=dequantize_cases())
@examples(20)
def test_dequantize(case, implementation):
    e, g, k, n, seed = case
    rng = data(seed)
    weight = rng.integers(-128, 128, (e, k, n)).astype(np.int8)
    scale = (rng.uniform(0.5, 2, (e, n)) * 2.0 ** rng.integers(-20, 20, (e, n))).astype(np.float32)
    index = rng.integers(0, e, g).astype(np.int32)
    out = numpy(DEQUANTIZE(Tensor(weight), Tensor(scale), Tensor(index)))
    # bitwise: one float32 product per element
    np.testing.assert_array_equal(out, ref.dequantize(weight, scale, index))


@st.composite
def weight_quant_gmm_cases(draw):
    # rows per expert around the blocks of 4 and the K cut of groups of up to 16 rows, K around
    # the cut's chunks of 128 and the unrolled 8 weight rows, empty experts and padded rows
    e = draw(st.integers(1, 5))
    counts = draw(st.lists(st.one_of(st.integers(0, 5), near(4, 16)), min_size=e, max_size=e))
    k = draw(st.one_of(st.integers(0, 17), near(128, 256)))
    return counts, k, draw(WIDTHS), draw(st.integers(0, 3)), draw(SEEDS)


@given(case=weight_quant_gmm_cases())
@examples(20)
def test_weight_quant_grouped_matmul(case, implementation):
    counts, k, n, padding, seed = case
    rng = data(seed)
    counts = np.array(counts, np.int64)
    e, m = len(counts), int(counts.sum()) + padding
    x = rng.normal(0, 2, (m, k)).astype(np.float32)
    weight = rng.integers(-128, 128, (e, k, n)).astype(np.int8)
    scale = (rng.uniform(0.5, 2, (e, n)) * 2.0 ** rng.integers(-20, 20, (e, n))).astype(np.float32)
    out = numpy(WEIGHT_QUANT_GROUPED_MATMUL(Tensor(x), Tensor(weight), Tensor(scale),
                                            Tensor(counts)))
    # float32 sums of k products: within a few roundings of the sum of their magnitudes
    bound = ref.weight_quant_grouped_matmul(np.abs(x), np.abs(weight.astype(np.int16)),
                                            np.abs(scale), counts)
    error = np.abs(out - ref.weight_quant_grouped_matmul(x, weight, scale, counts))
    assert (error <= 4e-7 * (k + 2) * bound + 1e-30).all(), error.max()
    assert not out[m - padding:].any()  # the padded rows


@st.composite
def rms_norm_cases(draw):
    # widths around the vectors, rows past the threads' share, magnitudes over 2^+-40 (the
    # composition squares in float32)
    rows = draw(st.one_of(st.integers(0, 5), st.just(300)))
    h = draw(st.one_of(WIDTHS, st.just(1024)))
    return rows, h, draw(st.sampled_from([0.0, 1e-6, 0.1])), draw(SEEDS)


@given(case=rms_norm_cases())
@examples(20)
def test_rms_norm(case, implementation):
    rows, h, eps, seed = case
    rng = data(seed)
    x = (rng.normal(size=(rows, h)) * 2.0 ** rng.integers(-40, 40, (rows, 1))).astype(np.float32)
    w = rng.normal(size=h).astype(np.float32)
    out = RMS_NORM(Tensor(x), Tensor(w), eps=eps)
    # a few float32 roundings of each output: the scale (sum, root, quotient) and two products
    agree(out, ref.rms_norm(x, w, eps), "float32", terms=4)


@given(case=rms_norm_cases())
@examples(20)
def test_add_rms_norm(case, implementation):
    rows, h, eps, seed = case
    rng = data(seed)
    x = (rng.normal(size=(rows, h)) * 2.0 ** rng.integers(-40, 40, (rows, 1))).astype(np.float32)
    r = (rng.normal(size=(rows, h)) * 2.0 ** rng.integers(-40, 40, (rows, 1))).astype(np.float32)
    w = rng.normal(size=h).astype(np.float32)
    y, total = ADD_RMS_NORM(Tensor(x), Tensor(r), Tensor(w), eps=eps)
    want_y, want_total = ref.add_rms_norm(x, r, w, eps)
    np.testing.assert_array_equal(numpy(total), want_total)  # one float32 sum
    agree(y, want_y, "float32", terms=4)


@st.composite
def decode_attention_cases(draw):
    # head sizes around the 16 lanes of the dot products, more query heads per key head than
    # one pass serves (64), caches past the threads' share
    b, kv = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    groups = draw(st.one_of(st.integers(1, 5), st.just(65)))
    d = draw(st.sampled_from([2, 6, 16, 18, 32, 34, 64]))
    length = draw(st.one_of(st.integers(1, 9), st.just(700)))
    return b, kv, groups, d, length, draw(SEEDS)


@given(case=decode_attention_cases())
@examples(20)
def test_decode_attention(case, implementation):
    b, kv, groups, d, length, seed = case
    rng = data(seed)
    angles = rng.uniform(0, 100, (b, 1, 1, d // 2))
    angles = np.concatenate([angles, angles], -1)
    slot = np.int32(rng.integers(0, length))
    mask = np.where(rng.random((b, 1, 1, length)) < 0.3, np.finfo(np.float32).min, 0)
    mask[..., slot] = 0
    inputs = [rng.normal(size=(b, kv * groups, 1, d)), rng.normal(size=(b, kv, 1, d)),
              rng.normal(size=(b, kv, 1, d)), np.cos(angles), np.sin(angles),
              rng.normal(size=(b, kv, length, d)), rng.normal(size=(b, kv, length, d)), mask]
    inputs = [a.astype(np.float32) for a in inputs]
    scaling = 1 / np.sqrt(d)
    out, keys, values = DECODE_ATTENTION(*[Tensor(a) for a in inputs], Tensor(slot),
                                         scaling=float(scaling))
    want = ref.decode_attention(*inputs, slot, scaling=float(scaling))
    np.testing.assert_array_equal(numpy(values), want[2])
    # the new key: two products of at most |k| (|cos|, |sin| <= 1) added, which may cancel
    agree(keys, want[1], "float32", size=np.abs(want[1]) + np.abs(inputs[1]).max(), terms=2)
    # each score is off by a few roundings of its d products, which the softmax turns into a
    # relative error of the weights; the sum over the positions adds its own
    size = np.abs(want[2]).max() * np.abs(inputs[0]).max() * np.abs(want[1]).max() * d
    agree(out, want[0], "float32", size=np.full(want[0].shape, size + 1), terms=length)
