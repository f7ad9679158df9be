"""ExpertParallel: the process group that shares a MoE layer's experts, and how they are split."""
import mindspore as ms

from .dispatcher import ExpertDispatcher

__all__ = ["ExpertParallel", "EXCHANGES"]

# How routed rows travel between ranks (see exchange.py): "alltoallv" (ops.AlltoAllV, exact
# sizes; Ascend/HCCL) or "allreduce" (an AllReduce-based emulation with static shapes; any
# backend, the only one with CPU kernels).
EXCHANGES = ("alltoallv", "allreduce")


class ExpertParallel:
    """The ranks that split the experts of every MoE layer between them (expert parallelism).

    Create it after `mindspore.communication.init()` and pass it to `MoELayer(...,
    expert_parallel=ep)`. Rank r then holds experts `[r*E/n, (r+1)*E/n)` of each layer (n the
    group size); the router and the shared experts are replicated, and each rank feeds its own
    tokens and gets back the output rows of its own tokens.

    Args:
        group: the communication group (a name given to `mindspore.communication.create_group`);
            None for the world group.
        exchange: "auto" (the default: "alltoallv" on Ascend, "allreduce" elsewhere),
            "alltoallv" or "allreduce" (see `EXCHANGES`).

    Attributes: `group`, `rank` (this process's rank in the group), `size` (n), `exchange`.
    `ExpertParallel.single()` is a group of this process alone, without communication.
    """

    def __init__(self, group=None, exchange="auto"):
        from mindspore.communication import GlobalComm, get_group_size, get_rank

        if not GlobalComm.INITED:
            raise RuntimeError("ExpertParallel: call mindspore.communication.init() first (in a "
                               "script launched with msrun)")
        self.group = GlobalComm.WORLD_COMM_GROUP if group is None else group
        self.rank = get_rank(self.group)
        self.size = get_group_size(self.group)
        if exchange == "auto":
            exchange = "alltoallv" if ms.get_context("device_target") == "Ascend" else "allreduce"
        if exchange not in EXCHANGES:
            raise ValueError(f"ExpertParallel: exchange must be 'auto' or one of {EXCHANGES}, got "
                             f"{exchange!r}")
        self.exchange = exchange

    @classmethod
    def single(cls):
        """The expert-parallel path on this process alone, with no process group: every
        exchange is the identity, so a layer computes bit for bit what the local layer computes
        (a way to check the path, or to run code written for expert parallelism in one
        process)."""
        ep = cls.__new__(cls)
        ep.group, ep.rank, ep.size, ep.exchange = None, 0, 1, "none"
        return ep

    def dispatcher(self, num_experts, hidden_size):
        """The token dispatcher of a MoE layer of num_experts experts split over this group
        (ms_moe_ops.nn.dispatcher's interface): MoELayer(..., expert_parallel=ep) calls it."""
        return ExpertDispatcher(self, num_experts, hidden_size)

    def local_experts(self, num_experts, owner="MoELayer"):
        """E/n, the experts of each rank; ValueError when n does not divide E."""
        if not isinstance(num_experts, int) or num_experts % self.size:
            raise ValueError(f"{owner}: num_experts must be a multiple of the expert-parallel "
                             f"group size {self.size} (each rank holds E/n experts), got "
                             f"num_experts={num_experts!r}")
        return num_experts // self.size

    def __repr__(self):
        return (f"ExpertParallel(group={self.group!r}, rank={self.rank}, size={self.size}, "
                f"exchange={self.exchange!r})")
