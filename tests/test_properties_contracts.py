"""Properties of the contracts around the kernels: the derivatives at every kink as documented
(relu'(0) = 0, the other activations' exact value at 0, SwiGLU's clamp gradient zero exactly at
x0 = c and x1 = +-c), the same on every CPU implementation; the Ascend implementations' own limits
checked on every dimension they name, over shapes drawn around each limit (against the limits as
CANN documents them, written out here); MS_MOE_OPS_ISA="" as the documentation says (unset: the
best path)."""
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import example, given, strategies as st  # noqa: E402
from mindspore import Tensor  # noqa: E402

from ms_moe_ops import reference as ref  # noqa: E402
from ms_moe_ops.ops import _op, _platform  # noqa: E402
from ms_moe_ops.ops.ffn import ACTIVATIONS, FFN_ACTIVATION_GRAD, MOE_FFN  # noqa: E402
from ms_moe_ops.ops.gating import GATING_TOP_K  # noqa: E402
from ms_moe_ops.ops.grouped_matmul import GROUPED_MATMUL  # noqa: E402
from ms_moe_ops.ops.permute import PERMUTE, UNPERMUTE  # noqa: E402
from ms_moe_ops.ops.swiglu import SWIGLU_GROUP, SWIGLU_GROUP_QUANT_GRAD  # noqa: E402
from conftest import DEVICE, examples, isa_paths, kernels_missing, needs_kernels, numpy, rounded, tensor  # noqa: E402

DTYPES = st.sampled_from(["float32", "float16", "bfloat16"])
SEEDS = st.integers(0, 2 ** 32 - 1)
# the CPU implementations every kernel contract holds for (the kernel where it can run here)
CPU_IMPLS = [pytest.param("kernel", marks=needs_kernels()), "composition"]


def _ran(record, op, impl):
    assert (op.name, impl) in record, record


# -- kinks ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("impl", CPU_IMPLS)
@given(activation=st.sampled_from(ACTIVATIONS), dtype=DTYPES, seed=SEEDS,
       rank=st.integers(1, 8))
@examples(6)
def test_activation_derivative_at_zero(impl, activation, dtype, seed, rank, monkeypatch):
    """relu'(0) = 0 (the derivative is [h > 0]; -0 too); the sigmoid-gated activations
    v * s(u(v)) have derivative exactly s(0) = 1/2 there."""
    monkeypatch.setenv(_platform.IMPL_ENV, impl)
    rng = np.random.default_rng(seed)
    shape = tuple(rng.integers(1, 4, rank))
    h = np.where(rng.random(shape) < 0.5, 0.0, -0.0)
    h.reshape(-1)[0] = 0.0
    ga = rounded(rng.normal(size=shape), dtype)
    with _op.record_choices() as ran:
        gh, a = FFN_ACTIVATION_GRAD(tensor(h, dtype), tensor(ga, dtype), activation=activation)
    _ran(ran, FFN_ACTIVATION_GRAD, impl)
    slope = 0.0 if activation == "relu" else 0.5
    np.testing.assert_array_equal(numpy(gh), rounded(ga * slope, dtype))
    np.testing.assert_array_equal(numpy(a), np.zeros(shape))


