"""Mixed precision: `auto_mixed_precision` O1/O2/O3 (float16 and bfloat16) and `Cell.to_float` on
nets holding MoELayer, GatingTopK and MoeFFN, forward and gradients, PyNative and GRAPH.

The evidence: the router is float32 whatever the level (its outputs are bit-identical to the
float32 router's); under O2/O3/to_float the experts compute in the AMP dtype on this package's
kernels, so the AMP net is bit-identical to the same net run on inputs already in that dtype;
O1 lowers only MindSpore's white list, so it leaves these Cells in float32."""
import numpy as np
import mindspore as ms
import pytest
from mindspore import Tensor, nn

import ms_moe_ops
from ms_moe_ops import GatingTopK, MoELayer, MoeFFN
from conftest import DEVICE, kernels_missing, numpy, rounded, tensor


def _needs_kernels_for_bfloat16(dtype, mode):
    """MindSpore 2.10's CPU graphs have no bfloat16 MatMul kernel: without this package's kernels
    the experts' products (the compositions) cannot run in bfloat16 in a CPU graph."""
    if DEVICE == "CPU" and dtype == "bfloat16" and mode == "graph" and kernels_missing():
        pytest.skip(f"bfloat16 products on CPU need the kernels: {kernels_missing()}")

LEVELS = ["O1", "O2", "O3", "to_float"]


@pytest.fixture(autouse=True)
def _in_tmp_path(tmp_path, monkeypatch):
    """O1 writes the networks it rewrites to ./rewritten_network: keep them out of the tree."""
    monkeypatch.chdir(tmp_path)
AMP_DTYPES = {"float16": ms.float16, "bfloat16": ms.bfloat16}


def _with_weights(cell, seed=0):
    rng = np.random.default_rng(seed)
    for p in cell.trainable_params():
        p.set_data(Tensor(rng.normal(0, 0.5, p.shape).astype(np.float32)))
    return cell


def _amp(net, level, dtype):
    if level == "to_float":
        return net.to_float(dtype)
    return ms.amp.auto_mixed_precision(net, level, dtype)


def _set_mode(mode):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)


class _Objective(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x, cotangent):
        out = self.net(x)
        return (out.astype(ms.float32) * cotangent).sum(), out


def _forward_and_grads(net, x, cotangent):
    """(net(x), {parameter: d/dparameter of sum(net(x) * cotangent)}), one compilation."""
    params = net.trainable_params()
    fn = ms.value_and_grad(_Objective(net), grad_position=None, weights=params, has_aux=True)
    (_, out), grads = fn(x, cotangent)
    return out, {_short(p.name): numpy(g) for p, g in zip(params, grads)}


def _short(name):
    """A parameter's name without the prefixes of the wrappers around the net."""
    parts = name.split(".")
    while parts[0] in ("net", "_backbone", "cell"):
        parts = parts[1:]
    return ".".join(parts)


class _Holder(nn.Cell):
    """A user's net holding one of the Cells (O1 rewrites the net, not the Cells it holds)."""

    def __init__(self, cell):
        super().__init__()
        self.cell = cell

    def construct(self, *args):
        return self.cell(*args)


class _TwoLayers(nn.Cell):
    """A net of two MoE blocks (SwiGLU with a shared expert, then fastgelu experts and a gated
    shared expert), with the router's training losses."""

    def __init__(self):
        super().__init__()
        self.first = MoELayer(8, 6, 4, 2, n_shared_experts=1, n_group=2, topk_group=1,
                              seq_aux_loss_coeff=0.1)
        self.second = MoELayer(8, 6, 4, 2, activation="fastgelu", shared_expert_gate=True,
                               n_shared_experts=1, aux_loss_coeff=0.1, z_loss_coeff=0.01)

    def construct(self, x):
        return self.second(self.first(x) * 0.5)


