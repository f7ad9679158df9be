"""One rank of the expert-parallel tests, launched with msrun by
tests/test_parallel_distributed.py: runs the expert-parallel case of tests/cases.py on this rank's
experts and tokens and saves everything it got to OUT/rank<r>.npz (and its checkpoints to OUT/).

    msrun --worker_num=2 --local_worker_num=2 ... tests/ep_worker.py OUT
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn, ops  # noqa: E402

# the suite's cases (their conftest sets the device, CPU, which MindSpore fixes at init())
import cases as case  # noqa: E402
from mindspore.communication import init  # noqa: E402

init()

from ms_moe_ops import MoELayer  # noqa: E402
from ms_moe_ops.parallel import (AllReduceExchange, AlltoAllVExchange, ExpertParallel,  # noqa: E402
                                 ExpertParallelTrainStep, shard_experts)


class Exchanged(nn.Cell):
    """(dispatch(x), combine(y), d/dx sum(dispatch(x) * cot), d/dy sum(combine(y) * cot[:M]))."""

    def __init__(self, exchange):
        super().__init__()
        self.exchange = exchange
        self.grad = ops.GradOperation()

    def dispatch_loss(self, x, plan, cot):
        return (self.exchange.dispatch(x, plan) * cot).sum()

    def combine_loss(self, y, plan, cot):
        return (self.exchange.combine(y, plan) * cot[:y.shape[0] // case.RANKS]).sum()

    def construct(self, x, y, send, cot):
        plan = self.exchange.plan(send, x.shape[0])
        return (self.exchange.dispatch(x, plan), self.exchange.combine(y, plan),
                self.grad(self.dispatch_loss)(x, plan, cot), self.grad(self.combine_loss)(y, plan, cot))


def tick(what, start=time.time()):
    """A time stamp in the worker's log: where a slow launch spent its time."""
    print(f"[{time.time() - start:6.1f} s] {what}", flush=True)


def main(out_dir):
    ep = ExpertParallel()
    tick("init")
    r, n = ep.rank, ep.size
    assert n == case.RANKS, n
    result = {}

    send, x, y, cot = case.exchange_case()
    exchange = Exchanged(AllReduceExchange(ep))
    got = exchange(Tensor(x[r]), Tensor(y[r]), Tensor(send), Tensor(cot[r]))
    for name, value in zip(("dispatch", "combine", "dispatch_grad", "combine_grad"), got):
        result[f"exchange/{name}"] = value.asnumpy()
    tick("exchange")

    x_all, cot_all, target_all = case.ep_tokens()
    mine = slice(r * case.EP_TOKENS, (r + 1) * case.EP_TOKENS)
    for config, mode, train in case.EP_RUNS:
        full = case.ep_weights(config)
        case.set_mode(mode)
        key = f"{config}/{mode}/"
        layer = case.ep_layer(config, ep)
        case.load_weights(layer, shard_experts(full, r, n))
        for k, v in case.forward_backward(layer, x_all[mine], cot_all[mine]).items():
            result[key + k] = v
        tick(key + "forward-backward")
        if not train:
            continue
        case.load_weights(layer, shard_experts(full, r, n))
        trained = case.train(layer, x_all[mine], target_all[mine],
                             lambda net, opt: ExpertParallelTrainStep(net, opt, ep))
        for k, v in trained.items():
            result[key + k] = v
        ms.save_checkpoint(layer, os.path.join(out_dir, f"{config}-{mode}-rank{r}.ckpt"))
        result[key + "trained_out"] = layer(Tensor(x_all[mine])).asnumpy()
        tick(key + "train")

    case.set_mode("pynative")
    layer = case.ep_layer("swiglu", ep)
    case.load_weights(layer, shard_experts(case.ep_weights("swiglu"), r, n))
    result["swiglu/bfloat16/out"] = layer(Tensor(x_all[mine], ms.bfloat16)).astype(ms.float32).asnumpy()

    try:
        MoELayer(case.EP_HIDDEN, 4, 3, 2, expert_parallel=ep)
    except ValueError as e:
        result["error/indivisible"] = str(e)

    # the Ascend exchange: its primitive builds here; running it needs HCCL
    a2a = AlltoAllVExchange(ExpertParallel(exchange="alltoallv"), case.EP_HIDDEN).all_to_all
    result["alltoallv/attrs"] = repr((type(a2a).__name__, a2a.group, a2a.block_size, a2a.rank_size))
    np.savez(os.path.join(out_dir, f"rank{r}.npz"), **result)


if __name__ == "__main__":
    main(sys.argv[1])