@pytest.mark.parametrize("impl", CPU_IMPLS)
@given(clamp=st.sampled_from([0.5, 1.5, 3.0]), dtype=DTYPES, seed=SEEDS, weighted=st.booleans())
@examples(6)
def test_swiglu_clamp_kinks(impl, clamp, dtype, seed, weighted, monkeypatch):
    """Exactly at x0 = c and x1 = +-c the gradient is zero (strict inequalities on the original
    x, SPEC §3); just inside it is not; the forward is continuous there."""
    monkeypatch.setenv(_platform.IMPL_ENV, impl)
    rng = np.random.default_rng(seed)
    rows, h = 6, 9
    inside = np.nextafter(np.float32(clamp), np.float32(0))
    x0 = rng.choice([clamp, float(inside), clamp + 1.0, -clamp], (rows, h))
    x1 = rng.choice([clamp, -clamp, float(inside), -float(inside), 2 * clamp], (rows, h))
    x = rounded(np.concatenate([x0, x1], 1), dtype)
    w = rng.uniform(0.5, 1, (rows, 1)).astype(np.float32) if weighted else None
    gy = rounded(rng.uniform(0.5, 1, (rows, h)), dtype)
    yo = rounded(ref.swiglu_group(x, clamp_limit=clamp), dtype) if weighted else None
    with _op.record_choices() as ran:
        y, _ = SWIGLU_GROUP(tensor(x, dtype), None if w is None else Tensor(w), None,
                            clamp_limit=clamp)
        gx, _ = SWIGLU_GROUP_QUANT_GRAD(tensor(gy, dtype), tensor(x, dtype),
                                        None if w is None else Tensor(w),
                                        None if yo is None else tensor(yo, dtype), None,
                                        clamp_limit=clamp)
    _ran(ran, SWIGLU_GROUP_QUANT_GRAD, impl)
    gx = numpy(gx)
    a, b = x[:, :h], x[:, h:]
    blocked = np.concatenate([a >= clamp, (b >= clamp) | (b <= -clamp)], 1)
    assert (gx[blocked] == 0).all(), "a gradient passes at or beyond the clamp"
    expected = ref.swiglu_group_quant_grad(gy, x, w, yo, None, clamp)[0]
    assert ((gx != 0) == (expected != 0)).all()
    exact = ref.swiglu_group(x, w, None, clamp)
    assert np.allclose(numpy(y), exact, rtol=2.0 ** -7, atol=1e-6)


# -- Ascend limits, every dimension ---------------------------------------------------------------

def _around(*limits):
    return st.one_of(st.sampled_from(sorted({q for p in limits for q in (p - 1, p, p + 1)})),
                     st.integers(1, 64))


def _info(dtype, shape):
    return _op.TensorInfo(dtype, tuple(shape))


def _supports(op, name, attrs, args, soc=_platform.A2):
    ok, why = op.impl(name).supports(op.resolve(**attrs), args, soc)
    assert ok or why, f"{op.name} {name}: a refusal must say why"
    return ok


@given(form=st.sampled_from(["plain", "transpose_weight", "transpose_x"]),
       groups=_around(1024), k=_around(65536), n=_around(65536), m=st.integers(1, 8))
@example(form="plain", groups=4, k=8, n=65536, m=2)  # one dimension past its limit at a time
@example(form="transpose_weight", groups=4, k=65536, n=8, m=2)
@example(form="plain", groups=1025, k=8, n=8, m=2)
@examples(40)
def test_grouped_matmul_builtin_limits(form, groups, k, n, m):
    """aclnnGroupedMatmulV4: at most 1024 groups (tensor group list), every tensor's stored last
    dimension < 65536: x's (K) and the weight's (N, or K when transposed)."""
    x = [m, k]
    weight = {"plain": [groups, k, n], "transpose_weight": [groups, n, k], "transpose_x": [m, n]}[form]
    args = dict(x=_info("float16", x), weight=_info("float16", weight),
                group_list=_info("int64", [groups]), bias=None)
    attrs = dict(transpose_x=form == "transpose_x", transpose_weight=form == "transpose_weight")
    fits = groups <= 1024 and x[-1] < 65536 and weight[-1] < 65536
    assert _supports(GROUPED_MATMUL, "builtin", attrs, args) == fits


@given(h=_around(65536), f=_around(65536), dtype=st.sampled_from(["float16", "bfloat16", "float32", "int8"]),
       output_dtype=st.sampled_from(["", "float16", "bfloat16", "float32"]), impl=st.sampled_from(["aclnn", "builtin"]))
