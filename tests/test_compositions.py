"""Every composition of MindSpore ops (what runs where no kernel does, e.g. PyNative on Ascend),
forced with MS_MOE_OPS_IMPL=composition and resolved by the real resolver, against the float64
golden models (forward) and finite differences of them (gradients), in both modes."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import ops

from ms_moe_ops import reference as ref
from ms_moe_ops.ops import _op, _platform, ffn, gating, permute, swiglu
from ms_moe_ops.ops.grouped_matmul import GROUPED_MATMUL
from conftest import assert_close, finite_diff, grad, numpy, rounded, run, tensor


@pytest.fixture(autouse=True)
def composition(monkeypatch):
    monkeypatch.setenv(_platform.IMPL_ENV, "composition")


def _t(a, dtype="float32"):
    """Integers keep their dtype, float32 arrays (x_norm, weights) stay float32, the other float
    arrays take the test's dtype."""
    if a is None:
        return None
    a = np.asarray(a)
    return tensor(a) if a.dtype.kind in "iu" or a.dtype == np.float32 else tensor(a, dtype)


def _apply(op, inputs, attrs, mode="pynative", dtype="float32"):
    """op(*inputs, **attrs) through the resolver; checks the composition was the one chosen."""
    args = [_t(a, dtype) for a in inputs]

    def fn(*xs):
        return op(*xs, **attrs)

    out = run(fn, *args, mode=mode)
    signature = tuple(None if a is None else (a.dtype, tuple(a.shape)) for a in args)
    platform = (_platform.device_target(), _platform.soc_family(), mode, "composition")
    assert _op.choose(op, tuple(op.resolve(**attrs).items()), platform, signature).name == \
        "composition"
    return out if isinstance(out, tuple) else (out,)


def _logits(rng, m, n):
    """Well separated logits: the selection is the same in any precision and under +-1e-6."""
    return (np.array([rng.permutation(n) for _ in range(m)], np.float64) - n / 2) * (4.0 / n) + \
        rng.uniform(-0.01, 0.01, (m, n))


def _routing(rng, t, k, e):
    return np.array([rng.choice(e, k, replace=False) for _ in range(t)], np.int32)


# -- cases: (op, inputs, attrs, golden outputs) ------------------------------------------------

def _router(rng, dtype, **attrs):
    x = rounded(_logits(rng, 5, 8), dtype)
    bias = rounded(rng.uniform(-0.2, 0.2, 8), dtype) if attrs.pop("with_bias", False) else None
    return gating.GATING_TOP_K, [x, bias], attrs, ref.moe_gating_top_k(x, bias=bias, **attrs)


def _router_ties(rng, dtype):
    # every score equal: the lower index wins among experts and among groups
    attrs = dict(k=3, k_group=2, group_count=4)
    x = np.zeros((2, 8))
    return gating.GATING_TOP_K, [x, None], attrs, ref.moe_gating_top_k(x, **attrs)


def _router_backward(rng, dtype, softmax=False, **attrs):
    x_norm = ref._softmax(rng.normal(size=(4, 10))) if softmax else \
        1 / (1 + np.exp(-rng.normal(size=(4, 10))))
    grad_y = rounded(rng.normal(size=(4, 3)), dtype)
    idx = np.array([rng.permutation(10)[:3] for _ in range(4)], np.int32)
    idx[0, 2] = idx[0, 0]  # a duplicate: its two gradients are summed
    x_norm = x_norm.astype(np.float32)
    if softmax:
        return gating.GATING_SOFTMAX_BACKWARD, [x_norm, grad_y, idx], attrs, \
            (ref.moe_gating_top_k_softmax_backward(x_norm, grad_y, idx, **attrs),)
    return gating.GATING_BACKWARD, [x_norm, grad_y, idx], attrs, \
        (ref.moe_gating_top_k_backward(x_norm, grad_y, idx, **attrs),)



