"""Training with expert parallelism: the gradients of the replicated parameters are all-reduced
so that every rank takes the same step."""
from mindspore import nn, ops

from ..nn.losses import set_loss_scale

__all__ = ["ExpertParallelGradReducer", "ExpertParallelTrainStep", "expert_parameter_names"]

_REDUCTIONS = ("mean", "sum")

_reduce = ops.MultitypeFuncGraph("_reduce")


@_reduce.register("Function", "Function", "Number", "Bool", "Tensor")
def _reduce_one(all_reduce, data_reduce, scale, replicated, grad):
    grad = all_reduce(grad) if replicated else data_reduce(grad)
    if scale != 1.0:
        grad = grad * scale
    return grad


def expert_parameter_names(network):
    """Names of the parameters split over ranks: those every Cell of network declares with a
    `sharded_parameters()` method (an expert-parallel MoELayer: its routed experts')."""
    return {p.name for _, cell in network.cells_and_names()
            for p in getattr(cell, "sharded_parameters", tuple)()}


class ExpertParallelGradReducer(nn.Cell):
    """Makes per-rank gradients into the step every rank takes.

    With expert parallelism each rank's backward already gives its experts' complete gradient
    (the gradient of the sum of all ranks' losses: the rows of every rank that reached the
    expert came back through the exchange), while the gradients of the replicated parameters
    (router, shared experts and every non-MoE parameter: data parallelism) hold only this rank's
    tokens' part. This Cell all-reduces (sums) the latter over every rank (`world_group`) and,
    with data-parallel replicas of the expert-parallel group (ExpertParallel(size=...)), the
    experts' over their replicas (`data_group`); then, with reduction="mean", divides every
    gradient by the number of ranks W.

    - "mean" (default): the gradient of the mean of the W ranks' losses. When each rank's loss
      is a mean over its own tokens and all ranks have as many tokens, that is one process's
      gradient on all ranks' tokens together with a mean loss.
    - "sum": the gradient of the sum of the ranks' losses (losses that are sums over tokens, or
      already divided by n).

    A loss scale (TrainOneStepCell's sens) multiplies every rank's loss alike, so it passes
    through unchanged either way.

    construct(grads: tuple, one per parameter of `parameters`) -> tuple.
    """

    def __init__(self, network, parameters, expert_parallel, reduction="mean"):
        super().__init__()
        if reduction not in _REDUCTIONS:
            raise ValueError(f"ExpertParallelGradReducer: reduction must be one of {_REDUCTIONS}, "
                             f"got {reduction!r}")
        sharded = expert_parameter_names(network)
        ep = expert_parallel
        self.replicated = tuple(p.name not in sharded for p in parameters)
        self.scale = 1.0 / ep.world_size if reduction == "mean" else 1.0
        # ExpertParallel.single(): nothing to reduce
        self.all_reduce = (ops.Identity() if ep.world_size == 1 else
                           ops.AllReduce(group=ep.world_group))
        self.data_reduce = (ops.Identity() if ep.data_size == 1 else
                            ops.AllReduce(group=ep.data_group))
        self.hyper_map = ops.HyperMap()

    def construct(self, grads):
        return self.hyper_map(ops.partial(_reduce, self.all_reduce, self.data_reduce, self.scale),
                              self.replicated, grads)


class ExpertParallelTrainStep(nn.TrainOneStepCell):
    """nn.TrainOneStepCell for an expert-parallel network: the same step on every rank.

    network: the network with its loss (each rank's own batch); optimizer: over its trainable
    parameters; expert_parallel: the ExpertParallel of its MoE layers; sens: the loss scale (the
    routers' training losses get it too: set_loss_scale); reduction: "mean" or "sum", see
    ExpertParallelGradReducer. Returns this rank's loss. Call
    `ms_moe_ops.update_expert_bias(network)` between steps as in one process: the token counts
    behind it are summed over the group, so every rank's expert_bias stays the same.
    """

    def __init__(self, network, optimizer, expert_parallel, sens=1.0, reduction="mean"):
        super().__init__(network, optimizer, sens)
        set_loss_scale(network, sens)  # the routers' training losses scaled as the loss is
        self.grad_reducer = ExpertParallelGradReducer(network, self.weights, expert_parallel,
                                                      reduction)
