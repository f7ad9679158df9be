"""One rank of tests/test_option_matrix.py::test_on_two_processes (msrun, 2 processes, CPU): the
environment msrun(env=...) gave it, ExpertParallel's options, an expert-parallel MoELayer with the
training losses on, one ExpertParallelTrainStep per (reduction, sens), and one step of
ExpertParallel(size=1) (data parallelism alone); saves OUT/rank<r>.npz.
`single_process()` computes, in one process, what each rank must get.

    msrun --worker_num=2 ... tests/option_matrix_worker.py OUT
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402

import cases as case  # noqa: E402  (its conftest import sets the device: CPU)
from ms_moe_ops import MoELayer  # noqa: E402

OPTIONS = dict(ffn_hidden_size=6, num_experts=4, top_k=2, score_func="softmax",
               aux_loss_coeff=0.5, seq_aux_loss_coeff=0.7, z_loss_coeff=0.3)
# sens != 1 with the losses on: see test_option_matrix.py::test_loss_scale_reaches_the_losses
STEPS = (("mean", 1.0), ("sum", 1.0))
LEARNING_RATE = 0.1


def layer(ep=None):
    return MoELayer(case.EP_HIDDEN, **OPTIONS, expert_parallel=ep)


def full_weights():
    """{name: numpy} of the single-process layer: routers far from ties, zero state."""
    rng = np.random.default_rng(0)
    return {name: (rng.normal(0, 0.6 if "router" in name else 0.4, p.shape) if p.requires_grad
                   else p.asnumpy()).astype(np.float32)  # state as built: zeros, a scale of 1
            for name, p in layer().parameters_and_names()}


def local_layer():
    out = layer()
    case.load_weights(out, full_weights())
    return out


def _tokens(r):
    x, cot, target = case.ep_tokens()
    mine = slice(r * case.EP_TOKENS, (r + 1) * case.EP_TOKENS)
    return x[mine].reshape(2, -1, case.EP_HIDDEN), cot[mine].reshape(2, -1, case.EP_HIDDEN), \
        target[mine].reshape(2, -1, case.EP_HIDDEN)


def _grads(net, x, cot):
    result = case.forward_backward(net, x, cot)
    result["aux_losses"] = net.router.aux_losses.asnumpy()
    return result


def single_process():
    """[per rank: {key: expected}]: rank r's output, input gradient, replicated gradients and
    losses are the local layer's on rank r's tokens; its experts' gradients the sum over ranks
    of the local ones; a training step moves replicated weights by the reduced gradients."""
    local = [_grads(local_layer(), *_tokens(r)[:2]) for r in range(case.RANKS)]
    weights = full_weights()
    # the gradients of the MSE over each rank's tokens
    per_rank = [_step_grads(r) for r in range(case.RANKS)]
    out = []
    for r in range(case.RANKS):
        expected = {k: local[r][k] for k in ("out", "dx", "aux_losses")}
        for key in local[r]:
            if not key.startswith("grad/"):
                continue
            name = key[len("grad/"):]
            if _routed(name):
                total = sum(g[key] for g in local)
                e = total.shape[0] // case.RANKS
                expected[key] = total[r * e:(r + 1) * e]
            else:
                expected[key] = local[r][key]
        for reduction, sens in STEPS:
            for name, w in weights.items():
                if name not in per_rank[0]:
                    continue
                g = sum(p[name] for p in per_rank)  # all-reduced, or complete (experts)
                if _routed(name):
                    e = g.shape[0] // case.RANKS
                    g, w = g[r * e:(r + 1) * e], w[r * e:(r + 1) * e]
                scale = sens / case.RANKS if reduction == "mean" else sens
                expected[f"step/{reduction}/{name}"] = w - LEARNING_RATE * scale * g
        # ExpertParallel(size=1): every rank all experts, data parallelism alone: the mean of the
        # ranks' gradients of every parameter
        for name, w in weights.items():
            if name in per_rank[0]:
                g = sum(p[name] for p in per_rank) / case.RANKS
                expected[f"data_parallel/{name}"] = w - LEARNING_RATE * g
        out.append(expected)
    return out


def _unwrapped(name):
    """A parameter's name in the bare layer (nn.WithLossCell prefixes its network's)."""
    return name.replace("_backbone.", "")


def _routed(name):
    """A routed expert's parameter (split over the ranks), whatever the wrapping Cells' prefix."""
    return name.split(".")[-2] == "experts"


def _step_grads(r):
    net = local_layer()
    x, _, target = _tokens(r)
    loss = nn.WithLossCell(net, nn.MSELoss())
    grads = ms.grad(loss, grad_position=None, weights=net.trainable_params())(Tensor(x),
                                                                             Tensor(target))
    return {_unwrapped(p.name): g.asnumpy() for p, g in zip(net.trainable_params(), grads)}


def main(out_dir):
    from mindspore.communication import GlobalComm, init

    init()
    from ms_moe_ops.parallel import ExpertParallel, ExpertParallelTrainStep, shard_experts

    result = {"env": os.environ.get("MATRIX_WORKER_VALUE", "(not set)")}
    ep = ExpertParallel()
    result["exchange/auto"] = ep.exchange
    result["group/world"] = "ok" if ep.size == case.RANKS else f"size {ep.size}"
    # a group given by name (MindSpore's CPU collectives take the world group only)
    named = ExpertParallel(group=GlobalComm.WORLD_COMM_GROUP, exchange="allreduce")
    assert ExpertParallel(exchange="alltoallv").exchange == "alltoallv"  # builds; runs on Ascend
    r = named.rank
    full = full_weights()
    net = MoELayer(case.EP_HIDDEN, **OPTIONS, expert_parallel=named)
    case.load_weights(net, shard_experts(full, r, named.size))
    x, cot, target = _tokens(r)
    result.update(_grads(net, x, cot))
    result.pop("expert_bias")
    for reduction, sens in STEPS:
        net = MoELayer(case.EP_HIDDEN, **OPTIONS, expert_parallel=named)
        case.load_weights(net, shard_experts(full, r, named.size))
        optimizer = nn.SGD(net.trainable_params(), learning_rate=LEARNING_RATE)
        step = ExpertParallelTrainStep(nn.WithLossCell(net, nn.MSELoss()), optimizer, named,
                                       sens=sens, reduction=reduction)
        step(Tensor(x), Tensor(target))
        for p in net.trainable_params():
            result[f"step/{reduction}/{_unwrapped(p.name)}"] = p.asnumpy()
    alone = ExpertParallel(size=1)  # data parallelism alone: every expert on every rank
    assert (alone.size, alone.data_size, alone.world_size) == (1, case.RANKS, case.RANKS)
    net = MoELayer(case.EP_HIDDEN, **OPTIONS, expert_parallel=alone)
    case.load_weights(net, full)
    step = ExpertParallelTrainStep(nn.WithLossCell(net, nn.MSELoss()),
                                   nn.SGD(net.trainable_params(), learning_rate=LEARNING_RATE), alone)
    step(Tensor(x), Tensor(target))
    for p in net.trainable_params():
        result[f"data_parallel/{_unwrapped(p.name)}"] = p.asnumpy()
    np.savez(os.path.join(out_dir, f"rank{r}.npz"), **result)


if __name__ == "__main__":
    main(sys.argv[1])