def _router_grad(rng, dtype, softmax=False, with_grad_x_norm=True, **attrs):
    _, (x_norm, grad_y, idx), _, _ = _router_backward(rng, dtype, softmax)
    dxn = rng.normal(size=x_norm.shape).astype(np.float32) if with_grad_x_norm else None
    attrs = dict(attrs, norm_type=0 if softmax else 1)
    return gating.GATING_GRAD, [x_norm, grad_y, idx, dxn], attrs, \
        (ref.moe_gating_top_k_grad(x_norm, grad_y, idx, dxn, **attrs),)

def _swiglu(rng, dtype, shape=(6, 10), counts=(3, 2), clamp=1.5, weighted=True):
    x = rounded(rng.uniform(-3, 3, shape), dtype)
    w = rng.uniform(0.1, 1, shape[:-1] + (1,)).astype(np.float32) if weighted else None
    gi = np.array(counts, np.int64) if counts is not None else None
    golden = (ref.swiglu_group(x, w, gi, clamp), ref.swiglu_group(x, None, gi, clamp))
    return swiglu.SWIGLU_GROUP, [x, w, gi], dict(clamp_limit=clamp), golden


def _swiglu_backward(rng, dtype, weighted=True, clamp=1.5):
    x = rounded(rng.uniform(-3, 3, (2, 3, 8)), dtype)
    gy = rounded(rng.normal(size=(2, 3, 4)), dtype)
    gi = np.array([4], np.int64)
    w = rng.uniform(0.1, 1, (2, 3, 1)).astype(np.float32) if weighted else None
    yo = rounded(ref.swiglu_group(x, None, gi, clamp), dtype) if weighted else None
    gx, gw = ref.swiglu_group_quant_grad(gy, x, w, yo, gi, clamp)
    golden = (gx, np.zeros((2, 3, 1)) if gw is None else gw)
    return swiglu.SWIGLU_GROUP_QUANT_GRAD, [gy, x, w, yo, gi], dict(clamp_limit=clamp), golden


def _activation_grad(rng, dtype, activation):
    h = rounded(rng.uniform(-3, 3, (4, 6)), dtype)
    g = rounded(rng.normal(size=(4, 6)), dtype)
    act = lambda v: ref.ffn_activation(activation, v)  # noqa: E731
    slope = (act(h + 1e-6) - act(h - 1e-6)) / 2e-6
    golden = (g * slope, ref.ffn_activation(activation, h))
    return ffn.FFN_ACTIVATION_GRAD, [h, g], dict(activation=activation), golden


def _ffn_case(rng, dtype, counts=(3, 0, 4), padding=0):
    e, m, h, f = len(counts), sum(counts) + padding, 4, 5
    r = lambda *shape: rounded(rng.normal(size=shape) * 0.7, dtype)  # noqa: E731
    return [r(m, h), np.array(counts, np.int64), r(e, h, f), r(e, f), r(e, f, h), r(e, h),
            None, None, None, None]


def _moe_ffn(rng, dtype, activation="fastgelu", cumulative=False, padding=0):
    v = _ffn_case(rng, dtype, padding=padding)
    golden = ref.moe_ffn(v[0], v[1], v[2], v[4], v[3], v[5], activation=activation,
                         padded=padding > 0)
    if cumulative:
        v[1] = np.cumsum(v[1])
    attrs = dict(activation=activation, tokens_index_flag=cumulative)
    if padding:
        attrs["padded"] = True
    return ffn.MOE_FFN, v, attrs, (golden,)


def _gmm(rng, dtype, form="plain", cumulative=False, padding=0):
    counts = np.array([3, 0, 4], np.int64)
    x = rounded(rng.normal(size=(7 + padding, 5)), dtype)
    w = rounded(rng.normal(size=(3, 5, 4)), dtype)
    b = rounded(rng.normal(size=(3, 4)), dtype)
    dy = rounded(rng.normal(size=(7 + padding, 4)), dtype)
    gl = np.cumsum(counts) if cumulative else counts
    if form == "transpose_weight":
        wt = w.transpose(0, 2, 1).copy()
        inputs, golden = [x, wt, gl, None], ref.grouped_matmul(x, w, counts)
    elif form == "transpose_x":
        inputs, golden = [x, dy, gl, None], ref.grouped_matmul(x, dy, counts, transpose_x=True)
    else:
        inputs, golden = [x, w, gl, b], ref.grouped_matmul(x, w, counts, b)
    attrs = dict(transpose_x=form == "transpose_x", transpose_weight=form == "transpose_weight",
                 cumulative=cumulative)
    return GROUPED_MATMUL, inputs, attrs, (golden,)


