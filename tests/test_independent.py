"""Every operator against a formulation that shares no code with ms_moe_ops.reference: the same
maths written with plain MindSpore operators in float64, values and autograd gradients (and, when
torch is installed, torch's autograd too). Hand-computed cases and seed examples live beside
each operator's other tests; tests/README.md lists which evidence covers which operator."""
import mindspore as ms
import numpy as np
import pytest
from mindspore import Tensor, ops

import ms_moe_ops as mo
from conftest import assert_close, numpy

F64 = ms.float64


def value_and_grads(fn, *arrays):
    """(fn(*arrays), gradients of sum(fn * cotangent) for every array) with MindSpore autograd;
    fn gets float64 Tensors, the cotangent is fixed per call."""
    args = [Tensor(np.asarray(a, np.float64)) for a in arrays]
    out = fn(*args)
    cot = Tensor(np.random.default_rng(99).normal(size=out.shape))
    grads = ms.grad(lambda *a: (fn(*a) * cot).sum(), grad_position=tuple(range(len(args))))(*args)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return out.asnumpy(), [g.asnumpy() for g in grads], cot.asnumpy()


def kernel_grads(fn, cot, *arrays):
    """The package's gradients of sum(fn * cot), float32 inputs."""
    args = [Tensor(np.asarray(a, np.float32)) for a in arrays]
    c = Tensor(cot.astype(np.float32))
    grads = ms.grad(lambda *a: (fn(*a) * c).sum(), grad_position=tuple(range(len(args))))(*args)
    grads = grads if isinstance(grads, tuple) else (grads,)
    return [numpy(g) for g in grads]


def f32(a):
    return np.asarray(a, np.float32).astype(np.float64)


# -- router ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("softmax", [False, True])
def test_router(softmax, rng):
    perm = np.array([rng.permutation(16) for _ in range(5)])
    x = f32((perm - 8) / 4.0 + rng.uniform(-0.02, 0.02, (5, 16)))
    bias = f32(rng.uniform(-0.05, 0.05, 16))
    k, groups, keep = 3, 4, 2
    y, idx, _ = mo.moe_gating_top_k(Tensor(x.astype(np.float32)), k, Tensor(bias.astype(np.float32)),
                                    k_group=keep, group_count=groups, group_select_mode=1,
                                    norm_type=0 if softmax else 1, renorm=1,
                                    routed_scaling_factor=2.0)

    # selection from MindSpore's own top-k: group score = sum of its two best biased scores
    s = ops.softmax(Tensor(x), -1) if softmax else ops.sigmoid(Tensor(x))
    choice = s + Tensor(bias)
    top2 = ops.topk(choice.reshape(5, groups, 4), 2)[0].sum(-1)
    kept = ops.topk(top2, keep)[1]
    mask = ops.zeros((5, groups), F64)
    mask = ops.tensor_scatter_elements(mask, kept, ops.ones(kept.shape, F64), axis=1)
    masked = ops.where(ops.repeat_interleave(mask, 4, 1) > 0, choice, Tensor(-np.inf, F64))
    expected_idx = ops.topk(masked, k)[1].asnumpy()
    np.testing.assert_array_equal(numpy(idx), expected_idx)

    def composed(x):
        scores = ops.softmax(x, -1) if softmax else ops.sigmoid(x)
        w = ops.gather_elements(scores, 1, Tensor(expected_idx.astype(np.int64)))
        return w / w.sum(-1, keepdims=True) * 2.0

    want, (gx,), cot = value_and_grads(composed, x)
    assert_close(numpy(y), want)
    fn = lambda v: mo.moe_gating_top_k(v, k, Tensor(bias.astype(np.float32)), k_group=keep,  # noqa: E731
                                       group_count=groups, group_select_mode=1,
                                       norm_type=0 if softmax else 1, renorm=1,
                                       routed_scaling_factor=2.0)[0]
    assert_close(kernel_grads(fn, cot, x)[0], gx, rtol=1e-4)


