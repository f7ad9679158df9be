"""Router training losses: values against the numpy reference, gradients through the scaler against
finite differences of the reference, the logging Parameter in both modes, training with them."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

from ms_moe_ops import AuxLossScaler, MoELayer, load_imbalance, reference as ref
from conftest import assert_close, finite_diff, grad, nan_pool, numpy, run, tensor
from cases import inputs, layer_grads, make_layer, params

COEFFS = dict(aux_loss_coeff=0.7, seq_aux_loss_coeff=1.3, z_loss_coeff=0.2)

CASES = {
    # (layer options, input shape)
    "softmax, switch only": (dict(score_func="softmax", norm_topk_prob=False,
                                  aux_loss_coeff=0.5), (2, 5, 8)),
    "sigmoid groups, all": (dict(e=8, k=3, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                 shared=1, **COEFFS), (3, 4, 8)),
    "softmax [T, H], seq + z": (dict(score_func="softmax", seq_aux_loss_coeff=0.9,
                                     z_loss_coeff=0.4), (7, 8)),
}


def reference_losses(layer, x, idx):
    """[switch, sequence, z] of the reference at the layer's weights, routing idx held fixed."""
    r = layer.router
    w = params(layer)["router_weight"]
    sequences = x.shape[0] if x.ndim == 3 else 1
    logits = x.reshape(-1, x.shape[-1]) @ w.T
    return np.array([ref.switch_aux_loss(logits, idx, r.score_func),
                     ref.sequence_aux_loss(logits, idx, sequences, r.score_func),
                     ref.router_z_loss(logits)])


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.slow_in_graph
def test_losses_and_their_gradients(case, mode):
    options, shape = CASES[case]
    on = make_layer(seed=3, **options)
    off = make_layer(seed=3, **{k: v for k, v in options.items() if not k.endswith("_coeff")})
    x = inputs(shape, seed=4)
    cot = np.random.default_rng(5).normal(0, 1, shape)
    g_on = layer_grads(on, x, cot, mode)  # its forward pass logs the losses too
    g_off = layer_grads(off, x, cot, mode)

    coeffs = np.array(on.router.loss_coeffs)
    _, idx = ref.moe_layer(x, **params(on), top_k=on.top_k, n_group=on.router.n_group,
                           topk_group=on.router.topk_group, score_func=on.router.score_func,
                           group_select_mode=on.router.group_select_mode)
    expected = reference_losses(on, x, idx)
    logged = on.router.aux_losses.asnumpy()
    # the unscaled values of the last forward pass; 0 for the losses that are off
    assert_close(logged, np.where(coeffs > 0, expected, 0.0))
    assert on.router.losses() == dict(zip(("switch", "sequence", "z"), logged.tolist()))

    # the scaler adds coeffs . d(losses) to the gradients of the input and the router only
    w = params(on)["router_weight"]

    def weighted(xv, wv):
        logits = xv.reshape(-1, xv.shape[-1]) @ wv.T
        sequences = xv.shape[0] if xv.ndim == 3 else 1
        return float(coeffs @ [ref.switch_aux_loss(logits, idx, on.router.score_func),
                               ref.sequence_aux_loss(logits, idx, sequences, on.router.score_func),
                               ref.router_z_loss(logits)])

    # a difference of two float32 gradients: it carries their rounding errors, hence the floor
    assert_close(g_on[0] - g_off[0], finite_diff(lambda v: weighted(v, w), x), rtol=1e-4,
                 atol=1e-5 * np.abs(g_on[0]).max())
    gw_on, gw_off = g_on[1], g_off[1]
    d_router = finite_diff(lambda v: weighted(x, v), w)
    assert np.abs(d_router).max() > 0
    assert_close(gw_on["router.weight"] - gw_off["router.weight"], d_router, rtol=1e-4,
                 atol=1e-5 * np.abs(gw_on["router.weight"]).max())
    for name in gw_on:
        if name != "router.weight":
            np.testing.assert_array_equal(gw_on[name], gw_off[name])


@pytest.mark.slow_in_graph
def test_losses_are_off_by_default(mode):
    layer = make_layer()
    assert layer.router.loss_scaler is None
    run(layer, tensor(inputs((2, 3, 8)).astype(np.float32)), mode=mode)
    np.testing.assert_array_equal(layer.router.aux_losses.asnumpy(), [0, 0, 0])


class _Weighted(nn.Cell):
    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def construct(self, x, losses, cot):
        return (self.cell(x, losses) * cot).sum()


def test_scaler_backward(mode):
    scaler = AuxLossScaler([0.5, 0.0, 2.0])
    x = Tensor(np.arange(6, dtype=np.float32).reshape(2, 3))
    losses = Tensor(np.array([3.0, 4.0, 5.0], np.float32))
    cot = Tensor(np.array([[1, -2, 3], [0.5, 0, 1]], np.float32))
    out = run(scaler, x, losses, mode=mode)
    np.testing.assert_array_equal(out.asnumpy(), x.asnumpy())
    gx, gl = grad(_Weighted(scaler), x, losses, cot, mode=mode, argnums=(0, 1))
    np.testing.assert_array_equal(gx.asnumpy(), cot.asnumpy())
    np.testing.assert_array_equal(gl.asnumpy(), [0.5, 0.0, 2.0])