def _permute(rng, dtype):
    x = rounded(rng.normal(size=(6, 3)), dtype)
    idx = _routing(rng, 6, 2, 5)
    idx[:, 0] = np.where(idx[:, 0] == 4, 0, idx[:, 0])  # some expert gets no token
    idx[:, 1] = np.where(idx[:, 1] == 4, np.where(idx[:, 0] == 1, 2, 1), idx[:, 1])
    return permute.PERMUTE, [x, idx], dict(num_experts=5), ref.moe_token_permute(x, idx, 5)


def _unpermute(rng, dtype, with_probs=True):
    x = rounded(rng.normal(size=(5, 3)), dtype)
    idx = _routing(rng, 5, 3, 4)
    rows, sorted_index, _ = ref.moe_token_permute(x, idx, 4)
    probs = rounded(rng.uniform(0.1, 1, (5, 3)), dtype) if with_probs else None
    attrs = dict(top_k=0 if with_probs else 3, with_probs=with_probs)
    golden = ref.moe_token_unpermute(rows, sorted_index, probs, top_k=attrs["top_k"])
    return permute.UNPERMUTE, [rows, sorted_index, probs], attrs, (golden,)


def _unpermute_backward(rng, dtype, with_probs=True):
    x = rng.normal(size=(5, 3))
    idx = _routing(rng, 5, 2, 4)
    rows, sorted_index, _ = ref.moe_token_permute(x, idx, 4)
    probs = rng.uniform(0.1, 1, (5, 2)) if with_probs else None
    g = rng.normal(size=(5, 3))
    top_k = 0 if with_probs else 2
    dp, dq = ref.moe_token_unpermute_backward(rows, sorted_index, probs, g, top_k=top_k)
    golden = (dp, np.zeros((5, 2)) if dq is None else dq)
    return (permute.UNPERMUTE_BACKWARD, [rows, sorted_index, probs, g],
            dict(top_k=top_k, with_probs=with_probs), golden)


CASES = {
    "router_sigmoid": lambda r, d: _router(r, d, k=2, with_bias=True),
    "router_groups_max": lambda r, d: _router(r, d, k=4, k_group=2, group_count=4, with_bias=True),
    "router_groups_top2": lambda r, d: _router(r, d, k=3, k_group=2, group_count=4,
                                               group_select_mode=1, routed_scaling_factor=2.5),
    "router_softmax": lambda r, d: _router(r, d, k=3, norm_type=0),
    "router_softmax_renorm": lambda r, d: _router(r, d, k=3, norm_type=0, renorm=1, eps=1e-6),
    "router_ties": _router_ties,
    "router_backward": lambda r, d: _router_backward(r, d, routed_scaling_factor=2.5),
    "router_softmax_backward": lambda r, d: _router_backward(r, d, True, renorm=1, eps=1e-6),
    "router_grad": lambda r, d: _router_grad(r, d, routed_scaling_factor=2.5),
    "router_grad_no_x_norm": lambda r, d: _router_grad(r, d, False, False, eps=1e-6),
    "router_grad_softmax": lambda r, d: _router_grad(r, d, True, renorm=1, eps=1e-6),
    "router_grad_softmax_no_x_norm": lambda r, d: _router_grad(r, d, True, False),
    "swiglu": _swiglu,
    "swiglu_3d_unclamped": lambda r, d: _swiglu(r, d, (2, 3, 8), None, 0.0, False),
    "swiglu_backward": _swiglu_backward,
    "swiglu_backward_unweighted": lambda r, d: _swiglu_backward(r, d, False, 0.0),
    "activation_grad_fastgelu": lambda r, d: _activation_grad(r, d, "fastgelu"),
    "activation_grad_gelu": lambda r, d: _activation_grad(r, d, "gelu"),
    "activation_grad_relu": lambda r, d: _activation_grad(r, d, "relu"),
    "activation_grad_silu": lambda r, d: _activation_grad(r, d, "silu"),
    "moe_ffn": _moe_ffn,
    "moe_ffn_gelu_cumulative": lambda r, d: _moe_ffn(r, d, "gelu", True),
    "grouped_matmul": _gmm,
    "grouped_matmul_transpose_weight": lambda r, d: _gmm(r, d, "transpose_weight", True),
    "grouped_matmul_transpose_x": lambda r, d: _gmm(r, d, "transpose_x"),
    "grouped_matmul_padded": lambda r, d: _gmm(r, d, padding=3),
    "grouped_matmul_transpose_x_padded": lambda r, d: _gmm(r, d, "transpose_x", True, 2),
    "moe_ffn_padded": lambda r, d: _moe_ffn(r, d, "silu", padding=2),
    "permute": _permute,
    "unpermute": _unpermute,
    "unpermute_unweighted": lambda r, d: _unpermute(r, d, False),
    "unpermute_backward": _unpermute_backward,
    "unpermute_backward_unweighted": lambda r, d: _unpermute_backward(r, d, False),
}