def test_router_backward_is_the_composition_gradient(rng):
    # moe_gating_top_k_backward on its own: the gradient of w / sum(w) * s w.r.t. x, w = sigmoid(x)[idx]
    x = f32(rng.normal(size=(4, 10)))
    idx = np.array([rng.permutation(10)[:3] for _ in range(4)])
    idx[0, 1] = idx[0, 0]  # a duplicate: both slots' gradients add up

    def composed(x):
        w = ops.gather_elements(ops.sigmoid(x), 1, Tensor(idx.astype(np.int64)))
        return w / w.sum(-1, keepdims=True) * 1.5

    _, (gx,), cot = value_and_grads(composed, x)
    xn = Tensor((1 / (1 + np.exp(-x))).astype(np.float32))
    got = mo.moe_gating_top_k_backward(xn, Tensor(cot.astype(np.float32)),
                                       Tensor(idx.astype(np.int32)), routed_scaling_factor=1.5)
    assert_close(numpy(got), gx, rtol=1e-4)


# -- SwiGLU ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("clamp", [0.0, 1.2])
def test_swiglu(clamp, rng):
    x = f32(rng.uniform(-2.5, 2.5, (7, 12)))
    x[np.abs(np.abs(x) - clamp) < 0.05] += 0.2  # away from the clamp's kinks
    w = f32(rng.uniform(0.1, 1, (7, 1)))

    def composed(x, w):
        a, b = x[:, :6], x[:, 6:]
        if clamp > 0:
            a, b = ops.minimum(a, clamp), ops.clamp(b, -clamp, clamp)
        return a * ops.sigmoid(a) * b * w

    want, (gx, gw), cot = value_and_grads(composed, x, w)
    fn = lambda x_, w_: mo.swiglu_group(x_, w_, clamp_limit=clamp)  # noqa: E731
    assert_close(numpy(fn(Tensor(x.astype(np.float32)), Tensor(w.astype(np.float32)))), want)
    got_x, got_w = kernel_grads(fn, cot, x, w)
    assert_close(got_x, gx, rtol=1e-4)
    assert_close(got_w, gw, rtol=1e-4)


# -- experts --------------------------------------------------------------------------------------

COUNTS = (3, 0, 4)
ACT = {"fastgelu": lambda h: h * ops.sigmoid(1.702 * h), "relu": ops.relu,
       "silu": lambda h: h * ops.sigmoid(h),
       "gelu": lambda h: h * ops.sigmoid(1.59576912 * (h + 0.044715 * h ** 3))}


def _per_group(x, fn):
    ends = [int(e) for e in np.cumsum(COUNTS)]
    return ops.cat([fn(x[e - n:e], g) for g, (n, e) in enumerate(zip(COUNTS, ends)) if n], 0)


@pytest.mark.parametrize("activation", list(ACT))
def test_moe_ffn(activation, rng):
    x, w1, b1 = f32(rng.normal(size=(7, 5))), f32(rng.normal(size=(3, 5, 6))), f32(rng.normal(size=(3, 6)))
    w2, b2 = f32(rng.normal(size=(3, 6, 5))), f32(rng.normal(size=(3, 5)))
    if activation == "relu":
        b1 = b1 + np.sign(b1) * 0.5  # pre-activations away from the kink
    act = ACT[activation]

    def composed(x, w1, b1, w2, b2):
        return _per_group(x, lambda rows, g: ops.matmul(act(ops.matmul(rows, w1[g]) + b1[g]), w2[g]) + b2[g])

    want, grads, cot = value_and_grads(composed, x, w1, b1, w2, b2)
    tokens = Tensor(np.array(COUNTS, np.int64))
    fn = lambda x, w1, b1, w2, b2: mo.moe_ffn(x, tokens, w1, w2, b1, b2, activation=activation)  # noqa: E731
    got = kernel_grads(fn, cot, x, w1, b1, w2, b2)
    y = fn(*(Tensor(a.astype(np.float32)) for a in (x, w1, b1, w2, b2)))
    assert_close(numpy(y), want)
    for g, want_g in zip(got, grads):
        assert_close(g, want_g, rtol=1e-4)


@pytest.mark.parametrize("form", ["plain", "transpose_weight", "transpose_x"])
def test_grouped_matmul(form, rng):
    x = f32(rng.normal(size=(7, 4)))
    second = f32(rng.normal(size=(7, 3) if form == "transpose_x" else (3, 3, 4) if
                                form == "transpose_weight" else (3, 4, 3)))
    groups = Tensor(np.array(COUNTS, np.int64))
    ends = [int(e) for e in np.cumsum(COUNTS)]

    def composed(x, second):
        if form == "transpose_x":
            return ops.stack([ops.matmul(x[e - n:e].T, second[e - n:e]) if n else
                              ops.zeros((4, 3), F64) for n, e in zip(COUNTS, ends)])
        w = second.transpose(0, 2, 1) if form == "transpose_weight" else second
        return _per_group(x, lambda rows, g: ops.matmul(rows, w[g]))

    want, grads, cot = value_and_grads(composed, x, second)
    fn = lambda a, b: mo.grouped_matmul(a, b, groups, transpose_x=form == "transpose_x",  # noqa: E731
                                        transpose_weight=form == "transpose_weight")
    assert_close(numpy(fn(Tensor(x.astype(np.float32)), Tensor(second.astype(np.float32)))), want)
    for g, want_g in zip(kernel_grads(fn, cot, x, second), grads):
        assert_close(g, want_g, rtol=1e-4)


