"""Edge sizes through the operators and Cells: one expert (N = 1) trains, and zero tokens (T = 0)
give empty outputs and exactly zero parameter gradients, in PyNative and GRAPH mode."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn

from ms_moe_ops import GatingTopK, MoELayer, MoeFFN, moe_gating_top_k, reference as ref
from conftest import assert_close, finite_diff, grad, nan_pool, needs_kernels, numpy, rounded, tensor
from cases import config, layer_grads, make_layer, params


# -- one expert -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.slow_in_graph
def test_one_expert_router_backward(mode, dtype, rng):
    # eps = 0.5 makes y = s * x_norm / (x_norm + eps) depend on x visibly
    x = rounded(rng.normal(0, 2, (6, 1)), dtype)
    cot = rng.normal(0, 1, (6, 1))
    kw = dict(eps=0.5, routed_scaling_factor=1.5)
    fn = lambda v, c: (moe_gating_top_k(v, 1, **kw)[0].astype(ms.float32) * c).sum()  # noqa: E731
    got = numpy(grad(fn, tensor(x, dtype), Tensor(cot.astype(np.float32)), mode=mode))
    x_norm = 1 / (1 + np.exp(-x))
    golden = ref.moe_gating_top_k_backward(x_norm, cot, np.zeros((6, 1), np.int32),
                                           routed_scaling_factor=1.5, eps=0.5)

    def objective(v):
        s = 1 / (1 + np.exp(-v))
        return float((1.5 * s / (s + 0.5) * cot).sum())

    numeric = finite_diff(objective, x)
    assert np.abs(golden).max() > 1e-2
    assert_close(golden, numeric, rtol=1e-6)
    assert_close(got, golden, dtype)


@pytest.mark.parametrize("score_func,norm", [("sigmoid", True), ("sigmoid", False),
                                             ("softmax", True)])
@pytest.mark.slow_in_graph
def test_one_expert_router_cell_gradient(score_func, norm, mode, rng):
    router = GatingTopK(4, 1, 1, score_func=score_func, norm_topk_prob=norm,
                        routed_scaling_factor=2.0)
    w = rng.normal(0, 0.5, (1, 4))
    router.weight.set_data(Tensor(w.astype(np.float32)))
    x = rng.normal(0, 1, (5, 4))
    cot = rng.normal(0, 1, (5, 1))

    class Objective(nn.Cell):
        def __init__(self):
            super().__init__()
            self.router = router

        def construct(self, v, c):
            return (self.router(v)[0] * c).sum()

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    gx, (gw,) = ms.grad(Objective(), grad_position=0, weights=[router.weight])(
        Tensor(x.astype(np.float32)), Tensor(cot.astype(np.float32)))

    def objective(v, weight):
        s = 1 / (1 + np.exp(-(v @ weight.T)))
        if score_func == "softmax":
            s = np.ones_like(s)  # the softmax of one logit
        y = s / (s + 1e-20) if norm else s
        return float((2.0 * y * cot).sum())

    assert_close(numpy(gx), finite_diff(lambda v: objective(v, w), x), rtol=1e-5)
    assert_close(numpy(gw), finite_diff(lambda v: objective(x, v), w), rtol=1e-5)
    np.testing.assert_array_equal(router.load(), [5])


@pytest.mark.slow_in_graph
def test_one_expert_layer_trains(mode):
    # the case: MoELayer with one expert; its gradients against finite differences
    layer = make_layer(h=4, f=3, e=1, k=1, shared=1)
    x = rounded(np.random.default_rng(3).normal(0, 1, (5, 4)), "float32")
    cot = np.random.default_rng(4).normal(0, 1, (5, 4))
    gx, gw = layer_grads(layer, x, cot, mode)
    base = params(layer)

    def objective(**change):
        out, _ = ref.moe_layer(**{**base, **config(layer), "x": x, **change})
        return float((out * cot).sum())

    assert_close(gx, finite_diff(lambda v: objective(x=v), x), rtol=1e-4)
    names = {"router.weight": "router_weight", "experts.weight1": "weight1",
             "experts.weight2": "weight2", "shared_experts.weight1": "shared_weight1",
             "shared_experts.weight2": "shared_weight2"}
    for pname, arg in names.items():
        assert_close(gw[pname], finite_diff(lambda v: objective(**{arg: v}), base[arg]), rtol=1e-4)
    assert np.abs(gw["experts.weight1"]).max() > 0


# -- zero tokens ----------------------------------------------------------------------------------

def _empty_cases():
    h = 8
    counts = Tensor(np.zeros(4, np.int64))
    return {
        "GatingTopK": (lambda: GatingTopK(h, 4, 2), lambda x: (x,), [(0, 2), (0, 2)]),
        "MoeFFN": (lambda: MoeFFN(4, h, 16, has_bias=True), lambda x: (x, counts), [(0, h)]),
        "MoeFFN-swiglu": (lambda: MoeFFN(4, h, 16, activation="swiglu", has_bias=True),
                          lambda x: (x, counts, Tensor(np.zeros((0, 1), np.float32))), [(0, h)]),
        "MoELayer": (lambda: MoELayer(h, 16, 4, 2, n_shared_experts=1), lambda x: (x,), [(0, h)]),
        "MoELayer-fastgelu": (lambda: MoELayer(h, 16, 4, 2, activation="fastgelu"),
                              lambda x: (x,), [(0, h)]),
        "MoELayer-BSH": (lambda: MoELayer(h, 16, 4, 2, n_group=2, topk_group=1),
                         lambda x: (x.reshape(2, 0, h),), [(2, 0, h)]),
    }


class _Sum(nn.Cell):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def construct(self, *args):
        out = self.cell(*args)
        out = out[0] if isinstance(out, tuple) else out
        return out.astype(ms.float32).sum()


# bfloat16 takes the most casts and reshapes; float32 the full layer too
@needs_kernels("zero-row weight gradients: MindSpore's CPU ops under the compositions do not give "
               "zeros there, the kernels do", other_devices_too=True)
@pytest.mark.parametrize("name,dtype", [(name, "bfloat16") for name in _empty_cases()]
                         + [("MoELayer", "float32")])
@pytest.mark.slow_in_graph
def test_zero_tokens(name, dtype, mode):
    make, args_of, shapes = _empty_cases()[name]
    cell = make()
    args = args_of(tensor(np.zeros((0, 8), np.float32), dtype))
    nan_pool(mode)
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    out = cell(*args)
    outs = out if isinstance(out, tuple) else (out,)
    assert [tuple(o.shape) for o in outs] == shapes
    if name != "GatingTopK":
        assert outs[0].dtype == args[0].dtype
    weights = cell.trainable_params()
    gx, gw = ms.grad(_Sum(cell), grad_position=0, weights=weights)(*args)
    assert gx.shape == args[0].shape
    for p, g in zip(weights, gw):
        assert g.shape == p.shape and not numpy(g).any(), p.name
    routers = [c for _, c in cell.cells_and_names() if isinstance(c, GatingTopK)]
    for router in routers:
        assert not router.load().any()