def _compare(outs, golden, dtype):
    assert len(outs) == len(golden)
    for out, want in zip(outs, golden):
        if np.asarray(want).dtype.kind in "iu":
            np.testing.assert_array_equal(numpy(out), want)
        else:
            assert_close(numpy(out), want, dtype)


# one case per operator compiled in GRAPH mode too (each compilation costs seconds)
GRAPH_CASES = ["router_groups_top2", "router_backward", "router_softmax_backward", "router_grad",
               "swiglu", "swiglu_backward", "activation_grad_gelu", "moe_ffn_gelu_cumulative",
               "grouped_matmul", "permute", "unpermute", "unpermute_backward"]


@pytest.mark.parametrize("case,mode", [(c, "pynative") for c in sorted(CASES)] +
                         [(c, "graph") for c in GRAPH_CASES])
def test_composition_matches_golden(case, mode, rng):
    op, inputs, attrs, golden = CASES[case](rng, "float32")
    _compare(_apply(op, inputs, attrs, mode), golden, "float32")


def test_every_operator_has_a_graph_mode_case():
    ops_in_graph = {CASES[c](np.random.default_rng(0), "float32")[0] for c in GRAPH_CASES}
    assert ops_in_graph == {CASES[c](np.random.default_rng(0), "float32")[0] for c in CASES}


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("case", ["router_groups_top2", "router_grad_softmax", "swiglu",
                                  "swiglu_backward",
                                  "grouped_matmul", "permute", "unpermute"])
def test_composition_half_precision(case, dtype, rng):
    op, inputs, attrs, golden = CASES[case](rng, dtype)
    outs = _apply(op, inputs, attrs, dtype=dtype)
    assert str(outs[0].dtype).lower() == dtype
    _compare(outs, golden, dtype)


def test_router_ties_do_not_depend_on_the_devices_top_k(monkeypatch, rng):
    # a TopK that orders equal values highest index first must not change the choice
    real = ops.topk

    def reversed_ties(values, k):
        flipped = ops.flip(values, (-1,))
        top, idx = real(flipped, k)
        return top, values.shape[-1] - 1 - idx

    monkeypatch.setattr(ops, "topk", reversed_ties)
    op, inputs, attrs, golden = _router_ties(rng, "float32")
    _compare(_apply(op, inputs, attrs), golden, "float32")
    assert numpy(_apply(op, inputs, attrs)[1]).tolist() == [[0, 1, 2]] * 2


# -- gradients: finite differences of the golden model ------------------------------------------

