"""Test cases shared by several test modules (and the expert-parallel workers): MoELayers with
their weights, inputs and gradients, the expert-parallel case, and one case or more of every
operator with its golden outputs (CASES). Test modules import from here, never from each other."""
import numpy as np
import mindspore as ms
from mindspore import ParameterTuple, Tensor, nn, ops

from ms_moe_ops import (MoELayer, dropped_fraction, moe_ffn, reference as ref, reset_expert_load,
                        update_expert_bias)
from ms_moe_ops.ops import ffn, gating, permute, swiglu
from ms_moe_ops.ops.cast import CAST
from ms_moe_ops.ops.dequantize import DEQUANTIZE
from ms_moe_ops.ops.grouped_matmul import GROUPED_MATMUL
from ms_moe_ops.ops.rms_norm import ADD_RMS_NORM, RMS_NORM
from ms_moe_ops.ops.decode_attention import DECODE_ATTENTION
from ms_moe_ops.ops.weight_quant_grouped_matmul import WEIGHT_QUANT_GROUPED_MATMUL
from conftest import assert_close, numpy, rounded, run, tensor


# -- a MoELayer, its numpy reference and its gradients ---------------------------------------------

def make_layer(h=8, f=6, e=4, k=2, seed=0, shared=0, **kw):
    """A MoELayer with random weights large enough that routing choices are far from ties."""
    layer = MoELayer(h, f, e, k, n_shared_experts=shared, **kw)
    rng = np.random.default_rng(seed)
    for p in layer.trainable_params():
        scale = 0.6 if "router" in p.name else 0.4
        p.set_data(Tensor(rng.normal(0, scale, p.shape).astype(np.float32)))
    return layer


def params(layer):
    """The reference's keyword arguments from the layer's parameters (float64)."""
    p = {name.split(".", 1)[-1] if name.startswith("layer.") else name: v.asnumpy().astype(np.float64)
         for name, v in layer.parameters_and_names()}
    out = dict(router_weight=p["router.weight"], expert_bias=p["router.expert_bias"].astype(np.float32),
               weight1=p["experts.weight1"], weight2=p["experts.weight2"])
    for name in ("bias1", "bias2"):
        if "experts." + name in p:
            out[name] = p["experts." + name]
    if "shared_experts.weight1" in p:
        out.update(shared_weight1=p["shared_experts.weight1"], shared_weight2=p["shared_experts.weight2"])
    if "shared_experts.gate" in p:
        out.update(shared_gate=p["shared_experts.gate"])
    return out


def config(layer):
    """The reference's options from the layer's."""
    r = layer.router
    return dict(top_k=layer.top_k, n_group=r.n_group, topk_group=r.topk_group,
                group_select_mode=r.group_select_mode,
                routed_scaling_factor=r.routed_scaling_factor,
                score_func=r.score_func, norm_topk_prob=r.norm_topk_prob,
                activation=layer.experts.activation, clamp_limit=layer.experts.clamp_limit)


def reference(layer, x, **overrides):
    """(out, expert_idx) of the numpy reference at the layer's weights and options."""
    return ref.moe_layer(x, **{**params(layer), **config(layer), **overrides})


def rounded_experts(layer, dtype):
    """The expert weights as the layer uses them in dtype (rounded), as reference overrides."""
    p = params(layer)
    return {k: rounded(v, dtype) for k, v in p.items() if k not in ("router_weight", "expert_bias")}


def inputs(shape, seed=1, dtype="float32"):
    return rounded(np.random.default_rng(seed).normal(0, 1, shape), dtype)


class _Objective(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, cotangent):
        return (self.layer(x).astype(ms.float32) * cotangent).sum()


