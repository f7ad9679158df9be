"""One rank of the expert-parallel x data-parallel tests (tests/test_parallel_dp.py), launched with
msrun on 4 workers (or as two nodes of 2): ExpertParallel(size=2) makes 2 expert-parallel groups
of 2 ranks that are data-parallel replicas of each other; each run of cases.DP_RUNS trains this
rank's share of the layer on its own tokens with ExpertParallelTrainStep, and OUT/rank<r>.npz gets
the losses, the dropped fractions, the weights and, for the padded capacity in GRAPH mode, the
lines of the compiled graph with a dimension known only at run time.

    msrun --worker_num=4 --local_worker_num=4 ... tests/ep_dp_worker.py OUT [graph]
"""
import contextlib
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
from mindspore import nn  # noqa: E402

import cases as case  # noqa: E402  (its conftest import sets the device: CPU)
from ascend_ir import dynamic_dimensions, read_ir, saving_ir  # noqa: E402
from mindspore.communication import get_rank, init  # noqa: E402

init()

from ms_moe_ops.parallel import ExpertParallel, ExpertParallelTrainStep, shard_experts  # noqa: E402


def main(out_dir, only_mode=None):
    ep = ExpertParallel(size=case.DP_EP_SIZE)
    world = get_rank()
    assert (ep.size, ep.data_size, ep.world_size) == (case.DP_EP_SIZE, 2, case.DP_RANKS), repr(ep)
    assert ep.rank == world % case.DP_EP_SIZE
    mine = slice(world * case.DP_TOKENS, (world + 1) * case.DP_TOKENS)
    batches = [(x[mine], t[mine]) for x, t in case.dp_batches()]
    result = {}
    for config, mode in case.DP_RUNS:
        if only_mode is not None and mode != only_mode:
            continue
        case.set_mode(mode)
        layer = case.dp_layer(config, ep)
        case.load_weights(layer, shard_experts(case.dp_weights(config), ep.rank, ep.size))
        ir_dir = os.path.join(out_dir, f"ir{world}")
        watch = config == "capacity" and mode == "graph"
        with saving_ir(ir_dir) if watch else contextlib.nullcontext():
            trained = case.dp_train(layer, batches, lambda net: nn.WithLossCell(net, nn.MSELoss()),
                                    lambda net, opt: ExpertParallelTrainStep(net, opt, ep))
        result.update({f"{config}/{mode}/{k}": v for k, v in trained.items()})
        if watch:
            with open(read_ir(ir_dir)[1]) as f:
                result[f"{config}/{mode}/dynamic"] = np.array(dynamic_dimensions(f.read()), str)
    np.savez(os.path.join(out_dir, f"rank{world}.npz"), **result)


if __name__ == "__main__":
    main(sys.argv[1], *sys.argv[2:])
