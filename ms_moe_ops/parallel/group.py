"""ExpertParallel: the process group that shares a MoE layer's experts, how they are split, and the
data-parallel replicas of that group."""
import numbers

import mindspore as ms

from .dispatcher import ExpertDispatcher

__all__ = ["ExpertParallel", "EXCHANGES"]

# How routed rows travel between ranks (see exchange.py): "alltoallv" (ops.AlltoAllV, exact
# sizes; Ascend/HCCL) or "allreduce" (an AllReduce-based emulation with static shapes; any
# backend, the only one with CPU kernels). With pad_to_capacity every rank sends each rank the
# same number of rows: "alltoallv" then runs ops.AlltoAll, "allreduce" its emulation.
EXCHANGES = ("alltoallv", "allreduce")

# the communication groups made here, by name (MindSpore refuses to create a name twice)
_CREATED = set()


class ExpertParallel:
    """The ranks that split the experts of every MoE layer between them (expert parallelism),
    and, with `size`, the data-parallel replicas of that split.

    Create it after `mindspore.communication.init()` and pass it to `MoELayer(...,
    expert_parallel=ep)`. Rank r of the group then holds experts `[r*E/n, (r+1)*E/n)` of each
    layer (n the group size); the router and the shared experts are replicated, and each rank
    feeds its own tokens and gets back the output rows of its own tokens.

    Args:
        group: the expert-parallel communication group (a name given to
            `mindspore.communication.create_group`), which is then the whole training world (no
            data parallelism); None (default) for the world group, or the groups that `size` makes.
        exchange: "auto" (the default: "alltoallv" on Ascend, "allreduce" elsewhere),
            "alltoallv" or "allreduce" (see `EXCHANGES`).
        size: None (default): one expert-parallel group (`group`). An integer n dividing the world
            size W: W/n expert-parallel groups of n consecutive ranks (ranks [0, n), [n, 2n), ...)
            that are data-parallel replicas of each other: the ranks holding the same experts
            (equal rank in their groups) form a data-parallel group of W/n ranks.

    Attributes: `group`, `rank` (this process's rank in the group), `size` (n), `exchange`;
    `data_group`/`data_size` (the replicas of this rank's experts: None/1 without data
    parallelism); `world_group`/`world_size` (every rank that trains the model: the replicated
    parameters' gradients and the routers' token counts are summed over it).
    `ExpertParallel.single()` is a group of this process alone, without communication.
    """

    def __init__(self, group=None, exchange="auto", size=None):
        from mindspore.communication import GlobalComm, get_group_size, get_rank

        if not GlobalComm.INITED:
            raise RuntimeError("ExpertParallel: call mindspore.communication.init() first (in a "
                               "script launched with msrun)")
        if exchange == "auto":
            exchange = "alltoallv" if ms.get_context("device_target") == "Ascend" else "allreduce"
        if exchange not in EXCHANGES:
            raise ValueError(f"ExpertParallel: exchange must be 'auto' or one of {EXCHANGES}, got "
                             f"{exchange!r}")
        self.exchange = exchange
        world = GlobalComm.WORLD_COMM_GROUP
        self.data_group, self.data_size = None, 1
        if size is None:
            self.group = world if group is None else group
            self.world_group = self.group
        else:
            if group is not None:
                raise ValueError(f"ExpertParallel: give the group or its size, not both (got "
                                 f"group={group!r}, size={size!r})")
            self.group, self.data_group, self.data_size = _split(world, size)
            self.world_group = world
        self.rank = 0 if self.group is None else get_rank(self.group)
        self.size = 1 if self.group is None else get_group_size(self.group)
        self.world_size = get_group_size(self.world_group)

    @classmethod
    def single(cls):
        """The expert-parallel path on this process alone, with no process group: every
        exchange is the identity, so a layer computes bit for bit what the local layer computes
        (a way to check the path, or to run code written for expert parallelism in one
        process)."""
        ep = cls.__new__(cls)
        ep.group, ep.rank, ep.size, ep.exchange = None, 0, 1, "none"
        ep.data_group, ep.data_size, ep.world_group, ep.world_size = None, 1, None, 1
        return ep

    def dispatcher(self, num_experts, hidden_size, capacity=None):
        """The token dispatcher of a MoE layer of num_experts experts split over this group
        (ms_moe_ops.nn.dispatcher's interface; capacity: the layer's ExpertCapacity or None):
        MoELayer(..., expert_parallel=ep) calls it."""
        return ExpertDispatcher(self, num_experts, hidden_size, capacity)

    def local_experts(self, num_experts, owner="MoELayer"):
        """E/n, the experts of each rank; ValueError when n does not divide E."""
        if not isinstance(num_experts, int) or num_experts % self.size:
            raise ValueError(f"{owner}: num_experts must be a multiple of the expert-parallel "
                             f"group size {self.size} (each rank holds E/n experts), got "
                             f"num_experts={num_experts!r}")
        return num_experts // self.size

    def __repr__(self):
        return (f"ExpertParallel(group={self.group!r}, rank={self.rank}, size={self.size}, "
                f"exchange={self.exchange!r}, data_size={self.data_size})")


def _split(world, size):
    """(expert-parallel group, data-parallel group or None, data-parallel size) of this rank when
    the world is split into groups of `size` consecutive ranks; creates the groups (once)."""
    from mindspore.communication import get_group_size, get_rank

    world_size, rank = get_group_size(world), get_rank(world)
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1 or \
            world_size % size:
        raise ValueError(f"ExpertParallel: size must be a positive divisor of the world size "
                         f"{world_size} (the ranks split into groups of that size), got {size!r}")
    size, replicas = int(size), world_size // int(size)
    first = rank - rank % size
    ep = world if replicas == 1 else _group(f"ms_moe_ops_ep{size}_{first // size}",
                                            range(first, first + size))
    dp = None if replicas == 1 else _group(f"ms_moe_ops_dp{size}_{rank % size}",
                                           range(rank % size, world_size, size))
    if size == 1:  # every rank holds every expert: data parallelism only, no group of one
        ep = None if replicas > 1 else world
    return ep, dp, replicas


def _group(name, ranks):
    from mindspore.communication import create_group

    if name not in _CREATED:
        create_group(name, list(ranks))
        _CREATED.add(name)
    return name