@pytest.mark.slow_in_graph
def test_bfloat16_input(mode):
    # [T, H]: MindSpore's CPU Reshape has no bfloat16 kernel in GRAPH mode, so a [B, S, H]
    # bfloat16 input does not compile there (with or without the losses)
    x = inputs((12, 8), seed=6, dtype="bfloat16")
    layer = make_layer(shared=1, **COEFFS)
    out = run(layer, tensor(x, "bfloat16"), mode=mode)
    assert out.dtype == ms.bfloat16
    logged = layer.router.aux_losses.asnumpy()
    run(layer, tensor(x.astype(np.float32)), mode=mode)
    # the router works in float32 whatever the input dtype: the same routing, the same losses
    assert_close(logged, layer.router.aux_losses.asnumpy(), rtol=1e-6)


def train_skewed_router(aux_loss_coeff, steps=30):
    """GRAPH mode, TrainOneStepCell, no bias balancing, a router that sends every token to expert
    0 at first: (logged switch loss, load imbalance) per step."""
    layer = make_layer(h=8, e=4, k=1, score_func="softmax", bias_update_rate=0.0,
                       aux_loss_coeff=aux_loss_coeff)
    w = layer.router.weight.asnumpy()
    w[0] += 0.3
    layer.router.weight.set_data(Tensor(w))
    rng = np.random.default_rng(8)
    x = Tensor(np.abs(rng.normal(0, 1, (4, 16, 8))).astype(np.float32))
    target = Tensor(np.zeros((4, 16, 8), np.float32))
    ms.set_context(mode=ms.GRAPH_MODE)
    step = nn.TrainOneStepCell(nn.WithLossCell(layer, nn.MSELoss()),
                               nn.SGD(layer.trainable_params(), 0.2))
    switch, imbalance = [], []
    for _ in range(steps):
        step(x, target)
        switch.append(layer.router.losses()["switch"])
        imbalance.append(load_imbalance(layer)[0])
        layer.router.tokens_per_expert.set_data(Tensor(np.zeros(4, np.float32)))
    return switch, imbalance


@pytest.mark.slow
def test_switch_loss_training_balances_the_load():
    switch, imbalance = train_skewed_router(1.0)
    assert len(set(switch)) > 10  # logged anew every step
    assert imbalance[0] == 4.0 and imbalance[-1] < 1.7, imbalance
    assert switch[-1] < 0.5 * switch[0], switch
    _, control = train_skewed_router(0.0)  # the main loss alone does not balance
    assert min(control) == 4.0, control


def test_bad_coefficients():
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="aux_loss_coeff"):
            MoELayer(8, 4, 4, 2, aux_loss_coeff=bad)
    for bad in ("0.1", True, None):
        with pytest.raises(TypeError, match="seq_aux_loss_coeff"):
            MoELayer(8, 4, 4, 2, seq_aux_loss_coeff=bad)
    assert MoELayer(8, 4, 4, 2, aux_loss_coeff=np.float32(0.5)).router.loss_coeffs == (0.5, 0, 0)
    with pytest.raises(ValueError, match="z_loss_coeff"):
        MoELayer(8, 4, 4, 2, z_loss_coeff=-1)


def test_set_loss_scale_reaches_every_router_and_refuses_nonsense():
    from ms_moe_ops import set_loss_scale
    from ms_moe_ops.parallel import ExpertParallel, ExpertParallelTrainStep

    net = nn.SequentialCell([MoELayer(8, 6, 4, 2, aux_loss_coeff=0.1),
                             MoELayer(8, 6, 4, 2, z_loss_coeff=0.1), MoELayer(8, 6, 4, 2)])
    scales = lambda: [c.loss_scale.asnumpy().item() for _, c in net.cells_and_names()  # noqa: E731
                      if isinstance(c, AuxLossScaler)]
    assert scales() == [1.0, 1.0]
    assert set_loss_scale(net, 2.0 ** 16) == 2
    assert scales() == [65536.0, 65536.0]
    assert set_loss_scale(net, Tensor([8.0], ms.float32)) == 2 and scales() == [8.0, 8.0]
    for bad in (0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="set_loss_scale: the loss scale must be a positive"):
            set_loss_scale(net, bad)
    loss = nn.WithLossCell(net, nn.MSELoss())
    ExpertParallelTrainStep(loss, nn.SGD(net.trainable_params()), ExpertParallel.single(), sens=4.0)
    assert scales() == [4.0, 4.0]
    x, target = (Tensor(np.ones((3, 8), np.float32)) for _ in range(2))
    step = ExpertParallelTrainStep(loss, nn.SGD(net.trainable_params()), ExpertParallel.single())
    assert np.isfinite(step(x, target).asnumpy()) and scales() == [1.0, 1.0]  # one rank runs too


def test_every_loss_of_no_tokens_is_zero(mode):
    """T = 0 (an empty batch, or a rank that received no token): each loss is 0, not the 0/0 of
    its mean over the tokens, nor what an empty reduction leaves behind (NaN from the memory pool,
    once the tests run before it had left NaN there)."""
    from ms_moe_ops.nn.losses import router_z_loss, sequence_aux_loss, switch_aux_loss

    nan_pool(mode)

    probs = Tensor(np.zeros((0, 4), np.float32))
    idx = Tensor(np.zeros((0, 2), np.int32))

    def losses(p, i):
        return (switch_aux_loss(p, ops.zeros(4, ms.float32)), sequence_aux_loss(p, i, 1),
                router_z_loss(p))

    for value in run(losses, probs, idx, mode=mode):
        assert numpy(value) == 0, numpy(value)