def layer_grads(layer, x, cotangent, mode, dtype="float32"):
    """(d/dx, {parameter name: d/dparam}) of sum(layer(x) * cotangent)."""
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)
    try:
        weights = layer.trainable_params()
        fn = ms.grad(_Objective(layer), grad_position=0, weights=weights)
        gx, gw = fn(tensor(x, dtype), Tensor(cotangent.astype(np.float32)))
    finally:
        ms.set_context(mode=ms.PYNATIVE_MODE)
    names = [p.name.split("layer.", 1)[-1] for p in weights]
    return numpy(gx), {n: numpy(g) for n, g in zip(names, gw)}


# -- the int8 path of moe_ffn (test_ffn_int8.py, test_determinism.py) --------------------------------

INT8_FFN_INPUTS = ("x", "tokens", "w1", "w2", "b1", "b2", "scale", "offset", "dq1", "dq2")


def int8_ffn_case(rng, counts=(5, 0, 9, 4), h=13, f=70, bias=True, deq="uint64"):
    """Random int8 data with scales that put the requantised activation over most of int8
    (saturating a little); shapes not multiples of the kernel's tiles."""
    e, m = len(counts), int(sum(counts))
    i8 = lambda *s: rng.integers(-128, 128, s).astype(np.int8)
    v = dict(x=i8(m, h), tokens=np.array(counts, np.int64), w1=i8(e, h, f), w2=i8(e, f, h),
             b1=rng.integers(-20000, 20000, (e, f)).astype(np.int32) if bias else None,
             b2=rng.integers(-20000, 20000, (e, h)).astype(np.int32) if bias else None,
             scale=rng.uniform(100, 200, e).astype(np.float32),
             offset=np.float32([-150] + list(rng.uniform(-40, 40, e - 1))),
             dq1=(rng.uniform(0.5, 2, (e, f)) / (128 * 128 * np.sqrt(h))).astype(np.float32),
             dq2=(rng.uniform(0.5, 2, (e, h)) / (128 * 128 * np.sqrt(f))).astype(np.float32))
    if deq == "uint64":
        v["dq1"], v["dq2"] = ref.float_to_deq_scale(v["dq1"]), ref.float_to_deq_scale(v["dq2"])
    return v


def int8_ffn(v, mode="pynative", **kw):
    def fn(x, tokens, w1, w2, b1, b2, scale, offset, dq1, dq2):
        return moe_ffn(x, tokens, w1, w2, b1, b2, scale, offset, dq1, dq2, **kw)

    return run(fn, *(None if v[n] is None else Tensor(v[n]) for n in INT8_FFN_INPUTS), mode=mode)


def as_f32(y):
    return numpy(y).astype(np.float32)


def assert_int8_matches(y, expected, v, activation):
    """Bit for bit; with an exp-based activation the kernel's float32 exp may differ from the
    golden model's float64 one in the last bit and flip a rounding (about one value in 30000):
    allow a rare one-step difference in a requantised value (|w2| * deq_scale2 per output)."""
    y, expected = as_f32(y), np.asarray(expected, np.float32)
    assert y.shape == expected.shape
    if activation == "relu":
        np.testing.assert_array_equal(y, expected)
        return
    rows = (y != expected).any(axis=1)  # one flipped value changes its whole output row
    assert rows.sum() <= max(1, 0.02 * len(rows)), f"{rows.sum()} of {len(rows)} rows differ"
    step = 128 * ref._deq_scale_values(v["dq2"]).max() * 2
    assert np.abs(y - expected).max(initial=0) <= step


# -- the expert-parallel case -------------------------------------------------------------------
# Run by both sides of tests/test_parallel_distributed.py: the msrun workers (tests/ep_worker.py,
# one rank each) and the single process that holds every expert and takes the tokens of all ranks.