@pytest.mark.parametrize("amp_dtype", list(AMP_DTYPES))
@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.slow_in_graph
def test_router_stays_float32(level, amp_dtype, mode, rng):
    router = _with_weights(GatingTopK(8, 8, 2, n_group=2, topk_group=1, routed_scaling_factor=2.5))
    # (GRAPH mode casts the inputs of a lowered net: values the AMP dtype holds exactly)
    x = tensor(rounded(rng.normal(0, 1, (7, 8)), amp_dtype).astype(np.float32))
    weights, idx = (numpy(t) for t in router(x))
    amp = _amp(_Holder(router), level, AMP_DTYPES[amp_dtype])
    _set_mode(mode)
    got_weights, got_idx = amp(x)
    assert got_weights.dtype == ms.float32
    np.testing.assert_array_equal(numpy(got_weights), weights)
    np.testing.assert_array_equal(numpy(got_idx), idx)
    np.testing.assert_array_equal(router.load(), np.bincount(idx.ravel(), minlength=8) * 2)


# O3 lowers as O2 does (to_float on the net); float16 and bfloat16 take the same casts
@pytest.mark.parametrize("level,amp_dtype", [("O1", "bfloat16"), ("O2", "float16"),
                                             ("O2", "bfloat16"), ("to_float", "bfloat16")])
@pytest.mark.slow_in_graph
def test_moe_net_forward_and_gradients(level, amp_dtype, mode, rng):
    _needs_kernels_for_bfloat16(amp_dtype, mode)
    dtype = AMP_DTYPES[amp_dtype]
    lowered = level != "O1"
    # inputs the AMP dtype represents exactly, so that only the computation's dtype differs
    x = rounded(rng.normal(0, 1, (9, 8)), amp_dtype).astype(np.float32)
    cot = Tensor(rng.normal(0, 1, (9, 8)).astype(np.float32))
    _set_mode(mode)  # (PyNative and GRAPH sum some float32 gradients in different orders)
    plain = _with_weights(_TwoLayers())
    # the evidence: the plain net on inputs in the dtype its experts should compute in
    x_evidence = tensor(x, amp_dtype if lowered else "float32")
    expected, expected_grads = _forward_and_grads(plain, x_evidence, cot)

    net = _with_weights(_TwoLayers())
    ms_moe_ops.reset_expert_load(net)
    amp = _amp(net, level, dtype)
    out, got_grads = _forward_and_grads(amp, tensor(x), cot)
    assert out.dtype == (dtype if level == "to_float" else ms.float32)
    np.testing.assert_array_equal(numpy(out), numpy(expected))
    np.testing.assert_array_equal(ms_moe_ops.expert_load(amp), ms_moe_ops.expert_load(plain))
    assert set(got_grads) == set(expected_grads)
    for name, g in expected_grads.items():
        if name.endswith("router.weight") and mode == "pynative":
            # in PyNative mode its last bit followed the tests run before (the same before the
            # token dispatcher; the sum order of x's and the logits' consumers is not the cause):
            # within a last bit
            np.testing.assert_allclose(got_grads[name], g, rtol=2.0 ** -22,
                                       atol=2.0 ** -22 * np.abs(g).max(), err_msg=name)
        else:
            np.testing.assert_array_equal(got_grads[name], g, err_msg=name)


@pytest.mark.parametrize("amp_dtype", list(AMP_DTYPES))
@pytest.mark.parametrize("level", ["O2", "to_float"])
@pytest.mark.slow_in_graph
def test_moe_ffn_computes_in_the_amp_dtype(level, amp_dtype, mode, rng):
    ffn = _with_weights(MoeFFN(4, 8, 5, activation="swiglu", has_bias=True))
    x = rounded(rng.normal(0, 1, (7, 8)), amp_dtype).astype(np.float32)
    tokens = Tensor(np.array([2, 0, 4, 1], np.int64))
    # (a lowered GRAPH-mode net casts its own inputs, row_weight too: values it holds exactly)
    row_weight = Tensor(rounded(rng.uniform(0.1, 1, 7), amp_dtype).astype(np.float32))
    expected = numpy(ffn(tensor(x, amp_dtype), tokens, row_weight))
    amp = _amp(_Holder(ffn), level, AMP_DTYPES[amp_dtype])
    _set_mode(mode)
    np.testing.assert_array_equal(numpy(amp(tensor(x), tokens, row_weight)), expected)