@example(h=8, f=65536, dtype="float16", output_dtype="", impl="aclnn")
@example(h=65536, f=8, dtype="int8", output_dtype="float16", impl="builtin")
@examples(40)
def test_ffn_ascend_limits(h, f, dtype, output_dtype, impl):
    """aclnnFFN / aclnnFFNV3: H and F < 65536 (both), float16 or int8 x, int8 written as float16."""
    e = 4
    quant = dtype == "int8"
    args = dict(x=_info(dtype, [8, h]), expert_tokens=_info("int64", [e]),
                weight1=_info(dtype, [e, h, f]), bias1=None, weight2=_info(dtype, [e, f, h]),
                bias2=None, scale=None, offset=None, deq_scale1=None, deq_scale2=None)
    attrs = dict(output_dtype=output_dtype if quant else "")
    fits = h < 65536 and f < 65536 and dtype in ("float16", "int8") and \
        (not quant or output_dtype in ("", "float16"))
    assert _supports(MOE_FFN, impl, attrs, args) == fits


@given(t=st.integers(1, 64), k=_around(512), with_probs=st.booleans())
@examples(20)
def test_permute_builtin_top_k_limit(t, k, with_probs):
    """MindSpore's moe_token_permute / moe_token_unpermute on Ascend: top-k <= 512, whether K
    comes from expert_idx, probs or the top_k attribute."""
    assert _supports(PERMUTE, "builtin", dict(num_experts=8),
                     dict(x=_info("float16", [t, 8]), expert_idx=_info("int32", [t, k]))) == (k <= 512)
    probs = _info("float16", [t, k]) if with_probs else None
    attrs = dict(with_probs=with_probs, top_k=0 if with_probs else k)
    args = dict(permuted=_info("float16", [t * k, 8]), sorted_index=_info("int32", [t * k]),
                probs=probs)
    assert _supports(UNPERMUTE, "builtin", attrs, args) == (k <= 512)


@given(groups=st.sampled_from([1, 2, 4, 8, 16, 32, 64]), per_group=_around(32, 64),
       k_group=st.integers(1, 64), mode=st.integers(0, 1), norm_type=st.integers(0, 1),
       renorm=st.integers(0, 1), soc=st.sampled_from([_platform.A2, _platform.A3, _platform.ASCEND_950]))
@examples(40)
def test_router_aclnn_limits(groups, per_group, k_group, mode, norm_type, renorm, soc):
    """aclnnMoeGatingTopK: (experts per group aligned up to 32) x groups <= 2048 when groups are
    really selected, more experts per group than group_select_mode, sigmoid renormalises itself
    (softmax with renorm is composed), Ascend 950's first releases take sigmoid only."""
    k_group = min(k_group, groups)
    n = groups * per_group
    args = dict(x=_info("float16", [4, n]), bias=None)
    attrs = dict(k=1, k_group=k_group, group_count=groups, group_select_mode=mode,
                 norm_type=norm_type, renorm=renorm)
    selecting = groups not in (1, n) and k_group != groups
    fits = (not selecting or -(-per_group // 32) * 32 * groups <= 2048) and per_group > mode and \
        not (norm_type == 0 and renorm == 1) and (soc != _platform.ASCEND_950 or norm_type == 1)
    assert _supports(GATING_TOP_K, "aclnn", attrs, args, soc) == fits


# -- MS_MOE_OPS_ISA="" ----------------------------------------------------------------------------

@pytest.mark.skipif(DEVICE != "CPU" or bool(kernels_missing()), reason="the CPU kernels' paths")
@given(value=st.sampled_from(["", None]), seed=SEEDS, h=st.integers(1, 40))
@examples(6)
def test_empty_isa_is_unset(value, seed, h, monkeypatch, capfd):
    """MS_MOE_OPS_ISA="" (or unset) runs the best path this CPU has: the same bits as naming it,
    and nothing on stderr."""
    rng = np.random.default_rng(seed)
    x = tensor(rng.normal(size=(5, 2 * h)).astype(np.float32))
    monkeypatch.setenv("MS_MOE_OPS_ISA", isa_paths()[-1])
    best = numpy(SWIGLU_GROUP(x, None, None, clamp_limit=0.0)[0])
    if value is None:
        monkeypatch.delenv("MS_MOE_OPS_ISA")
    else:
        monkeypatch.setenv("MS_MOE_OPS_ISA", value)
    capfd.readouterr()
    np.testing.assert_array_equal(numpy(SWIGLU_GROUP(x, None, None, clamp_limit=0.0)[0]), best)
    assert "MS_MOE_OPS_ISA" not in capfd.readouterr().err