RANKS = 2
EP_TOKENS = 6  # per rank
EP_HIDDEN = 8
EP_CONFIGS = {
    # DeepSeek-V3 like, with Qwen2-MoE's gated shared expert
    "swiglu": dict(ffn_hidden_size=6, num_experts=4, top_k=2, n_shared_experts=1,
                   shared_expert_gate=True),
    # DeepSeek-V2 like router: softmax, weights not renormalised
    "fastgelu": dict(ffn_hidden_size=5, num_experts=6, top_k=3, activation="fastgelu",
                     score_func="softmax", norm_topk_prob=False),
}
# (configuration, mode, train too): forward-backward everywhere, the 5 training steps once per
# mode (each launch costs, so not every combination)
EP_RUNS = (("swiglu", "pynative", False), ("swiglu", "graph", True), ("fastgelu", "pynative", True))
STEPS = 5
LEARNING_RATE = 0.2
BIAS_UPDATE_RATE = 0.05


def set_mode(mode):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)


def ep_layer(config_name, expert_parallel=None):
    return MoELayer(EP_HIDDEN, **EP_CONFIGS[config_name], bias_update_rate=BIAS_UPDATE_RATE,
                    expert_parallel=expert_parallel)


def ep_weights(config_name, seed=0):
    """{name: numpy} for a single-process layer: random weights large enough that routing
    choices are far from ties, zero expert_bias and counts."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in ep_layer(config_name).parameters_and_names():
        scale = 0.6 if "router" in name else 0.4
        out[name] = (rng.normal(0, scale, p.shape) if p.requires_grad
                     else p.asnumpy()).astype(np.float32)  # state as built: zeros, a scale of 1
    return out


def load_weights(layer, weights):
    for name, p in layer.parameters_and_names():
        p.set_data(Tensor(np.asarray(weights[name], np.float32)))


def weights_of(layer):
    return {name: p.asnumpy().copy() for name, p in layer.parameters_and_names()}


def ep_tokens(seed=1):
    """(x, cotangent, target) of all ranks, [RANKS * EP_TOKENS, EP_HIDDEN] float32 each; rank r
    has rows [r * EP_TOKENS, (r + 1) * EP_TOKENS)."""
    rng = np.random.default_rng(seed)
    shape = (RANKS * EP_TOKENS, EP_HIDDEN)
    return tuple(rng.normal(0, 1, shape).astype(np.float32) for _ in range(3))


class ForwardBackward(nn.Cell):
    """(layer(x), d/dx, d/d(trainable parameters)) of sum(layer(x) * cotangent)."""

    def __init__(self, layer):
        super().__init__()
        self.objective = _Objective(layer)
        self.weights = ParameterTuple(layer.trainable_params())
        self.grad = ops.GradOperation(get_all=True, get_by_list=True)

    def construct(self, x, cotangent):
        out = self.objective.layer(x)
        (dx, _), dweights = self.grad(self.objective, self.weights)(x, cotangent)
        return out, dx, dweights


def forward_backward(layer, x, cotangent):
    """{"out", "dx", "grad/<name>", "expert_bias"} after one forward-backward and a bias update
    driven by its counts."""
    reset_expert_load(layer)
    out, dx, dweights = ForwardBackward(layer)(Tensor(x), Tensor(cotangent))
    update_expert_bias(layer)
    result = {"out": out.asnumpy(), "dx": dx.asnumpy(),
              "expert_bias": layer.router.expert_bias.asnumpy().copy()}
    for p, g in zip(layer.trainable_params(), dweights):
        result["grad/" + p.name] = g.asnumpy()
    return result


def train(layer, x, target, train_step):
    """STEPS steps of SGD on the mean squared error, with a bias update after each:
    {"loss": [STEPS], "weights/<name>"...}. train_step(network, optimizer) builds the step."""
    reset_expert_load(layer)
    optimizer = nn.SGD(layer.trainable_params(), learning_rate=LEARNING_RATE)
    step = train_step(nn.WithLossCell(layer, nn.MSELoss()), optimizer)
    losses = []
    for _ in range(STEPS):
        losses.append(float(step(Tensor(x), Tensor(target)).asnumpy()))
        update_expert_bias(layer)
    result = {"loss": np.array(losses)}
    result.update({"weights/" + k: v for k, v in weights_of(layer).items()})
    return result


# -- expert parallelism inside data parallelism ---------------------------------------------------
# 4 ranks = 2 expert-parallel groups ({0, 1}, {2, 3}) x 2 data-parallel replicas ({0, 2}, {1, 3}):
# tests/ep_dp_worker.py on each rank (tests/test_parallel_dp.py launches it, once on 4 workers and
# once as two "nodes" of 2), against one process taking the global batch.

DP_RANKS = 4
DP_EP_SIZE = 2
DP_TOKENS = 4  # per rank
DP_CONFIGS = {
    "dropless": dict(ffn_hidden_size=6, num_experts=4, top_k=2, n_shared_experts=1),
    # capacity 2 of each rank's 8 (token, slot) pairs per expert: drops, static shapes
    "capacity": dict(ffn_hidden_size=6, num_experts=4, top_k=2, capacity_factor=1.0,
                     pad_to_capacity=True),
}
DP_RUNS = (("dropless", "graph"), ("capacity", "graph"), ("dropless", "pynative"),
           ("capacity", "pynative"))
DP_STEPS = 3


def dp_layer(config_name, expert_parallel=None):
    return MoELayer(EP_HIDDEN, **DP_CONFIGS[config_name], bias_update_rate=BIAS_UPDATE_RATE,
                    expert_parallel=expert_parallel)


def dp_weights(config_name):
    """{name: numpy} of the single-process layer (routers far from ties, zero state)."""
    rng = np.random.default_rng(4)
    return {name: (rng.normal(0, 0.6 if "router" in name else 0.4, p.shape) if p.requires_grad
                   else p.asnumpy()).astype(np.float32)
            for name, p in dp_layer(config_name).parameters_and_names()}


def dp_batches():
    """[(x, target)] per step, [DP_RANKS * DP_TOKENS, EP_HIDDEN] float32 each: rank r has rows
    [r * DP_TOKENS, (r + 1) * DP_TOKENS)."""
    rng = np.random.default_rng(5)
    shape = (DP_RANKS * DP_TOKENS, EP_HIDDEN)
    return [tuple(rng.normal(0, 1, shape).astype(np.float32) for _ in range(2))
            for _ in range(DP_STEPS)]


class ChunkedLoss(nn.Cell):
    """The mean over `chunks` equal parts of the batch of the MSE of layer(part): the loss of
    one process doing what ranks that each take one part do (an expert capacity counts the
    tokens of one call)."""

    def __init__(self, layer, chunks):
        super().__init__()
        self.layer = layer
        self.chunks = chunks
        self.mse = nn.MSELoss()

    def construct(self, x, target):
        n = x.shape[0] // self.chunks
        total = 0.0
        for c in range(self.chunks):
            total = total + self.mse(self.layer(x[c * n:(c + 1) * n]),
                                     target[c * n:(c + 1) * n])
        return total / self.chunks


def dp_train(layer, batches, network, train_step):
    """DP_STEPS steps of SGD with a bias update after each: {"loss": [...], "dropped": [...],
    "weights/<name>": ...}; network(layer) is the loss network, train_step(net, opt) the step."""
    reset_expert_load(layer)
    step = train_step(network(layer), nn.SGD(layer.trainable_params(), learning_rate=LEARNING_RATE))
    losses, dropped = [], []
    for x, target in batches:
        losses.append(float(step(Tensor(x), Tensor(target)).asnumpy()))
        update_expert_bias(layer)
        dropped.append(dropped_fraction(layer)[0])
    result = {"loss": np.array(losses), "dropped": np.array(dropped)}
    result.update({"weights/" + k: v for k, v in weights_of(layer).items()})
    return result


# -- the exchange pair on its own -----------------------------------------------------------------

EXCHANGE_ROWS = 5  # per rank
EXCHANGE_HIDDEN = 3


def exchange_case(seed=2):
    """send [RANKS, RANKS] int64 (send[s, d]: rows s sends to d; each row sums to
    EXCHANGE_ROWS, with zeros), x [RANKS, M, H] (rows of each rank, by destination),
    y [RANKS, RANKS * M, H] (what each rank sends back), cot [RANKS, RANKS * M, H]."""
    rng = np.random.default_rng(seed)
    send = np.zeros((RANKS, RANKS), np.int64)
    for s in range(RANKS):
        cuts = np.sort(rng.integers(0, EXCHANGE_ROWS + 1, RANKS - 1))
        send[s] = np.diff(np.concatenate([[0], cuts, [EXCHANGE_ROWS]]))
    send[0] = [EXCHANGE_ROWS] + [0] * (RANKS - 1)  # rank 1 receives nothing from rank 0
    m, h = EXCHANGE_ROWS, EXCHANGE_HIDDEN
    x = rng.normal(0, 1, (RANKS, m, h)).astype(np.float32)
    y = rng.normal(0, 1, (RANKS, RANKS * m, h)).astype(np.float32)
    cot = rng.normal(0, 1, (RANKS, RANKS * m, h)).astype(np.float32)
    return send, x, y, cot


def alltoallv(x, send):
    """numpy AlltoAllV: x [RANKS, rows, H] per source -> per destination the rows received,
    source by source (a list of [R_d, H])."""
    out = []
    for d in range(RANKS):
        parts = []
        for s in range(RANKS):
            start = send[s, :d].sum()
            parts.append(x[s][start:start + send[s, d]])
        out.append(np.concatenate(parts))
    return out


# -- every operator: (op, inputs, attrs, golden outputs) ------------------------------------------

def op_input(a, dtype="float32"):
    """Integers keep their dtype, float32 arrays (x_norm, weights) stay float32, the other float
    arrays take the test's dtype."""
    if a is None:
        return None
    a = np.asarray(a)
    return tensor(a) if a.dtype.kind in "iu" or a.dtype == np.float32 else tensor(a, dtype)


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
    if form == "shared":  # one [K, N] weight for every group (a dense layer)
        inputs, golden = [x, w[1], gl, b], ref.grouped_matmul(x, w[1], counts, b)
    elif form == "shared_transposed":  # its [N, K] form over one group (the models' projections)
        one = np.array([7], np.int64)
        inputs, golden = [x, w[1].T.copy(), one, None], ref.grouped_matmul(x, w[1], one)
    elif form == "transpose_weight":
        wt = w.transpose(0, 2, 1).copy()
        inputs, golden = [x, wt, gl, None], ref.grouped_matmul(x, w, counts)
    elif form == "transpose_x":
        inputs, golden = [x, dy, gl, None], ref.grouped_matmul(x, dy, counts, transpose_x=True)
    else:
        inputs, golden = [x, w, gl, b], ref.grouped_matmul(x, w, counts, b)
    attrs = dict(transpose_x=form == "transpose_x",
                 transpose_weight=form in ("transpose_weight", "shared_transposed"),
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


def _cast(rng, dtype, to="bfloat16"):
    x = rounded(rng.normal(size=(4, 7)) * 3, dtype)
    return CAST, [x], dict(dtype=to), (ref.cast(x, to),)


def _dequantize(rng, dtype):
    weight = rng.integers(-128, 128, (3, 4, 5)).astype(np.int8)
    scale = rng.uniform(0.01, 1, (3, 5)).astype(np.float32)
    index = np.array([2, 0, 2], np.int32)
    return DEQUANTIZE, [weight, scale, index], {}, (ref.dequantize(weight, scale, index),)


def _weight_quant_gmm(rng, dtype, counts=(2, 0, 3), padding=0):
    """Weight-only int8 experts' product: an expert without rows, rows past the last (padded)."""
    counts = np.array(counts, np.int64)
    x = rng.normal(size=(int(counts.sum()) + padding, 6)).astype(np.float32)
    weight = rng.integers(-128, 128, (len(counts), 6, 5)).astype(np.int8)
    scale = rng.uniform(0.01, 0.1, (len(counts), 5)).astype(np.float32)
    return (WEIGHT_QUANT_GROUPED_MATMUL, [x, weight, scale, counts], dict(padded=padding > 0),
            (ref.weight_quant_grouped_matmul(x, weight, scale, counts),))


def _rms_norm(rng, dtype, shape=(2, 3, 16), eps=1e-6):
    x = rng.normal(0, 2, shape).astype(np.float32)
    weight = rng.normal(1, 0.5, shape[-1:]).astype(np.float32)
    return RMS_NORM, [x, weight], dict(eps=eps), (ref.rms_norm(x, weight, eps),)


def _add_rms_norm(rng, dtype, shape=(2, 3, 16), eps=1e-6):
    x = rng.normal(0, 2, shape).astype(np.float32)
    residual = rng.normal(0, 2, shape).astype(np.float32)
    weight = rng.normal(1, 0.5, shape[-1:]).astype(np.float32)
    return ADD_RMS_NORM, [x, residual, weight], dict(eps=eps), ref.add_rms_norm(x, residual,
                                                                                  weight, eps)


def _decode_attention(rng, dtype, b=2, heads=4, kv_heads=2, length=6, d=8, slot=3, scaling=0.35):
    angles = rng.uniform(0, 10, (b, 1, 1, d // 2))
    angles = np.concatenate([angles, angles], -1)
    mask = np.where(rng.random((b, 1, 1, length)) < 0.3, -1e9, 0)
    mask[..., slot] = 0
    floats = [rng.normal(size=(b, heads, 1, d)), rng.normal(size=(b, kv_heads, 1, d)),
              rng.normal(size=(b, kv_heads, 1, d)), np.cos(angles), np.sin(angles),
              rng.normal(size=(b, kv_heads, length, d)), rng.normal(size=(b, kv_heads, length, d)),
              mask]
    inputs = [a.astype(np.float32) for a in floats] + [np.int32(slot)]
    return (DECODE_ATTENTION, inputs, dict(scaling=scaling),
            ref.decode_attention(*inputs, scaling=scaling))


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
    "grouped_matmul_shared_weight": lambda r, d: _gmm(r, d, "shared", True),
    "grouped_matmul_shared_weight_transposed": lambda r, d: _gmm(r, d, "shared_transposed",
                                                                 padding=2),
    "moe_ffn_padded": lambda r, d: _moe_ffn(r, d, "silu", padding=2),
    "permute": _permute,
    "unpermute": _unpermute,
    "unpermute_unweighted": lambda r, d: _unpermute(r, d, False),
    "unpermute_backward": _unpermute_backward,
    "unpermute_backward_unweighted": lambda r, d: _unpermute_backward(r, d, False),
    "cast": _cast,
    "cast_to_float16": lambda r, d: _cast(r, d, "float16"),
    "cast_to_float32": lambda r, d: _cast(r, d, "float32"),
    "dequantize": _dequantize,
    "weight_quant_grouped_matmul": _weight_quant_gmm,
    "weight_quant_grouped_matmul_padded": lambda r, d: _weight_quant_gmm(r, d, (0, 1, 0), 2),
    "rms_norm": _rms_norm,
    "rms_norm_one_row_large_eps": lambda r, d: _rms_norm(r, d, (1, 64), eps=0.5),
    "add_rms_norm": _add_rms_norm,
    "add_rms_norm_one_row_large_eps": lambda r, d: _add_rms_norm(r, d, (1, 64), eps=0.5),
    "decode_attention": _decode_attention,
    "decode_attention_one_head_per_key": lambda r, d: _decode_attention(r, d, 1, 3, 3, 4, 6, 0,
                                                                        scaling=1.0),
}


def compare(outs, golden, dtype):
    """Each output against its golden value: integers exactly, floats within the dtype's tolerance."""
    assert len(outs) == len(golden)
    for out, want in zip(outs, golden):
        if np.asarray(want).dtype.kind in "iu":
            np.testing.assert_array_equal(numpy(out), want)
        else:
            assert_close(numpy(out), want, dtype)
