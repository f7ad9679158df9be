"""The expert-parallel case both sides of tests/test_parallel_distributed.py run: the msrun
workers (tests/ep_worker.py, one rank each) and the single process that holds every expert and
takes the tokens of all ranks. Layer configurations, weights, tokens and the computations."""
import numpy as np
import mindspore as ms
from mindspore import ParameterTuple, Tensor, nn, ops

from ms_moe_ops import MoELayer, reset_expert_load, update_expert_bias

RANKS = 2
TOKENS = 6  # per rank
HIDDEN = 8
CONFIGS = {
    # DeepSeek-V3 like, with Qwen2-MoE's gated shared expert
    "swiglu": dict(ffn_hidden_size=6, num_experts=4, top_k=2, n_shared_experts=1,
                   shared_expert_gate=True),
    # DeepSeek-V2 like router: softmax, weights not renormalised
    "fastgelu": dict(ffn_hidden_size=5, num_experts=6, top_k=3, activation="fastgelu",
                     score_func="softmax", norm_topk_prob=False),
}
# (configuration, mode, train too): forward-backward everywhere, the 5 training steps once per
# mode (each launch costs, so not every combination)
RUNS = (("swiglu", "pynative", False), ("swiglu", "graph", True), ("fastgelu", "pynative", True))
STEPS = 5
LEARNING_RATE = 0.2
BIAS_UPDATE_RATE = 0.05


def set_mode(mode):
    ms.set_context(mode=ms.GRAPH_MODE if mode == "graph" else ms.PYNATIVE_MODE)


def make_layer(config, expert_parallel=None):
    return MoELayer(HIDDEN, **CONFIGS[config], bias_update_rate=BIAS_UPDATE_RATE,
                    expert_parallel=expert_parallel)


def full_weights(config, seed=0):
    """{name: numpy} for a single-process layer: random weights large enough that routing
    choices are far from ties, zero expert_bias and counts."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, p in make_layer(config).parameters_and_names():
        scale = 0.6 if "router" in name else 0.4
        out[name] = (rng.normal(0, scale, p.shape) if p.requires_grad
                     else np.zeros(p.shape)).astype(np.float32)
    return out


def load(layer, weights):
    for name, p in layer.parameters_and_names():
        p.set_data(Tensor(np.asarray(weights[name], np.float32)))


def weights_of(layer):
    return {name: p.asnumpy().copy() for name, p in layer.parameters_and_names()}


def tokens(seed=1):
    """(x, cotangent, target) of all ranks, [RANKS * TOKENS, HIDDEN] float32 each; rank r has
    rows [r * TOKENS, (r + 1) * TOKENS)."""
    rng = np.random.default_rng(seed)
    shape = (RANKS * TOKENS, HIDDEN)
    return tuple(rng.normal(0, 1, shape).astype(np.float32) for _ in range(3))


class _Objective(nn.Cell):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def construct(self, x, cotangent):
        return (self.layer(x) * cotangent).sum()


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
