"""MoELayer against the numpy reference: forward, gradients (finite differences), modes, dtypes,
routing options and corner cases, load balancing, training, options object and checkpoint
conversion. (Parity with transformers' blocks: test_families.py; losses: test_losses.py.)"""
import dataclasses

import numpy as np
import pytest
import mindspore as ms
from mindspore import Parameter, Tensor, nn

import ms_moe_ops
from ms_moe_ops import MoELayer, load_imbalance, reference as ref, update_expert_bias
from cases import config, inputs, layer_grads, make_layer, params, reference, rounded_experts
from conftest import (DEVICE, RTOL, assert_close, finite_diff, kernels_missing, numpy, rounded, run,
                      tensor)


# -- forward --------------------------------------------------------------------------------------

CONFIGS = {
    "swiglu+shared": dict(shared=1),
    "top1": dict(k=1),
    "E=top_k": dict(e=2, k=2, shared=2),
    "groups-mode1": dict(e=8, k=3, n_group=4, topk_group=2, group_select_mode=1),
    "groups-mode0": dict(e=8, k=2, n_group=4, topk_group=2, group_select_mode=0, shared=1),
    "softmax+scale": dict(score_func="softmax", routed_scaling_factor=2.5),
    "softmax, no renormalisation": dict(score_func="softmax", norm_topk_prob=False, k=3),
    "sigmoid, no renormalisation": dict(norm_topk_prob=False, routed_scaling_factor=1.5),
    "groups by max, softmax, no renormalisation": dict(
        e=8, k=3, n_group=4, topk_group=2, group_select_mode=0, score_func="softmax",
        norm_topk_prob=False, routed_scaling_factor=1.7, shared=2),
    "gated shared expert": dict(score_func="softmax", shared=1, shared_expert_gate=True),
    "clamp": dict(clamp_limit=0.5),
    "fastgelu": dict(activation="fastgelu", shared=1),
    "gelu": dict(activation="gelu"),
    "relu": dict(activation="relu", k=1),
    "silu": dict(activation="silu", k=3),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_matches_reference(name):
    layer = make_layer(**CONFIGS[name])
    x = inputs((2, 5, 8))
    out = layer(tensor(x.astype(np.float32)))
    expected, _ = reference(layer, x)
    assert out.shape == (2, 5, 8) and out.dtype == ms.float32
    assert_close(numpy(out), expected)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_modes_and_dtypes(mode, dtype):
    layer = make_layer(shared=1, e=8, k=2, n_group=2, topk_group=1)
    x = inputs((12, 8), dtype=dtype)
    out = run(layer, tensor(x, dtype), mode=mode)
    assert out.shape == (12, 8) and out.dtype == tensor(x, dtype).dtype
    # the experts' weights are rounded to the input dtype (the router stays float32), and so is
    # the output of each of the six operators between input and output: a few ulps of the
    # routed and the shared part each
    expected, _ = reference(layer, x, **rounded_experts(layer, dtype))
    if dtype == "float32":
        assert_close(numpy(out), expected)
        return
    routed, _ = reference(layer, x, **{**rounded_experts(layer, dtype), "shared_weight1": None})
    size = np.abs(routed) + np.abs(expected - routed) + np.abs(expected).max() / 20
    assert_close(numpy(out), expected, dtype, rtol=0, atol=4 * RTOL[dtype] * size)


@pytest.mark.slow_in_graph
def test_experts_without_tokens(mode):
    # the bias makes every token choose experts 1 and 4: the others get no rows at all
    layer = make_layer(e=6, k=2, shared=1)
    layer.router.expert_bias.set_data(Tensor(np.array([0, 5, 0, 0, 5, 0], np.float32)))
    x = inputs((7, 8))
    out = run(layer, tensor(x.astype(np.float32)), mode=mode)
    expected, idx = reference(layer, x)
    assert set(np.unique(idx)) == {1, 4}
    assert_close(numpy(out), expected)
    np.testing.assert_array_equal(layer.router.load(), [0, 7, 0, 0, 7, 0])
    grads = layer_grads(layer, x, np.ones((7, 8)), mode)[1]
    gw1 = grads["experts.weight1"]
    assert np.abs(gw1[[0, 2, 3, 5]]).max() == 0 and np.abs(gw1[[1, 4]]).max() > 0


# -- gradients ------------------------------------------------------------------------------------

GRAD_CONFIGS = {
    "swiglu+shared": dict(shared=1),
    "fastgelu+groups": dict(activation="fastgelu", e=4, k=2, n_group=2, topk_group=1),
    "softmax+clamp": dict(score_func="softmax", clamp_limit=0.8, routed_scaling_factor=1.5),
    "no renormalisation, gated shared": dict(score_func="softmax", norm_topk_prob=False, shared=1,
                                             shared_expert_gate=True),
    "sigmoid, no renormalisation, relu": dict(norm_topk_prob=False, activation="relu"),
}


@pytest.mark.parametrize("name", list(GRAD_CONFIGS))
@pytest.mark.slow_in_graph
def test_gradients_match_finite_differences(name, mode):
    layer = make_layer(h=4, f=3, e=4, k=2, **{k: v for k, v in GRAD_CONFIGS[name].items()
                                              if k not in ("e", "k")})
    x = inputs((5, 4), seed=3)
    cot = np.random.default_rng(4).normal(0, 1, (5, 4))
    gx, gw = layer_grads(layer, x, cot, mode)
    _, idx = reference(layer, x)  # the routing is held fixed: it is piecewise constant
    base = params(layer)

    def objective(**change):
        out, _ = ref.moe_layer(**{**base, **config(layer), "x": x, "expert_idx": idx, **change})
        return float((out * cot).sum())

    assert_close(gx, finite_diff(lambda v: objective(x=v), x), rtol=1e-4)
    names = {"router.weight": "router_weight", "experts.weight1": "weight1",
             "experts.weight2": "weight2", "shared_experts.weight1": "shared_weight1",
             "shared_experts.weight2": "shared_weight2", "shared_experts.gate": "shared_gate"}
    assert set(gw) == {n for n in names if names[n] in base}
    for pname, arg in names.items():
        if arg in base:
            expected = finite_diff(lambda v: objective(**{arg: v}), base[arg])
            assert np.abs(expected).max() > 0, pname
            assert_close(gw[pname], expected, rtol=1e-4)


@pytest.mark.parametrize("activation", ["swiglu", "fastgelu"])
@pytest.mark.slow_in_graph
def test_bfloat16_gradients(activation, mode, rng):
    if DEVICE == "CPU" and mode == "graph" and kernels_missing():
        pytest.skip(f"bfloat16 products in a CPU graph need the kernels (MindSpore 2.10's CPU "
                    f"graphs have no bfloat16 MatMul): {kernels_missing()}")
    # Against finite differences of the float64 reference on the same bfloat16 inputs and the
    # bfloat16-rounded expert weights, element by element. Forward and backward round about ten
    # intermediate results to bfloat16 (products, SwiGLU, unpermute, the cotangent's casts), so
    # a few ulps: 4 half-ulps relative plus a floor of 2% of the largest gradient.
    layer = make_layer(h=4, f=3, shared=1, activation=activation)
    x = inputs((6, 4), seed=5, dtype="bfloat16")
    cot = rounded(rng.normal(0, 1, (6, 4)), "bfloat16")
    gx, gw = layer_grads(layer, x, cot, mode, dtype="bfloat16")
    _, idx = reference(layer, x)
    base = {**params(layer), **rounded_experts(layer, "bfloat16")}

    def objective(**change):
        out, _ = ref.moe_layer(**{**base, **config(layer), "x": x, "expert_idx": idx, **change})
        return float((out * cot).sum())

    def check(got, want):
        assert_close(got, want, "bfloat16", rtol=4 * RTOL["bfloat16"],
                     atol=0.02 * np.abs(want).max())

    check(gx, finite_diff(lambda v: objective(x=v), x))
    names = {"router.weight": "router_weight", "experts.weight1": "weight1",
             "experts.weight2": "weight2", "shared_experts.weight1": "shared_weight1",
             "shared_experts.weight2": "shared_weight2"}
    for pname, arg in names.items():
        check(gw[pname], finite_diff(lambda v: objective(**{arg: v}), base[arg]))


# -- load balance, training, layout ---------------------------------------------------------------

def test_tokens_per_expert_counts_once_per_step_in_graph_mode():
    layer = make_layer(e=4, k=2)
    x = Tensor(inputs((10, 8)).astype(np.float32))
    target = Tensor(np.zeros((10, 8), np.float32))
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        net = nn.WithLossCell(layer, nn.MSELoss())
        step = nn.TrainOneStepCell(net, nn.SGD(layer.trainable_params(), 0.01))
        step(x, target)
        assert layer.router.load().sum() == 20
        step(x, target)
        assert layer.router.load().sum() == 40
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    load = update_expert_bias(layer)
    assert load.shape == (1, 4) and load.sum() == 40
    assert layer.router.load().sum() == 0


@pytest.mark.slow_in_graph
def test_bias_update_moves_load_toward_balance(mode):
    layer = make_layer(h=8, e=8, k=2, bias_update_rate=0.05)
    x = inputs((64, 8), seed=6)
    # expert 0 wins every token at first
    w = layer.router.weight.asnumpy()
    w[0] = 0
    layer.router.expert_bias.set_data(Tensor(np.array([2] + [0] * 7, np.float32)))
    layer.router.weight.set_data(Tensor(w))
    xt = tensor(x.astype(np.float32))
    imbalance = []
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        for _ in range(60):
            layer(xt)  # one compiled graph: the bias is a Parameter, changing it needs no rebuild
            imbalance.append(load_imbalance(layer)[0])
            update_expert_bias(layer)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert imbalance[0] >= 3.9  # 64 of the 128 routed slots on expert 0: 4x the mean
    assert max(imbalance[-5:]) < 2.0, imbalance


@pytest.mark.slow_in_graph
def test_load_imbalance_after_the_update_reports_the_step(mode):
    """The natural order, update_expert_bias then load_imbalance, reports the load of the step
    that drove the update (it reported 1.0 always: the update resets the counts)."""
    layer = make_layer(e=4, k=1)
    layer.router.expert_bias.set_data(Tensor(np.array([3, 0, 0, 0], np.float32)))
    run(layer, tensor(inputs((8, 8)).astype(np.float32)), mode=mode)  # every token on expert 0
    before = ms_moe_ops.load_imbalance(layer)
    load = update_expert_bias(layer)
    np.testing.assert_array_equal(load, [[8, 0, 0, 0]])
    assert before == load_imbalance(layer) == load_imbalance(load) == [4.0]
    np.testing.assert_array_equal(ms_moe_ops.expert_load(layer), load)
    assert layer.router.load().sum() == 0  # the counts start again
    run(layer, tensor(inputs((8, 8), seed=2).astype(np.float32)), mode=mode)
    np.testing.assert_array_equal(ms_moe_ops.expert_load(layer), [layer.router.load()])
    ms_moe_ops.reset_expert_load(layer)  # forgets both
    assert load_imbalance(layer) == [1.0] and not ms_moe_ops.expert_load(layer).any()


@pytest.mark.slow_in_graph
def test_train_one_step_cell_decreases_loss(mode):
    layer = make_layer(h=8, f=8, e=4, k=2, shared=1)
    rng = np.random.default_rng(7)
    x = Tensor(rng.normal(0, 1, (32, 8)).astype(np.float32))
    target = Tensor(np.tanh(rng.normal(0, 1, (32, 8))).astype(np.float32))
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        step = nn.TrainOneStepCell(nn.WithLossCell(layer, nn.MSELoss()),
                                   nn.Adam(layer.trainable_params(), 0.01))
        losses = []
        for _ in range(25):
            losses.append(float(step(x, target)))
            update_expert_bias(layer)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    assert np.isfinite(losses).all() and losses[-1] < 0.5 * losses[0], losses


def test_parameter_layout():
    layer = MoELayer(16, 12, 8, 2, n_shared_experts=2, shared_ffn_hidden_size=5)
    shapes = {n: tuple(p.shape) for n, p in layer.parameters_and_names()}
    assert shapes == {"router.weight": (8, 16), "router.expert_bias": (8,),
                      "router.tokens_per_expert": (8,), "router.aux_losses": (3,),
                      "experts.weight1": (8, 16, 24),
                      "experts.weight2": (8, 12, 16), "shared_experts.weight1": (16, 20),
                      "shared_experts.weight2": (10, 16)}
    assert {p.name for p in layer.trainable_params()} == {
        "router.weight", "experts.weight1", "experts.weight2", "shared_experts.weight1",
        "shared_experts.weight2"}
    plain = MoELayer(16, 12, 8, 2, activation="relu")
    assert plain.experts.weight1.shape == (8, 16, 12) and plain.shared_experts is None
    gated = MoELayer(16, 12, 8, 2, n_shared_experts=1, shared_expert_gate=True)
    assert gated.shared_experts.gate.shape == (16,) and gated.shared_experts.gate.requires_grad


def test_config_object():
    layer = MoELayer(16, 12, 8, 2, score_func="softmax", norm_topk_prob=False, n_shared_experts=1,
                     shared_expert_gate=True, z_loss_coeff=1e-3)
    config = layer.config
    assert isinstance(config, ms_moe_ops.MoEConfig)
    assert (config.score_func, config.norm_topk_prob, config.z_loss_coeff) == ("softmax", False, 1e-3)
    for again in (MoELayer(config), MoELayer.from_config(config)):
        assert again.config == config
        assert {n: p.shape for n, p in again.parameters_and_names()} == \
            {n: p.shape for n, p in layer.parameters_and_names()}
    assert MoELayer.from_config(config.replace(top_k=3)).router.top_k == 3
    assert MoELayer(config, top_k=3).config == config.replace(top_k=3)
    # every part is built from its own config, taken from the layer's by name
    assert layer.router.config == config.router()
    assert layer.experts.config == config.experts()
    assert layer.shared_experts.config == config.shared_experts()
    assert config.router().z_loss_coeff == 1e-3 and config.router().score_func == "softmax"


def test_an_option_is_declared_once():
    """MoEConfig holds every option of RouterConfig, ExpertsConfig (but the experts' padding,
    which the token dispatcher decides) and CapacityConfig with the same default (but SwiGLU
    experts), then the shared experts' three: a new router, experts or capacity option reaches
    the layer by itself."""
    parts = [f for part in (ms_moe_ops.RouterConfig, ms_moe_ops.ExpertsConfig,
                            ms_moe_ops.CapacityConfig)
             for f in dataclasses.fields(part) if f.name != "padded"]
    fields = {f.name: f for f in dataclasses.fields(ms_moe_ops.MoEConfig)}
    assert list(fields)[:4] == ["hidden_size", "ffn_hidden_size", "num_experts", "top_k"]
    assert list(fields)[-3:] == ["n_shared_experts", "shared_ffn_hidden_size", "shared_expert_gate"]
    assert set(fields) == {f.name for f in parts} | set(list(fields)[-3:]) | {"ffn_hidden_size"}
    for f in parts:
        expected = "swiglu" if f.name == "activation" else f.default
        assert fields[f.name].default == expected, f.name
    # the keyword convenience takes them all, by name
    options = dict(n_group=2, topk_group=1, group_select_mode=0, score_func="softmax",
                   norm_topk_prob=False, routed_scaling_factor=2.0, bias_update_rate=0.1,
                   aux_loss_coeff=0.1, seq_aux_loss_coeff=0.2, z_loss_coeff=0.3,
                   activation="gelu", has_bias=True, clamp_limit=0.0, capacity_factor=1.5,
                   drop_policy="position", pad_to_capacity=True, n_shared_experts=2,
                   shared_ffn_hidden_size=3, shared_expert_gate=True)
    assert set(options) | {"hidden_size", "ffn_hidden_size", "num_experts", "top_k"} == set(fields)
    layer = MoELayer(hidden_size=8, ffn_hidden_size=6, num_experts=4, top_k=2, **options)
    assert dataclasses.asdict(layer.config) == dict(hidden_size=8, ffn_hidden_size=6,
                                                    num_experts=4, top_k=2, **options)
    assert layer.experts.bias2.shape == (4, 8) and layer.shared_experts.weight2.shape == (6, 8)
    with pytest.raises(TypeError, match="MoELayer: .*unexpected keyword argument 'topk'"):
        MoELayer(8, 6, 4, 2, topk=3)
    with pytest.raises(TypeError, match="MoELayer: takes a MoEConfig or its options"):
        MoELayer(layer.config, 6)


@pytest.mark.slow_in_graph
def test_expert_biases(mode):
    """has_bias, an experts option, reaches MoELayer: the routing weight scales each expert's
    whole output, bias2 included (the reference's formula)."""
    layer = make_layer(has_bias=True, shared=1, activation="swiglu")
    for p in (layer.experts.bias1, layer.experts.bias2):
        p.set_data(Tensor(np.random.default_rng(2).normal(0, 0.5, p.shape).astype(np.float32)))
    x = inputs((6, 8))
    out = run(layer, tensor(x.astype(np.float32)), mode=mode)
    expected, _ = reference(layer, x)
    assert_close(numpy(out), expected)


def test_deepseek_v3_checkpoint_converter():
    h, f, e = 8, 6, 4
    rng = np.random.default_rng(8)
    hf = {"model.layers.0.mlp.gate.weight": rng.normal(0, 0.5, (e, h)),
          "model.layers.0.mlp.gate.e_score_correction_bias": rng.normal(0, 0.1, e)}
    for stem in [f"experts.{i}." for i in range(e)] + ["shared_experts."]:
        hf[f"model.layers.0.mlp.{stem}gate_proj.weight"] = rng.normal(0, 0.4, (f, h))
        hf[f"model.layers.0.mlp.{stem}up_proj.weight"] = rng.normal(0, 0.4, (f, h))
        hf[f"model.layers.0.mlp.{stem}down_proj.weight"] = rng.normal(0, 0.4, (h, f))
    converted = ms_moe_ops.convert_deepseek_v3_moe(hf, "model.layers.0.mlp.", "", e)
    layer = MoELayer(h, f, e, 2, n_shared_experts=1)
    not_loaded, _ = ms.load_param_into_net(
        layer, {k: Parameter(Tensor(v), name=k) for k, v in converted.items()}, strict_load=True)
    # routing statistics, not weights
    # routing statistics, not weights
    assert sorted(not_loaded) == ["router.aux_losses", "router.tokens_per_expert"]
    x = inputs((5, h))
    out = numpy(layer(tensor(x.astype(np.float32))))
    # the Hugging Face formulation, token by token
    p = {k.split("mlp.")[1]: v for k, v in hf.items()}
    silu = lambda v: v / (1 + np.exp(-v))  # noqa: E731
    mlp = lambda v, s: (silu(v @ p[s + "gate_proj.weight"].T) * (v @ p[s + "up_proj.weight"].T)) \
        @ p[s + "down_proj.weight"].T  # noqa: E731
    scores = 1 / (1 + np.exp(-(x @ p["gate.weight"].T)))
    expected = np.zeros_like(x)
    for t in range(5):
        top = np.argsort(-(scores[t] + p["gate.e_score_correction_bias"]), kind="stable")[:2]
        w = scores[t, top] / scores[t, top].sum()
        expected[t] = sum(wi * mlp(x[t], f"experts.{i}.") for wi, i in zip(w, top))
        expected[t] += mlp(x[t], "shared_experts.")
    assert_close(out, expected, rtol=1e-5)


def test_bad_configuration():
    with pytest.raises(ValueError, match="activation"):
        MoELayer(8, 4, 4, 2, activation="tanh")
    with pytest.raises(ValueError, match="n_shared_experts"):
        MoELayer(8, 4, 4, 2, n_shared_experts=-1)
    with pytest.raises(ValueError, match="top_k"):
        MoELayer(8, 4, 4, 5)
    with pytest.raises(ValueError, match="clamp_limit"):
        MoELayer(8, 4, 4, 2, activation="relu", clamp_limit=1.0)
    with pytest.raises(ValueError, match="shared_expert_gate"):
        MoELayer(8, 4, 4, 2, shared_expert_gate=True)
