"""Every composition of MindSpore ops (what runs where no kernel does, e.g. PyNative on Ascend),
forced with MS_MOE_OPS_IMPL=composition and resolved by the real resolver, against the float64
golden models (forward) and finite differences of them (gradients), in both modes."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import ops

from ms_moe_ops import reference as ref
from ms_moe_ops.ops import _op, _platform
from cases import CASES, compare as _compare, op_input as _t
from conftest import assert_close, finite_diff, grad, numpy, run, tensor


@pytest.fixture(autouse=True)
def composition(monkeypatch):
    monkeypatch.setenv(_platform.IMPL_ENV, "composition")


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


# one case per operator compiled in GRAPH mode too (each compilation costs seconds)
GRAPH_CASES = ["router_groups_top2", "router_backward", "router_softmax_backward", "router_grad",
               "swiglu", "swiglu_backward", "activation_grad_gelu", "moe_ffn_gelu_cumulative",
               "grouped_matmul", "permute", "unpermute", "unpermute_backward", "cast",
               "dequantize", "rms_norm", "add_rms_norm", "decode_attention",
               "weight_quant_grouped_matmul_padded"]


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
    op, inputs, attrs, golden = CASES["router_ties"](rng, "float32")
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
    "dequantize": ("dequantize", (1,), (0,)),
    "weight_quant_grouped_matmul": ("weight_quant_grouped_matmul", (0, 2), (0,)),
    "weight_quant_grouped_matmul_padded": ("weight_quant_grouped_matmul_padded", (0, 2), (0,)),
    "rms_norm": ("rms_norm", (0, 1), (0,)),
    "add_rms_norm": ("add_rms_norm", (0, 1, 2), (0, 1)),
    "decode_attention": ("decode_attention", (0, 1, 2, 3, 4, 5, 6), (0, 1, 2)),
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
    "dequantize": lambda a: lambda w, s, i: (np.asarray(w, np.float64)[i] * s[i][:, None, :],),
    "weight_quant_grouped_matmul": lambda a: lambda x, w, s, c: (
        ref.weight_quant_grouped_matmul(x, w, s, c),),
    "weight_quant_grouped_matmul_padded": lambda a: lambda x, w, s, c: (
        ref.weight_quant_grouped_matmul(x, w, s, c),),
    "rms_norm": lambda a: lambda x, w: (ref.rms_norm(x, w, a["eps"]),),
    "add_rms_norm": lambda a: lambda x, r, w: (ref.rms_norm(x + r, w, a["eps"]), x + r),
    "decode_attention": lambda a: lambda *inputs: ref.decode_attention(*inputs, a["scaling"]),
}


@pytest.mark.slow_in_graph
@pytest.mark.parametrize("name", sorted(GRADIENT_CASES))
def test_composition_gradient(name, mode, rng):
    case, wrt, used = GRADIENT_CASES[name]
    op, inputs, attrs, _ = CASES[case](rng, "float32")
    inputs = [np.asarray(a, np.float64) if a is not None and np.asarray(a).dtype.kind == "f" else a
              for a in inputs]
    _check_gradient(op, inputs, attrs, wrt, used, _GOLDEN[case](op.resolve(**attrs)), mode, rng)