# -- token permutation ------------------------------------------------------------------------------

def test_permute_and_weighted_unpermute(rng):
    x = f32(rng.normal(size=(6, 5)))
    idx = np.array([rng.permutation(4)[:2] for _ in range(6)], np.int32)
    probs = f32(rng.uniform(0.1, 1, (6, 2)))
    # the permutation: a stable argsort of the expert ids
    order = np.argsort(idx.reshape(-1), kind="stable")  # source slot of each permuted row
    permuted, sorted_index, counts = mo.moe_token_permute(Tensor(x.astype(np.float32)), Tensor(idx), 4)
    np.testing.assert_array_equal(numpy(permuted), x[order // 2].astype(np.float32))
    np.testing.assert_array_equal(numpy(counts), np.bincount(idx.reshape(-1), minlength=4))

    def composed(x, probs):  # unpermute(permute(x)) weighted: sum_k probs[t, k] * x[t]
        rows = ops.gather(x, Tensor(order // 2), 0)
        back = ops.gather(rows, sorted_index.astype(ms.int64), 0).reshape(6, 2, 5)
        return (back * probs.reshape(6, 2, 1)).sum(1)

    want, grads, cot = value_and_grads(composed, x, probs)

    def fn(x, probs):
        p, s, _ = mo.moe_token_permute(x, Tensor(idx), 4)
        return mo.moe_token_unpermute(p, s, probs)

    assert_close(numpy(fn(Tensor(x.astype(np.float32)), Tensor(probs.astype(np.float32)))), want)
    for g, want_g in zip(kernel_grads(fn, cot, x, probs), grads):
        assert_close(g, want_g)


# -- torch, where installed -------------------------------------------------------------------------

def test_moe_layer_against_torch(rng):
    torch = pytest.importorskip("torch")
    layer = mo.MoELayer(6, 4, 4, 2, n_shared_experts=1)
    for p in layer.trainable_params():
        p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    x = rng.normal(size=(5, 6))
    cot = rng.normal(size=(5, 6))
    params = layer.trainable_params()
    w = {p.name: torch.tensor(p.asnumpy().astype(np.float64), requires_grad=True) for p in params}
    leaves = list(w.values())
    xt = torch.tensor(x, requires_grad=True)

    def swiglu_mlp(v, w1, w2):  # weight1 = [gate | up] columns
        f = w1.shape[-1] // 2
        h = v @ w1
        return torch.nn.functional.silu(h[..., :f]) * h[..., f:] @ w2

    scores = torch.sigmoid(xt @ w["router.weight"].T)
    top = torch.topk(scores.detach(), 2).indices  # distinct scores: no ties
    gate = torch.gather(scores, 1, top)
    gate = gate / gate.sum(-1, keepdim=True)
    out = swiglu_mlp(xt, w["shared_experts.weight1"], w["shared_experts.weight2"])
    routed = torch.stack([sum(gate[t, j] * swiglu_mlp(xt[t], w["experts.weight1"][top[t, j]],
                                                      w["experts.weight2"][top[t, j]])
                              for j in range(2)) for t in range(5)])
    out = out + routed
    (out * torch.tensor(cot)).sum().backward()

    class Objective(ms.nn.Cell):
        def __init__(self):
            super().__init__()
            self.layer = layer

        def construct(self, x, c):
            return (self.layer(x) * c).sum()

    gx, gw = ms.grad(Objective(), grad_position=0, weights=params)(
        Tensor(x.astype(np.float32)), Tensor(cot.astype(np.float32)))
    assert_close(numpy(layer(Tensor(x.astype(np.float32)))), out.detach().numpy())
    assert_close(numpy(gx), xt.grad.numpy(), rtol=1e-4)
    for leaf, g in zip(leaves, gw):
        assert_close(numpy(g), leaf.grad.numpy(), rtol=1e-4)
