"""Expert capacity (MoEConfig capacity_factor, drop_policy, pad_to_capacity).

Evidence: an independent numpy model of Megatron-Core's token dropping written from its
documentation (tests/megatron_capacity.py) for top-1/2/3, both policies, padded or not, in both
modes; transformers' SwitchTransformersSparseMLP for top-1 with "position"; finite differences
of the numpy model for the gradients; the compiled graph of a padded training step (no dimension
known only at run time); the dropped fraction counted by hand."""
import numpy as np
import pytest
import mindspore as ms
from mindspore import Tensor, nn, ops

import megatron_capacity as megatron
from cases import ForwardBackward
from ascend_ir import dynamic_dimensions, read_ir, saving_ir
from conftest import RTOL, FnCell, assert_close, finite_diff, numpy, run, tensor
from ms_moe_ops import (MoEConfig, MoELayer, dropped_fraction, expert_load, load_imbalance,
                        reference as ref, reset_expert_load, update_expert_bias)
from ms_moe_ops.nn.capacity import expert_capacity, padded_rows

H = 8
CASES = {
    # Switch-like: top-1 softmax, the weight is the probability itself
    "top-1 softmax relu": dict(ffn_hidden_size=6, num_experts=4, top_k=1, score_func="softmax",
                               norm_topk_prob=False, activation="relu", capacity_factor=0.5),
    # DeepSeek-V3 like, biases; half the tokens are copies of one (equal weights: ties)
    "top-2 sigmoid biases ties": dict(ffn_hidden_size=6, num_experts=4, top_k=2, has_bias=True,
                                      capacity_factor=0.75, ties=True),
    "top-3 softmax groups fastgelu": dict(ffn_hidden_size=5, num_experts=8, top_k=3,
                                          score_func="softmax", norm_topk_prob=False, n_group=4,
                                          topk_group=2, group_select_mode=0,
                                          activation="fastgelu", capacity_factor=1.0),
}
TOKENS = 12


def _layer(options, seed=0, **changes):
    options = {k: v for k, v in dict(options, **changes).items() if k != "ties"}
    layer = MoELayer(H, **options)
    rng = np.random.default_rng(seed)
    weights = {}
    for name, p in layer.parameters_and_names():
        if not p.requires_grad:
            continue
        value = rng.normal(0, 0.8 if name.startswith("router") else 0.4, p.shape).astype(np.float32)
        p.set_data(Tensor(value))
        weights[name] = value.astype(np.float64)
    return layer, weights


def _tokens(options, seed=1, tokens=TOKENS):
    x = np.random.default_rng(seed).normal(0, 1, (tokens, H)).astype(np.float32)
    if options.get("ties"):
        x[::2] = x[0]  # every other token the same: equal weights, the earlier token wins
    return x.astype(np.float64)


def _routing(options, w, x):
    """(weights [T, K], expert_idx [T, K]) of the package's numpy router."""
    c = MoEConfig(H, **{k: v for k, v in options.items() if k != "ties"})
    weights, idx, _ = ref.moe_gating_top_k(
        x @ w["router.weight"].T, c.top_k, k_group=c.topk_group, group_count=c.n_group,
        group_select_mode=c.group_select_mode if c.n_group > 1 else 0,
        renorm=int(c.norm_topk_prob), norm_type=1 if c.score_func == "sigmoid" else 0,
        routed_scaling_factor=c.routed_scaling_factor)
    return weights, idx


def _expert(options, w):
    activation = options.get("activation", "swiglu")

    def run_expert(e, rows):
        h = rows @ w["experts.weight1"][e] + w.get("experts.bias1", np.zeros((e + 1, 1)))[e]
        a = ref.swiglu_group(h) if activation == "swiglu" else ref.ffn_activation(activation, h)
        return a @ w["experts.weight2"][e] + w.get("experts.bias2", np.zeros((e + 1, 1)))[e]

    return run_expert


