"""One rank of the expert-parallel Ascend dry run (tests/test_ascend_dry_run_ep.py), launched with
msrun: the package resolves as on Atlas A2 (CANN with every kernel), a network of MoELayers with
their experts split over the ranks and the AlltoAllV exchange trains one step through
ExpertParallelTrainStep, compiled in GRAPH mode on CPU; then the same with the experts padded to
their capacity (pad_to_capacity: the fixed-size AlltoAll). What stopped each, what its compiled
IR breaks and its dimensions known only at run time go to OUT/rank<r>.json.

    msrun --worker_num=2 --local_worker_num=2 ... tests/ascend_dry_run_ep_worker.py OUT
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import mindspore as ms  # noqa: E402
from mindspore import Tensor, nn  # noqa: E402

ms.set_device("CPU")
from mindspore.communication import init  # noqa: E402

init()

from ascend_ir import dynamic_dimensions, read_ir, saving_ir  # noqa: E402
from ascend_rules import RULES  # noqa: E402
from ascend_sim import backend_refusal  # noqa: E402
from ms_moe_ops import MoELayer  # noqa: E402
from ms_moe_ops.ops import _cann, _op, _platform  # noqa: E402
from ms_moe_ops.parallel import ExpertParallel, ExpertParallelTrainStep  # noqa: E402

H = 32
PRESETS = [dict(ffn_hidden_size=16, num_experts=8, top_k=2, n_group=2, topk_group=1,
                n_shared_experts=1),
           dict(ffn_hidden_size=16, num_experts=8, top_k=2, score_func="softmax",
                aux_loss_coeff=0.01)]
PADDED = dict(capacity_factor=1.0, pad_to_capacity=True)


class Net(nn.Cell):
    def __init__(self, ep, **capacity):
        super().__init__()
        self.layers = nn.CellList([MoELayer(H, **p, **capacity, expert_parallel=ep)
                                   for p in PRESETS])

    def construct(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


class Loss(nn.Cell):
    def __init__(self, net):
        super().__init__()
        self.net = net

    def construct(self, x):
        return (self.net(x) ** 2).mean()


def compiled(ep, ir_dir, **capacity):
    """{"refused", "error", "broken", "applied", "dynamic"} of one training step."""
    net = Net(ep, **capacity)
    step = ExpertParallelTrainStep(Loss(net), nn.Adam(net.trainable_params(), 1e-3), ep)
    x = Tensor(np.random.default_rng(ep.rank).normal(size=(2, 8, H)).astype(np.float32))
    result = {}
    try:
        with saving_ir(ir_dir):
            step(x)
        result["refused"], result["error"] = None, "the CPU backend ran an Ascend graph"
    except (RuntimeError, TypeError, ValueError) as error:
        result["refused"], result["error"] = backend_refusal(error), str(error)[:3000]
    if result["refused"] is not None:
        graph, path = read_ir(ir_dir)
        result["broken"] = [f"[{r.name}] {m}" for r in RULES for m in r.broken(graph, "A2")]
        result["applied"] = [r.name for r in RULES if r.applies(graph)]
        with open(path) as f:
            result["dynamic"] = dynamic_dimensions(f.read())
    return result


def main(out):
    _platform.device_target = lambda: "Ascend"
    _platform.soc_family = lambda target=None: _platform.A2
    _cann.kernel_missing = lambda kernel: ""
    _cann.unavailable = lambda kernel, *_: ""  # symbols, headers and SoC op-info (ascend_sim)
    _op.choose.cache_clear()
    ep = ExpertParallel(exchange="alltoallv")
    result = {"rank": ep.rank}
    result.update(compiled(ep, os.path.join(out, f"ir{ep.rank}")))
    result["padded"] = compiled(ep, os.path.join(out, f"ir{ep.rank}-padded"), **PADDED)
    with open(os.path.join(out, f"rank{ep.rank}.json"), "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main(sys.argv[1])
