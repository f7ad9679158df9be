"""ms_moe_ops.quantize: int8 (W8A8) and w8a16 (weight-only) routed experts in layers and whole
models, against the numpy golden model of the quantised maths (reference.quantized_experts)."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn

import ms_moe_ops
from ms_moe_ops import MoELayer, QuantMoeFFN, reference
from ms_moe_ops.nn import Int8Experts, W8A16Experts, quantization
from ms_moe_ops.ops import record_choices
from conftest import needs_kernels, run

H, F, E, K = 32, 16, 4, 2


def _layer(activation="swiglu", seed=0, **options):
    ms.set_seed(seed)
    return MoELayer(H, F, E, K, n_shared_experts=1, activation=activation, **options)


def _copy(layer, activation="swiglu", **options):
    twin = _layer(activation, **options)
    ms.load_param_into_net(twin, layer.parameters_dict())
    return twin


def _x(rng, rows=48):
    return Tensor(rng.standard_normal((rows, H)).astype(np.float32))


def _rows(rng, counts=(5, 0, 9, 10)):
    """Expert inputs grouped by expert (an expert without rows too)."""
    return (rng.standard_normal((sum(counts), H)).astype(np.float32),
            np.array(counts, np.int64))


def _golden(experts, x, counts):
    p = {name: v.asnumpy() for name, v in experts.parameters_and_names()}
    steps = {} if isinstance(experts, W8A16Experts) else dict(
        x_step=float(p["x_step"]), a_step=float(p["a_step"]))
    return reference.quantized_experts(x, counts, p["weight1"], p["deq_scale1"], p["weight2"],
                                       p["deq_scale2"], experts.activation, **steps)


def _relative(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


# -- the quantised maths ----------------------------------------------------------------------

@pytest.mark.parametrize("quant_mode", ["int8", "w8a16"])
def test_swiglu_experts_match_the_golden_model(quant_mode, mode, rng):
    layer = _layer()
    w1, w2 = layer.experts.weight1.asnumpy(), layer.experts.weight2.asnumpy()
    calibration = _x(rng)
    ms_moe_ops.quantize(layer, quant_mode, calibration=[calibration])
    experts = layer.experts
    if quant_mode == "int8":  # every token reaches K experts: x's step is max|x| / 127
        assert experts.x_step.asnumpy() == np.float32(np.abs(calibration.asnumpy()).max() / 127)
    assert type(experts) is (Int8Experts if quant_mode == "int8" else W8A16Experts)
    # the weights: int8 per expert and output channel, deq = activation step * weight step
    q1, s1 = reference.per_channel_int8(w1)
    q2, s2 = reference.per_channel_int8(w2)
    assert experts.weight1.dtype == ms.int8 and np.array_equal(experts.weight1.asnumpy(), q1)
    assert np.array_equal(experts.weight2.asnumpy(), q2)
    x_step = float(experts.x_step.asnumpy()) if quant_mode == "int8" else 1.0
    a_step = float(experts.a_step.asnumpy()) if quant_mode == "int8" else 1.0
    np.testing.assert_allclose(experts.deq_scale1.asnumpy(), x_step * s1, rtol=1e-6)
    np.testing.assert_allclose(experts.deq_scale2.asnumpy(), a_step * s2, rtol=1e-6)
    x, counts = _rows(rng)
    y = run(experts, Tensor(x), Tensor(counts), mode=mode).asnumpy()
    golden = _golden(experts, x, counts)
    # float32 products of integer-valued operands: the golden's value, rounded (an activation
    # exactly between two int8 steps in float64 may round the other way in float32: one step)
    one_step = float(np.abs(q2).max() * s2.max() * a_step)
    tolerance = 1e-5 if quant_mode == "w8a16" else 1e-5 + one_step
    np.testing.assert_allclose(y, golden, rtol=1e-5, atol=tolerance)
    assert _relative(y, golden) < 1e-5  # one step happens rarely, if at all


@needs_kernels("the int8 path of moe_ffn runs on the CPU kernel")
def test_fused_experts_take_the_seed_int8_path(mode, rng):
    layer = _layer("silu")
    x = _x(rng)
    ms_moe_ops.quantize(layer, "int8", calibration=[x])
    assert isinstance(layer.experts, QuantMoeFFN) and layer.experts.output_dtype == "float32"
    rows, counts = _rows(rng)
    p = {name: v.asnumpy() for name, v in layer.experts.parameters_and_names()}
    x_q = np.clip(np.rint(rows / p["x_step"]), -128, 127).astype(np.int8)
    golden = reference.moe_ffn_quant(x_q, counts, p["weight1"], p["weight2"], None, p["bias2"],
                                     p["scale"], p["offset"], p["deq_scale1"], p["deq_scale2"],
                                     activation="silu", output_dtype="float32")
    y = run(layer.experts, Tensor(rows), Tensor(counts), mode=mode).asnumpy()
    np.testing.assert_array_equal(y, golden)


@pytest.mark.parametrize("activation,quant_mode", [
    ("swiglu", "int8"), ("swiglu", "w8a16"), ("silu", "w8a16"),
    pytest.param("silu", "int8", marks=needs_kernels("the int8 moe_ffn runs on the CPU kernel"))])
def test_quantised_layer_is_close_to_the_float_layer(activation, quant_mode, mode, rng):
    layer = _layer(activation)
    x = _x(rng)
    expected = layer(x).asnumpy()
    # calibrated on the batch itself and another: no value past the ranges (the static steps
    # saturate beyond them), so this is the rounding error alone
    quantised = ms_moe_ops.quantize(_copy(layer, activation), quant_mode,
                                    calibration=[x, _x(rng)])
    y = run(quantised, x, mode=mode).asnumpy()
    error = _relative(y, expected)
    # measured: w8a16 ~0.3%, int8 ~1% of the largest output (int8 steps of x and a add up)
    assert 0 < error < (0.01 if quant_mode == "w8a16" else 0.03), error


def test_padded_experts_keep_zero_rows(rng):
    layer = _layer(capacity_factor=1.0)
    assert layer.experts.padded
    expected = layer(_x(rng, 16)).asnumpy()
    ms_moe_ops.quantize(layer, "int8", calibration=[_x(rng, 16)])
    x, counts = _rows(rng)
    padded = np.concatenate([x, np.full((3, H), 50, np.float32)])
    y = layer.experts(Tensor(padded), Tensor(counts)).asnumpy()
    assert not y[len(x):].any()
    np.testing.assert_allclose(y[:len(x)], layer.experts(Tensor(x), Tensor(counts)).asnumpy())
    assert expected.shape == (16, H)


# few rows read the int8 weights directly (weight_quant_grouped_matmul); with none allowed
# (DIRECT_ROWS = -1, as for half precision or biases) they dequantise only their experts
FEW_ROW_PATHS = pytest.mark.parametrize("direct_rows", [64, -1], ids=["direct", "dequantised"])


@FEW_ROW_PATHS
@pytest.mark.parametrize("quant_mode", ["int8", "w8a16"])
@pytest.mark.parametrize("counts", [(0, 1, 0, 0), (0, 2, 0, 1), (1, 0, 1, 0), (0, 0, 0, 3),
                                    (0, 0, 0, 0)])
def test_few_rows_dequantise_only_their_experts(quant_mode, counts, direct_rows, mode, rng,
                                                monkeypatch):
    """Fewer rows than experts (a decoding step): the int8 weights read as they are, or only
    the experts with rows gathered and dequantised; the output is the golden model's, as with
    many rows."""
    monkeypatch.setattr(quantization, "DIRECT_ROWS", direct_rows)
    layer = ms_moe_ops.quantize(_layer(), quant_mode, calibration=[_x(rng)])
    x, counts = _rows(rng, counts)
    with record_choices() as ran:
        y = run(layer.experts, Tensor(x), Tensor(counts), mode=mode).asnumpy()
    used = {name for name, _ in ran}
    assert ("weight_quant_grouped_matmul" in used, "dequantize" in used) == (
        direct_rows > 0, direct_rows < 0), ran
    assert y.shape == x.shape
    np.testing.assert_allclose(y, _golden(layer.experts, x, counts), rtol=1e-5, atol=1e-5)


@FEW_ROW_PATHS
def test_few_padded_rows_stay_zero(direct_rows, rng, monkeypatch):
    monkeypatch.setattr(quantization, "DIRECT_ROWS", direct_rows)
    layer = _layer(capacity_factor=1.0)
    ms_moe_ops.quantize(layer, "w8a16")
    x, counts = _rows(rng, (0, 1, 0, 0))
    padded = np.concatenate([x, np.full((2, H), 50, np.float32)])
    y = layer.experts(Tensor(padded), Tensor(counts)).asnumpy()
    assert not y[1:].any()
    np.testing.assert_allclose(y[:1], _golden(layer.experts, x, counts), rtol=1e-5, atol=1e-5)


def test_rows_known_at_run_time(rng):
    """GRAPH mode with the row count a run-time dimension (set_inputs): the whole weights, for
    few rows and many."""
    layer = ms_moe_ops.quantize(_layer(), "w8a16")
    layer.set_train(False)
    experts = layer.experts
    ms.set_context(mode=ms.GRAPH_MODE)
    try:
        experts.set_inputs(Tensor(shape=[None, H], dtype=ms.float32),
                           Tensor(shape=[E], dtype=ms.int64))
        for counts in ((0, 1, 0, 0), (1, 2, 3, 4)):
            x, counts = _rows(rng, counts)
            y = experts(Tensor(x), Tensor(counts)).asnumpy()
            np.testing.assert_allclose(y, _golden(experts, x, counts), rtol=1e-5, atol=1e-5)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


# -- memory ----------------------------------------------------------------------------------

def _bytes(cell):
    return sum(p.asnumpy().nbytes for p in cell.get_parameters())


@pytest.mark.parametrize("quant_mode", ["int8", "w8a16"])
def test_expert_weights_take_a_quarter_of_the_memory(quant_mode, rng):
    layer = _layer()
    float_bytes = _bytes(layer.experts)
    ms_moe_ops.quantize(layer, quant_mode, calibration=[_x(rng)])
    experts = layer.experts
    weights = experts.weight1.asnumpy().nbytes + experts.weight2.asnumpy().nbytes
    assert weights * 4 == float_bytes  # the int8 weights: exactly 4x smaller
    # plus the float32 dequant scales, [E, N] per weight (and the two static steps of int8)
    scales = 4 * E * (2 * F + H) + (8 if quant_mode == "int8" else 0)
    assert _bytes(experts) == weights + scales


# -- whole models ------------------------------------------------------------------------------

def _causal_lm(family="qwen3_moe"):
    pytest.importorskip("transformers")
    from hf_models import hf_config
    from ms_moe_ops.models import CausalLMConfig, MoECausalLM

    ms.set_seed(0)
    return MoECausalLM(CausalLMConfig.from_transformers(hf_config(family, layers=3)))


@pytest.mark.parametrize("quant_mode", ["int8", "w8a16"])
def test_whole_model_logits_stay_close(quant_mode, mode, rng):
    net = _causal_lm()
    ids = Tensor(rng.integers(0, 64, (2, 12)).astype(np.int32))
    expected = net(ids).asnumpy()
    attention = net.model.layers[1].self_attn.q_proj.weight.asnumpy().copy()
    calibration = [ids] + [rng.integers(0, 64, (2, 12)) for _ in range(2)]
    assert ms_moe_ops.quantize(net, quant_mode, calibration=calibration) is net
    layers = ms_moe_ops.moe_layers(net)
    assert len(layers) == 2 and not isinstance(layers[0].experts, ms_moe_ops.MoeFFN)
    # every parameter named after its place (GRAPH mode needs each name once)
    assert layers[1].experts.weight1.name == "model.layers.2.mlp.experts.weight1"
    # attention, the router and the shared experts stay float
    assert net.model.layers[1].self_attn.q_proj.weight.dtype == ms.float32
    np.testing.assert_array_equal(net.model.layers[1].self_attn.q_proj.weight.asnumpy(), attention)
    assert layers[0].router.weight.dtype == ms.float32
    logits = run(net, ids, mode=mode).asnumpy()
    # per position: a routing choice that flips (a near tie in a random model of hidden 32)
    # moves that token's logits a lot, so most positions are held to the rounding error
    # (measured: w8a16 about 1%, int8 about 4% of the largest logit)
    per_position = (np.abs(logits - expected).max(-1) / np.abs(expected).max(-1)).reshape(-1)
    bound = 0.03 if quant_mode == "w8a16" else 0.08
    assert np.median(per_position) < bound / 2 and (per_position < bound).mean() >= 0.8, \
        np.sort(per_position)


def test_quantised_generation_counts_every_routed_token(capfd, rng):
    """A quantised model's decoding steps (GRAPH: one compiled step; its experts dequantise only
    the experts with rows) keep counting the tokens each expert gets, as the float model's do,
    and compile without MindSpore dropping a node it took for a side effect (a warning the
    sort of _experts_with_rows once raised)."""
    from ms_moe_ops.models import generate

    ms.set_context(mode=ms.GRAPH_MODE)
    ids = rng.integers(0, 64, (2, 5)).astype(np.int32)
    net = ms_moe_ops.quantize(_causal_lm(), "w8a16")
    ms_moe_ops.reset_expert_load(net)
    capfd.readouterr()
    generate(net, ids, 4)
    assert "eliminated by mistake" not in capfd.readouterr().err
    # every token of the prompt and of the 3 decoding steps, top-2, in each of the MoE layers
    load = np.asarray(ms_moe_ops.expert_load(net)).reshape(2, -1)
    np.testing.assert_array_equal(load.sum(-1), [2 * (5 + 3) * 2] * 2)


# -- inference only ------------------------------------------------------------------------------

@pytest.mark.parametrize("quant_mode", ["int8", "w8a16"])
def test_training_and_gradients_raise(quant_mode, mode, rng):
    layer = ms_moe_ops.quantize(_layer(), quant_mode, calibration=[_x(rng)])
    x = _x(rng)
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        with pytest.raises(RuntimeError, match="inference only; they have no gradient"):
            ms.grad(layer)(x)
        layer.set_train(True)
        with pytest.raises(RuntimeError, match=r"inference only; call set_train\(False\)"):
            layer(x)
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)


# -- bad inputs ------------------------------------------------------------------------------

def test_bad_inputs_are_named(rng):
    with pytest.raises(ValueError, match=r"mode must be one of \('int8', 'w8a16'\), got 'int4'"):
        ms_moe_ops.quantize(_layer(), "int4")
    with pytest.raises(ValueError, match="Dense holds no MoELayer: nothing to quantise"):
        ms_moe_ops.quantize(nn.Dense(4, 4), "w8a16")
    with pytest.raises(ValueError, match="'int8' needs calibration.*'w8a16' .weight-only. needs "
                                         "none"):
        ms_moe_ops.quantize(_layer(), "int8")
    with pytest.raises(ValueError, match="calibration holds no batch"):
        ms_moe_ops.quantize(_layer(), "int8", calibration=[])
    layer = ms_moe_ops.quantize(_layer(), "w8a16")
    for again in ("w8a16", "int8"):
        with pytest.raises(ValueError, match=r"already quantised \(W8A16Experts\)"):
            ms_moe_ops.quantize(layer, again, calibration=[_x(rng)])


def test_a_failed_calibration_leaves_the_float_model(rng):
    layer = _layer()
    experts = layer.experts
    with pytest.raises(ValueError):
        ms_moe_ops.quantize(layer, "int8", calibration=[np.zeros((3, H + 1), np.float32)])
    assert layer.experts is experts