def _model(options, w, x, policy):
    """Megatron-Core's output and kept pairs (numpy)."""
    probs, idx = _routing(options, w, x)
    keep = megatron.keep_mask(probs, idx, options["num_experts"], options["capacity_factor"],
                              policy)
    return megatron.moe_output(x, probs, idx, keep, _expert(options, w)), keep


def test_capacity_is_megatrons_formula():
    # ceil(T * K / E * factor); an exact product stays (16 / 4 * 0.75 is 3, not 4)
    assert expert_capacity(16, 1, 4, 0.75) == 3 == megatron.capacity(16, 1, 4, 0.75)
    assert expert_capacity(10, 2, 4, 1.25) == 7  # 6.25 -> 7
    assert expert_capacity(12, 3, 8, 1.0) == 5  # 4.5 -> 5
    assert expert_capacity(7, 2, 4, 0.01) == 1
    # padded rows: the capacity, but never more than the tokens (an expert takes a token once)
    assert padded_rows(12, 2, 4, 0.75) == 5 and padded_rows(6, 2, 4, 4.0) == 6


# GRAPH mode in the default run: test_padded_step_in_graph_mode
RUNS = [pytest.param(case, policy, pad, mode, id=f"{mode}-{case}-{policy}-{'padded' if pad else 'dropped'}",
                     marks=() if mode == "pynative" else pytest.mark.slow)
        for case in CASES for policy in ("probs", "position") for pad in (False, True)
        for mode in ("pynative", "graph")]


@pytest.mark.parametrize("case,policy,pad,mode", RUNS)
def test_layer_is_megatrons_token_dropping(case, policy, pad, mode):
    options = CASES[case]
    layer, w = _layer(options, drop_policy=policy, pad_to_capacity=pad)
    x = _tokens(options)
    expected, keep = _model(options, w, x, policy)
    other, other_keep = _model(options, w, x, "position" if policy == "probs" else "probs")
    assert 0 < (~keep).sum() < keep.size, "the case drops some pairs, not all"
    assert (keep != other_keep).any() and np.abs(expected - other).max() > 1e-3, \
        "the two policies differ here"
    got = numpy(run(layer, Tensor(x.astype(np.float32)), mode=mode))
    assert_close(got, expected, rtol=1e-5, atol=1e-5)
    # a token whose every pair was dropped gives zeros (no shared experts here)
    for t in np.nonzero(~keep.any(axis=1))[0]:
        assert not got[t].any()
    assert dropped_fraction(layer) == [pytest.approx((~keep).sum() / keep.size)]


def test_the_drop_changes_the_output_and_nothing_else():
    """The same weights without a capacity: the tokens that kept every pair are unchanged."""
    options = CASES["top-3 softmax groups fastgelu"]
    capped, w = _layer(options)
    dropless, _ = _layer(options, capacity_factor=None)
    x = _tokens(options)
    _, keep = _model(options, w, x, "probs")
    a, b = (layer(Tensor(x.astype(np.float32))).asnumpy() for layer in (capped, dropless))
    whole = keep.all(axis=1)
    assert whole.any() and not whole.all()
    np.testing.assert_array_equal(a[whole], b[whole])
    assert (np.abs(a - b).max(axis=1)[~whole] > 1e-4).all()


@pytest.mark.parametrize("policy,pad,mode", [
    ("probs", False, "pynative"), ("position", True, "pynative"),
    pytest.param("probs", True, "graph", marks=pytest.mark.slow),
    pytest.param("position", False, "graph", marks=pytest.mark.slow)])