def _check_gradient(op, inputs, attrs, wrt, used, golden_fn, mode, rng):
    """d/d inputs[wrt] of sum over the outputs `used` of <out_i, c_i>, against central
    differences of golden_fn."""
    weights = [rng.normal(size=np.shape(g)) for g in golden_fn(*inputs)]

    def loss(*xs):
        outs = op(*xs, **attrs)
        outs = outs if isinstance(outs, tuple) else (outs,)
        return sum((outs[i].astype(ms.float32) * tensor(weights[i], "float32")).sum() for i in used)

    args = [_t(a) for a in inputs]
    grads = grad(loss, *args, mode=mode, argnums=tuple(wrt))
    grads = grads if isinstance(grads, tuple) else (grads,)
    for position, got in zip(wrt, grads):
        def f(v, position=position):
            xs = list(inputs)
            xs[position] = v
            return sum((np.asarray(golden_fn(*xs)[i]) * weights[i]).sum() for i in used)
        assert_close(numpy(got), finite_diff(f, inputs[position]), rtol=1e-4)


# name: (case, inputs differentiated, outputs in the loss). The router's x_norm is an output
# whose gradient flows; swiglu_group's y_origin is internal (no gradient by design).
GRADIENT_CASES = {
    "router_sigmoid": ("router_groups_top2", (0,), (0, 2)),
    "router_softmax_renorm": ("router_softmax_renorm", (0,), (0, 2)),
    "swiglu": ("swiglu", (0, 1), (0,)),
    "swiglu_unweighted": ("swiglu_3d_unclamped", (0,), (0,)),
    "moe_ffn": ("moe_ffn", (0, 2, 3, 4, 5), (0,)),
    "grouped_matmul": ("grouped_matmul", (0, 1, 3), (0,)),
    "grouped_matmul_transpose_weight": ("grouped_matmul_transpose_weight", (0, 1), (0,)),
    "grouped_matmul_transpose_x": ("grouped_matmul_transpose_x", (0, 1), (0,)),
    "grouped_matmul_padded": ("grouped_matmul_padded", (0, 1, 3), (0,)),
    "permute": ("permute", (0,), (0,)),
    "unpermute": ("unpermute", (0, 2), (0,)),
}

_GOLDEN = {
    "router_groups_top2": lambda a: lambda x, b: ref.moe_gating_top_k(x, bias=b, **a),
    "router_softmax_renorm": lambda a: lambda x, b: ref.moe_gating_top_k(x, bias=b, **a),
    "swiglu": lambda a: lambda x, w, gi: (ref.swiglu_group(x, w, gi, a["clamp_limit"]),
                                          ref.swiglu_group(x, None, gi, a["clamp_limit"])),
    "swiglu_3d_unclamped": lambda a: lambda x, w, gi: (ref.swiglu_group(x, w, gi),
                                                       ref.swiglu_group(x, None, gi)),
    "moe_ffn": lambda a: lambda x, t, w1, b1, w2, b2, *q: (ref.moe_ffn(
        x, t, w1, w2, b1, b2, activation=a["activation"]),),
    "grouped_matmul": lambda a: lambda x, w, gl, b: (ref.grouped_matmul(x, w, gl, b),),
    "grouped_matmul_padded": lambda a: lambda x, w, gl, b: (ref.grouped_matmul(x, w, gl, b),),
    "grouped_matmul_transpose_weight": lambda a: lambda x, w, gl, b: (ref.grouped_matmul(
        x, w, np.diff(gl, prepend=0), transpose_weight=True),),
    "grouped_matmul_transpose_x": lambda a: lambda x, w, gl, b: (ref.grouped_matmul(
        x, w, gl, transpose_x=True),),
    "permute": lambda a: lambda x, i: ref.moe_token_permute(x, i, a["num_experts"]),
    "unpermute": lambda a: lambda p, s, q: (ref.moe_token_unpermute(p, s, q, a["top_k"]),),
}


@pytest.mark.slow_in_graph
@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_composition_gradient(name, mode, rng):
    case, wrt, used = GRADIENT_CASES[name]
    op, inputs, attrs, _ = CASES[case](rng, "float32")
    inputs = [np.asarray(a, np.float64) if a is not None and np.asarray(a).dtype.kind == "f" else a
              for a in inputs]
    _check_gradient(op, inputs, attrs, wrt, used, _GOLDEN[case](op.resolve(**attrs)), mode, rng)