@pytest.mark.parametrize("amp_dtype", list(AMP_DTYPES))
@pytest.mark.slow_in_graph
def test_training_steps(amp_dtype, mode, rng):
    _needs_kernels_for_bfloat16(amp_dtype, mode)
    net = ms.amp.auto_mixed_precision(_with_weights(_TwoLayers()), "O2", AMP_DTYPES[amp_dtype])
    x = tensor(rng.normal(0, 1, (16, 8)).astype(np.float32))
    target = tensor(rng.normal(0, 0.1, (16, 8)).astype(np.float32))
    _set_mode(mode)
    step = nn.TrainOneStepCell(nn.WithLossCell(net, nn.MSELoss()),
                               nn.Adam(net.trainable_params(), 0.01))
    losses = [float(numpy(step(x, target))) for _ in range(4)]
    assert np.isfinite(losses).all() and losses[-1] < losses[0], losses


@pytest.mark.slow_in_graph
def test_o1_keeps_the_cells_and_honours_their_own_dtype(mode, rng):
    x = rounded(rng.normal(0, 1, (6, 8)), "bfloat16").astype(np.float32)
    plain = _with_weights(_TwoLayers())
    plain.first.to_float(ms.bfloat16)
    expected = numpy(plain(tensor(x)))
    net = _with_weights(_TwoLayers())
    net.first.to_float(ms.bfloat16)  # this block in bfloat16, whatever O1 does
    amp = ms.amp.auto_mixed_precision(net, "O1", ms.bfloat16)
    _set_mode(mode)
    np.testing.assert_array_equal(numpy(amp(tensor(x))), expected)
    # the blocks are still this package's Cells: the load-balance helpers find them
    assert len(ms_moe_ops.moe_layers(amp)) == 2
    assert ms_moe_ops.update_expert_bias(amp).sum() == 2 * 6 * 2


@pytest.mark.parametrize("param_dtype", ["float16", "bfloat16"])
@pytest.mark.slow_in_graph
def test_half_precision_parameters(param_dtype, mode, rng):
    layer = _with_weights(MoELayer(8, 6, 4, 2, n_shared_experts=1))
    reference = _with_weights(MoELayer(8, 6, 4, 2, n_shared_experts=1))
    for p, q in zip(layer.trainable_params(), reference.trainable_params()):
        p.set_dtype(AMP_DTYPES[param_dtype])
        q.set_data(Tensor(rounded(q.asnumpy(), param_dtype).astype(np.float32)))
    x = tensor(rng.normal(0, 1, (6, 8)).astype(np.float32))
    cot = Tensor(rng.normal(0, 1, (6, 8)).astype(np.float32))
    _set_mode(mode)
    # the experts compute in x's dtype: the weights are only stored in half precision
    out, grads = _forward_and_grads(layer, x, cot)
    expected_out, expected = _forward_and_grads(reference, x, cot)
    np.testing.assert_array_equal(numpy(out), numpy(expected_out))
    for name, g in grads.items():
        np.testing.assert_array_equal(g, rounded(expected[name], param_dtype), err_msg=name)


def test_half_precision_router_state_is_refused(mode):
    layer = MoELayer(8, 6, 4, 2)
    layer.router.tokens_per_expert.set_dtype(ms.float16)
    _set_mode(mode)
    with pytest.raises(TypeError, match=r"'tokens_per_expert', 'aux_losses'\) must stay float32"):
        layer(tensor(np.zeros((3, 8), np.float32)))


@pytest.mark.parametrize("amp_dtype", list(AMP_DTYPES))
def test_rotary_embedding_stays_float32_in_a_half_precision_model(amp_dtype, mode):
    """O2/O3 cast every float input inside a Cell: the rotary positions and angles would be
    half precision too, off by whole radians past a few hundred positions (and the CPU has no
    half-precision cos). The model's RotaryEmbedding keeps them float32."""
    pytest.importorskip("transformers")
    from hf_models import hf_config
    from ms_moe_ops.models import CausalLMConfig, MoECausalLM

    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    net = MoECausalLM(CausalLMConfig.from_transformers(hf_config("qwen3_moe", layers=1)))
    rotary = net.model.rotary_emb
    positions = Tensor(np.array([1, 300, 1001, 4000], np.int32))
    expected = [t.asnumpy() for t in rotary(positions)]
    ms.amp.auto_mixed_precision(net, "O2", AMP_DTYPES[amp_dtype])
    for got, want in zip(rotary(positions), expected):
        assert got.dtype == ms.float32
        np.testing.assert_array_equal(got.asnumpy(), want)