def test_gradients_are_finite_differences(policy, pad, mode):
    """d/d(x, router weight, expert weights) of sum(out * cot): the numpy model's central
    differences (its routing and dropping recomputed at every point; the case is far from ties,
    so no choice flips)."""
    options = dict(CASES["top-2 sigmoid biases ties"], ties=False)
    layer, w = _layer(options, drop_policy=policy, pad_to_capacity=pad)
    x = _tokens(options)
    cot = np.random.default_rng(2).normal(0, 1, x.shape)
    assert 0 < (~_model(options, w, x, policy)[1]).sum()
    params = layer.trainable_params()
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        _, dx, dw = ForwardBackward(layer)(Tensor(x.astype(np.float32)),
                                           Tensor(cot.astype(np.float32)))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)

    def objective(name):
        def f(value):
            if name == "x":
                return float((_model(options, w, value, policy)[0] * cot).sum())
            return float((_model(options, dict(w, **{name: value}), x, policy)[0] * cot).sum())
        return f

    assert_close(numpy(dx), finite_diff(objective("x"), x), rtol=1e-4, atol=1e-5)
    grads = {p.name.split("layer.", 1)[-1]: numpy(g) for p, g in zip(params, dw)}
    for name in ("router.weight", "experts.weight1", "experts.bias2"):
        assert_close(grads[name], finite_diff(objective(name), w[name]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision(dtype):
    """The same pairs dropped (the router computes in float32 whatever the input), the output
    within the rounding of the dtype's experts."""
    options = CASES["top-2 sigmoid biases ties"]
    layer, w = _layer(options, pad_to_capacity=True)
    x = ref_x = _tokens(options)
    x = numpy(tensor(x.astype(np.float32), dtype)).astype(np.float64)
    expected, keep = _model(options, w, x, "probs")
    assert not keep.all()
    got = numpy(layer(tensor(x.astype(np.float32), dtype)))
    assert layer(tensor(x.astype(np.float32), dtype)).dtype == getattr(ms, dtype)
    assert_close(got, expected, rtol=8 * RTOL[dtype], atol=8 * RTOL[dtype] * np.abs(expected).max())
    assert ref_x is not None


_EDGE_DEFAULT = {("no tokens", True), ("empty sequences", False), ("one token", True)}


@pytest.mark.parametrize("shape,pad", [
    pytest.param(shape, pad, id=f"{name}-{'padded' if pad else 'dropped'}",
                 marks=() if (name, pad) in _EDGE_DEFAULT else pytest.mark.slow)
    for name, shape in (("no tokens", (0, H)), ("empty sequences", (2, 0, H)),
                        ("one token", (1, H)))
    for pad in (False, True)])
def test_edge_sizes(shape, pad):
    """No tokens: an empty output and zero gradients; one token: a capacity of at least one,
    nothing dropped (as Megatron: ceil of a positive number)."""
    options = CASES["top-2 sigmoid biases ties"]
    layer, w = _layer(options, pad_to_capacity=pad)
    x = np.random.default_rng(4).normal(0, 1, shape)
    got = numpy(layer(Tensor(x.astype(np.float32))))
    assert got.shape == shape
    if x.size:
        expected, keep = _model(options, w, x.reshape(-1, H), "probs")
        assert keep.all()
        assert_close(got.reshape(-1, H), expected, rtol=1e-5, atol=1e-5)
    _, dx, _ = ForwardBackward(layer)(Tensor(x.astype(np.float32)), Tensor(np.ones(shape, np.float32)))
    assert dx.shape == shape
    assert dropped_fraction(layer) == [0.0]


# -- transformers' Switch MoE ---------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["pynative", pytest.param("graph", marks=pytest.mark.slow)])
def test_top1_position_is_switch_transformers(mode):
    """SwitchTransformersSparseMLP (router jitter off) with expert_capacity C, and MoELayer with
    top-1, softmax, the probability as weight, relu experts and capacity_factor C*E/S on each
    sequence: the same output on every token the capacity kept. Switch counts the capacity per
    sequence, so the layer takes one sequence per call. A dropped token gives 0 in both (Switch in
    transformers 5.x; 4.x passed it through times its router probability), where Megatron-Core
    gives 0 too."""
    torch = pytest.importorskip("torch")
    switch = pytest.importorskip("transformers.models.switch_transformers.modeling_switch_transformers")
    from transformers import SwitchTransformersConfig

    batch, seq, experts, ffn, cap = 2, 16, 4, 6, 3
    config = SwitchTransformersConfig(d_model=H, d_ff=ffn, num_experts=experts, expert_capacity=cap,
                                      router_jitter_noise=0.0, dense_act_fn="relu",
                                      router_bias=False, router_dtype="float32")
    torch.manual_seed(0)
    block = switch.SwitchTransformersSparseMLP(config).eval()
    with torch.no_grad():
        block.router.classifier.weight.normal_(0, 1.0)
    layer = MoELayer(H, ffn, experts, 1, score_func="softmax", norm_topk_prob=False,
                     activation="relu", capacity_factor=cap * experts / seq,
                     drop_policy="position")
    assert layer.capacity.capacity(seq) == cap
    layer.router.weight.set_data(Tensor(block.router.classifier.weight.detach().numpy()))
    layer.experts.weight1.set_data(Tensor(np.stack(
        [block.experts[f"expert_{e}"].wi.weight.detach().numpy().T for e in range(experts)])))
    layer.experts.weight2.set_data(Tensor(np.stack(
        [block.experts[f"expert_{e}"].wo.weight.detach().numpy().T for e in range(experts)])))
    x = np.random.default_rng(3).normal(0, 1, (batch, seq, H)).astype(np.float32)
    with torch.no_grad():
        expected = block(torch.from_numpy(x)).numpy()
        mask, probs, _ = block.router(torch.from_numpy(x))
    kept = mask.numpy().sum(-1) > 0
    got = np.stack([numpy(run(layer, Tensor(x[b]), mode=mode)) for b in range(batch)])
    assert 0 < (~kept).sum() < kept.size
    assert_close(got[kept], expected[kept], rtol=1e-5, atol=1e-6)
    # the dropped tokens: zero here; Switch 5.x as well (4.x: probability * token)
    assert not got[~kept].any()
    np.testing.assert_array_equal(expected[~kept], 0)
    passed_through = probs.numpy()[~kept] * x[~kept]
    assert np.abs(passed_through).max() > 0.1  # what transformers 4.x gave instead


# -- what the layer reports -------------------------------------------------------------------------

def test_dropped_fraction_beside_load_imbalance():
    options = CASES["top-2 sigmoid biases ties"]
    layer, w = _layer(options)
    dropless, _ = _layer(options, capacity_factor=None)
    model = nn.SequentialCell([layer, dropless])
    assert dropped_fraction(model) == [0.0, 0.0]
    x = _tokens(options)
    _, keep = _model(options, w, x, "probs")
    _, idx = _routing(options, w, x)
    layer(Tensor(x.astype(np.float32)))
    fraction = (~keep).sum() / keep.size
    assert dropped_fraction(layer) == [pytest.approx(fraction)]
    # the load counts the router's choice, before the capacity
    np.testing.assert_array_equal(expert_load(layer)[0], np.bincount(idx.reshape(-1), minlength=4))
    np.testing.assert_array_equal(layer.capacity.load()[1],
                                  np.bincount(idx[~keep], minlength=4))
    layer(Tensor(x[:6].astype(np.float32)))  # a second call adds up
    _, keep6 = _model(options, w, x[:6], "probs")
    both = ((~keep).sum() + (~keep6).sum()) / (keep.size + keep6.size)
    assert dropped_fraction(layer) == [pytest.approx(both)]
    update_expert_bias(layer)  # the window that drove the update, as load_imbalance
    assert dropped_fraction(layer) == [pytest.approx(both)] and load_imbalance(layer)[0] > 1
    layer(Tensor(x[:6].astype(np.float32)))
    assert dropped_fraction(layer) == [pytest.approx((~keep6).sum() / keep6.size)]
    reset_expert_load(layer)
    assert dropped_fraction(layer) == [0.0]


# -- static shapes ------------------------------------------------------------------------------------

def test_padded_step_in_graph_mode(tmp_path):
    """GRAPH mode, pad_to_capacity: the output is Megatron's, the gradients the finite
    differences of its model, and every tensor of the forward and backward (the gradients of the
    input and of every parameter) has a shape known at compile time: the compiled IR shows no
    dimension of -1 and no rank of -2."""
    options = dict(CASES["top-2 sigmoid biases ties"], ties=False)
    layer, w = _layer(options, pad_to_capacity=True)
    x = _tokens(options, tokens=10)
    cot = np.random.default_rng(2).normal(0, 1, x.shape)
    expected, keep = _model(options, w, x, "probs")
    assert not keep.all()
    with saving_ir(tmp_path):
        out, dx, dw = ForwardBackward(layer)(Tensor(x.astype(np.float32)),
                                             Tensor(cot.astype(np.float32)))
    assert_close(numpy(out), expected, rtol=1e-5, atol=1e-5)
    assert_close(numpy(dx), finite_diff(
        lambda v: float((_model(options, w, v, "probs")[0] * cot).sum()), x), rtol=1e-4, atol=1e-5)
    router = dw[[p.name.endswith("router.weight") for p in layer.trainable_params()].index(True)]
    assert_close(numpy(router), finite_diff(lambda v: float((_model(
        options, dict(w, **{"router.weight": v}), x, "probs")[0] * cot).sum()),
        w["router.weight"]), rtol=1e-4, atol=1e-5)
    graph, path = read_ir(tmp_path)
    with open(path) as f:
        dynamic = dynamic_dimensions(f.read())
    assert not dynamic, "dimensions known only at run time:\n" + "\n".join(dynamic[:20])
    # the whole of it: the capacity's sort, the experts and the combine, forward and backward
    assert {"Sort", "grouped_matmul", "swiglu_group_quant_grad", "moe_token_unpermute_backward",
            "moe_gating_top_k_grad"} <= {n.prim for n in graph}


def test_the_static_shape_check_sees_a_dynamic_dimension(tmp_path):
    """The check above fails on a graph with a dimension known only at run time (the padded
    layer on a batch whose token count is known only at run time)."""
    cell = FnCell(_rows_of_capacity)
    with saving_ir(tmp_path):
        cell.set_inputs(Tensor(shape=[None, H], dtype=ms.float32))
        cell(Tensor(np.zeros((5, H), np.float32)))
    _, path = read_ir(tmp_path)
    with open(path) as f:
        assert dynamic_dimensions(f.read())


def _rows_of_capacity(x):
    return ops.zeros((padded_rows(x.shape[0], 2, 4, 1.0), 3), ms.float32) + x.sum()


# -- bad options ------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,error,message", [
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be a finite number > 0"),
    (dict(capacity_factor=-1), ValueError, "capacity_factor must be a finite number > 0"),
    (dict(capacity_factor=float("nan")), ValueError, "capacity_factor must be a finite number"),
    (dict(capacity_factor="1.0"), TypeError, "capacity_factor must be None .* got str"),
    (dict(capacity_factor=True), TypeError, "capacity_factor must be None .* got bool"),
    (dict(capacity_factor=1.0, drop_policy="random"), ValueError, "drop_policy must be one of"),
    (dict(drop_policy=None), ValueError, "drop_policy must be one of"),
    (dict(capacity_factor=1.0, pad_to_capacity=1), TypeError, "pad_to_capacity must be True or"),
    (dict(pad_to_capacity=True), ValueError, "pad_to_capacity=True .* needs a capacity_factor"),
])
def test_bad_options(options, error, message):
    with pytest.raises(error, match=f"MoELayer: {message}"):
        MoELayer(H, 6, 4, 2, **options)
